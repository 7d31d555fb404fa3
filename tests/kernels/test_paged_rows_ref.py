"""The paged-rows reference (``kernels.paged_rows.ref``): rows of any rank's pool by (owner, row), zeros for row -1,
any count (0 included), bytes exact."""
from __future__ import annotations

import pytest
import torch

from cpkv.kernels.paged_rows.ref import paged_rows_ref


def _pools(cp: int, rows: int = 40, width: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cp)
    return [torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=g) for _ in range(cp)]


@pytest.mark.parametrize("cp", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [0, 1, 17, 300])
def test_rows_come_from_their_owners_and_minus_one_is_zeros(cp, n):
    pools = _pools(cp)
    g = torch.Generator().manual_seed(n)
    owner = torch.randint(0, cp, (n,), generator=g)
    row = torch.randint(-1, 40, (n,), generator=g)
    got = paged_rows_ref(pools, owner, row)
    assert got.dtype == torch.uint8 and tuple(got.shape) == (n, 12)
    for i in range(n):
        want = torch.zeros(12, dtype=torch.uint8) if row[i] < 0 else pools[int(owner[i])][int(row[i])]
        assert torch.equal(got[i], want), i


def test_no_pool_is_a_named_error():
    with pytest.raises(ValueError, match="every rank's pool"):
        paged_rows_ref([], torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
