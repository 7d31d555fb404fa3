"""The weighted SwiGLU activation, pure torch: the ops the fused kernel replaces, with their roundings.

    swiglu_weighted_ref(gu [N, 2I] (gate | up), rw float32 [N]) -> [N, I] gu's dtype
        a = silu(g) (float32 x / (1 + exp(-x)), rounded to gu's dtype), a = a * u (rounded), a = a * rw (float32
        product, rounded): ``F.silu(g).mul_(u).mul_(rw[:, None])``
    swiglu_ref(gu [N, 2I]) -> [N, I]: the dense MLPs' ``F.silu(g) * u`` (the kernel with ``rw`` None)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_weighted_ref(gu: torch.Tensor, rw: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g).mul_(u).mul_(rw[:, None])


def swiglu_ref(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u
