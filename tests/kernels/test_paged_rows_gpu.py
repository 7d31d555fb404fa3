"""The paged decode's row reads on the GPU (``engine.decode.paged_rows`` with ``bases``: the page gather kernel, a
row taken as its page) against the reference, byte for byte: token (656 B) and index (132 B) rows, two pools,
rows of -1 read as zeros, no rows at all."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("width", [656, 132])
@pytest.mark.parametrize("n", [0, 1, 2048, 70001])
def test_paged_rows_kernel_equals_the_reference(width: int, n: int) -> None:
    from cpkv.engine.paged import RowMap, paged_rows
    from cpkv.kernels.paged_rows.ref import paged_rows_ref

    g = torch.Generator(device="cuda").manual_seed(n + width)
    pools = [torch.randint(0, 256, (5000, width), dtype=torch.uint8, device="cuda", generator=g) for _ in range(2)]
    owner = torch.randint(0, 2, (n,), device="cuda", generator=g)
    row = torch.randint(-1, 5000, (n,), device="cuda", generator=g)
    bases = torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64, device="cuda")
    got = paged_rows(pools, RowMap(owner, row), bases)
    want = paged_rows_ref(pools, owner, row)
    assert got.shape == (n, width) and torch.equal(got, want)
    if n:
        # a planted fault: one row read from the other pool differs
        bad = paged_rows(pools, RowMap(1 - owner[:1], row[:1].clamp(min=0)), bases)
        assert not torch.equal(bad, paged_rows_ref(pools, owner[:1], row[:1].clamp(min=0)))
