"""Triton kernel: residual add + RMSNorm (+ fp8 quantisation), one program per token row
(reference: ``cpkv.kernels.add_norm.ref``).

    add_rms_norm(h [T, D], delta [T, D] | None, weight [D], eps, h_out [T, D] | None, x [T, D],
                 q fp8 [T, D] | None, s float32 (T, ceil(D/128)) | None)

A row is one [G_PAD, 128] tile (G_PAD = the next power of two of ceil(D / 128); columns past D masked):
    h'   = rne(float32(h) + float32(delta)) in h_out's dtype       (torch's add; h itself without delta)
    rstd = div_rn(1, sqrt_rn(div_rn(sum(h'^2), D) + eps))           (correctly rounded, as 1 / sqrt on CPU)
    x    = rne((h' * rstd) * weight) in x's dtype
    s, q = per 1 x 128 group of float32(x): s = div_rn(amax, 448), q = rne(clamp(div_rn(x, s), +-448)) e4m3
           (``kernels.fp8_gemm.triton.act_quant``'s rule: a zero group stores scale 0 and zeros); s in the
           caller's strides (``torch._scaled_mm``'s outer-dim-major (1, T4))
Compiled without floating-point contraction (``enable_fp_fusion=False``: no product is fused into a sum), so
only the order of the float32 sum of squares differs from the reference. Any T (0 included) and any D.
"""
from __future__ import annotations

import torch

from cpkv.kernels.fp8_gemm.triton import _jit, tl
from cpkv.kernels.grid import check_grid

GROUP = 128


@_jit
def _add_rms_norm(H, DELTA, W, HO, X, Q, S, eps, stride_h, stride_d, stride_ho, stride_x, stride_q, stride_sm,
                  stride_sg, D: tl.constexpr, G_PAD: tl.constexpr, HAS_DELTA: tl.constexpr, QUANT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_PAD)
    cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = cols < D
    h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(DELTA + row * stride_d + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(HO.dtype.element_ty)  # rne (Triton's default downcast)
        tl.store(HO + row * stride_ho + cols, h, mask=mask)
    hf = h.to(tl.float32)
    ss = tl.sum(tl.sum(hf * hf, axis=1), axis=0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, D * 1.0) + eps))
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    x = ((hf * rstd) * w).to(X.dtype.element_ty)
    tl.store(X + row * stride_x + cols, x, mask=mask)
    if QUANT:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), axis=1)
        scale = tl.div_rn(amax, 448.0)  # IEEE division, as the reference
        safe = tl.where(scale > 0, scale, 1.0)
        q = tl.clamp(tl.div_rn(xf, safe[:, None]), -448.0, 448.0)
        tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(S + row * stride_sm + g.to(tl.int64) * stride_sg, scale, mask=g * 128 < D)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 h_out: torch.Tensor | None, x: torch.Tensor, q: torch.Tensor | None = None,
                 s: torch.Tensor | None = None) -> None:
    """Writes h_out (with ``delta``), x and (with ``q``) q, s (module docstring); unit column strides."""
    t, d = h.shape
    if t == 0:
        return
    g_pad = 1 << max(0, (-(-d // GROUP) - 1).bit_length())
    quant = q is not None
    dummy = x
    _add_rms_norm[check_grid((t,))](
        h, delta if delta is not None else h, weight, h_out if h_out is not None else dummy, x,
        q if quant else dummy, s if quant else dummy, float(eps), h.stride(0),
        delta.stride(0) if delta is not None else 0, h_out.stride(0) if h_out is not None else 0, x.stride(0),
        q.stride(0) if quant else 0, s.stride(0) if quant else 0, s.stride(1) if quant else 0,
        D=d, G_PAD=g_pad, HAS_DELTA=delta is not None, QUANT=quant, num_warps=8 if d >= 2048 else 4,
        enable_fp_fusion=False)
