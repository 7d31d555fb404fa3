"""The interleaved rotation, pure torch: the reference of the fused kernel.

    rope_interleaved_ref(x [T, H, r] (pairs (x[2i], x[2i+1])), cos, sin float32 [T, r / 2], dtype)
        -> [T, H, r] ``dtype``: (a cos - b sin, a sin + b cos) as separate float32 products and sums (the form of
        ``Rotary.interleaved_ref``), rounded once
"""
from __future__ import annotations

import torch


def rope_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    c, s = cos[:, None, :], sin[:, None, :]
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(dtype)
