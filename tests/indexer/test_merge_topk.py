"""The split decode's top-k merge (``kernels.topk.ref.merge_topk_ref``): each part (a rank's pages of a context)
picks its own top-k, the merge of the candidates equals the top-k over the whole row, ties included."""
from __future__ import annotations

import pytest
import torch

from cpkv.kernels.topk.ref import merge_topk_ref, topk_ref


def _local(logits: torch.Tensor, mine: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One part's candidates: the top-k of its own keys (``mine`` bool [n]) -> (positions [T, k], logits [T, k])."""
    t, n = logits.shape
    masked = logits.masked_fill(~mine[None, :], float("-inf"))
    own = int(mine.sum())
    if own <= k:  # every key it holds
        pos = torch.nonzero(mine).flatten()
        pos = torch.cat((pos, torch.full((k - own,), -1))).expand(t, k).clone()
    else:
        ks, ke = torch.zeros(t, dtype=torch.int32), torch.full((t,), n, dtype=torch.int32)
        pos = topk_ref(masked, ks, ke, k).long()
    vals = logits.gather(1, pos.clamp(min=0))
    return pos, vals


@pytest.mark.parametrize("n", [5, 16, 17, 200, 1000])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("levels", [3, 1000])  # few distinct logits: ties everywhere
def test_merged_candidates_are_the_rows_top_k(n, parts, levels):
    g = torch.Generator().manual_seed(n * 31 + parts * 7 + levels)
    t, k, page = 4, 16, 8
    logits = torch.randint(0, levels, (t, n), generator=g).float() / levels
    logits[0, : n // 2] = -0.0  # signed zeros tie with zeros
    logits[1] = 0.0
    owner = torch.randint(0, parts, (-(-n // page),), generator=g).repeat_interleave(page)[:n]
    cands = [_local(logits, owner == r, k) for r in range(parts)]
    got = merge_topk_ref(torch.stack([c[0] for c in cands]), torch.stack([c[1] for c in cands]), k)
    want = topk_ref(logits, torch.zeros(t, dtype=torch.int32), torch.full((t,), n, dtype=torch.int32), k)
    assert torch.equal(got, want)
