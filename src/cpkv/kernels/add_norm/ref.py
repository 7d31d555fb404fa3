"""Residual add + RMSNorm (+ fp8 quantisation), pure torch: the ops the fused kernel replaces, in their order.

    add_rms_norm_ref(h [T, D], delta [T, D] | None, weight [D], eps, quant)
        -> (h' = h + delta (h's dtype, torch's add: float32 sum rounded once; h itself without delta),
            x = rms_norm(h', weight, eps) (h's dtype: float32 statistics and products, one rounding),
            (q fp8 [T, D], s float32 [T, ceil(D/128)]) = act_quant_ref(x) when ``quant``, else None)

RMSNorm: x = (h' * rstd) * weight with rstd = 1 / sqrt(sum(h'^2) / D + eps) in float32 (``F.rms_norm`` on CPU,
``rms_norm_ref``). The kernel computes the same expression with correctly rounded sqrt and
division; only the order of the float32 sum of squares differs (x within one ulp of its dtype).
"""
from __future__ import annotations

import torch

from cpkv.kernels.fp8_gemm.ref import act_quant_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] -> x's dtype: x * rsqrt(mean(x^2) + eps) * weight as separate float32 passes, rounded once (any
    weight dtype; the reference of ``cpkv.model.ops.rms_norm``'s fused form)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, quant: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(h', x, (q, s) | None) of the module docstring."""
    hs = h if delta is None else h + delta
    x = rms_norm_ref(hs, weight, eps)
    return hs, x, act_quant_ref(x) if quant else None
