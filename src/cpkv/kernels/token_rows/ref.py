"""The token row of one layer's new tokens, pure torch: the ops the fused kernel replaces, in their order.

    token_kv_ref(kv [T, D_L + D_R], weight [D_L], cos, sin float32 [T, D_R / 2], eps)
        -> [T, D_L + D_R] kv's dtype: latent = RMSNorm(kv[:, :D_L]) * weight (float32, one rounding) |
           rope = the interleaved rotation of kv[:, D_L:] by (cos, sin) (pairs (a, b) -> (a cos - b sin,
           a sin + b cos), separate float32 products and sums, one rounding)
    token_rows_ref(...) -> uint8 [T, row_bytes] = quant_token_kv_ref(token_kv_ref(...))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cpkv.config import RowFormat
from cpkv.kernels.token_kv.ref import quant_token_kv_ref


def token_kv_ref(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Normed latent | rotated rope key in kv's dtype (module docstring)."""
    d_l = weight.shape[0]
    out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    lat = kv[:, :d_l]
    if weight.dtype == kv.dtype:
        out[:, :d_l] = F.rms_norm(lat, (d_l,), weight, eps)  # the float32 passes below in one kernel
    else:
        xf = lat.float()
        out[:, :d_l] = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(kv.dtype)
    pairs = kv[:, d_l:].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out[:, d_l:] = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return out


def token_rows_ref(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                   fmt: RowFormat) -> torch.Tensor:
    """uint8 [T, row_bytes]: the token rows of ``token_kv_ref``'s values (module docstring)."""
    return quant_token_kv_ref(token_kv_ref(kv, weight, cos, sin, eps), fmt)
