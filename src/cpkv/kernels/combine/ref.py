"""The MoE combine, pure torch: the ops the fused kernel replaces.

    combine_ref(y [T*k, D] (rows in expert-sorted pair order), inv int64 [T*k] (pair p = token * k + j sits at row
                inv[p]), t, k, add [T, D] | None) -> [T, D] y's dtype
        s = sum_j y[inv[t k + j]] (float32 accumulation, one rounding); with ``add``: s + add (one more rounding)
"""
from __future__ import annotations

import torch


def combine_ref(y: torch.Tensor, inv: torch.Tensor, t: int, k: int, add: torch.Tensor | None = None) -> torch.Tensor:
    out = y.index_select(0, inv).view(t, k, y.shape[1]).sum(dim=1)
    return out if add is None else out + add
