"""The page gather's reference semantics (CPU): zero fill and skip."""
from __future__ import annotations

import torch


def test_reference_zero_fills_minus_one_and_skips_skip():
    """src -1: the destination page becomes zeros; src SKIP: it keeps its bytes; else the source page."""
    from cpkv.kernels.page_gather.ref import SKIP, page_gather_ref

    sources = [torch.arange(4 * 8, dtype=torch.uint8).view(4, 8), torch.full((2, 8), 200, dtype=torch.uint8)]
    out = torch.full((4, 8), 7, dtype=torch.uint8)
    page_gather_ref(out, sources, torch.tensor([3, 0, 2, 1]), torch.tensor([0, -1, SKIP, 1]), torch.tensor([2, 0, 0, 1]))
    assert out[3].tolist() == list(range(16, 24)) and out[0].tolist() == [0] * 8
    assert out[2].tolist() == [7] * 8 and out[1].tolist() == [200] * 8
