"""Triton kernel: the interleaved RoPE into a slice (reference: ``cpkv.kernels.rope.ref``).

    rope_interleaved(x [T, H, r] (unit last stride, any other strides), cos / sin float32 [T, r / 2],
                     out [T, H, r] (unit last stride, any other strides))
        out[t, h, 2i], out[t, h, 2i + 1] = rne(a cos_i - b sin_i), rne(a sin_i + b cos_i), (a, b) = x's pair i

BLOCK rows of (token, head) per program. Compiled without floating-point contraction: the products and sums
round as the reference's separate float32 ops (bytes equal to it). Any T and H (0 included); r a power of two.
"""
from __future__ import annotations

import torch

from cpkv.kernels.fp8_gemm.triton import _jit, tl
from cpkv.kernels.grid import cdiv, check_grid

BLOCK = 32  # (token, head) rows per program


@_jit
def _rope_interleaved(X, COS, SIN, OUT, R, H, stride_xt, stride_xh, stride_c, stride_s, stride_ot, stride_oh,
                      HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    tok, head = r64 // H, r64 % H
    pair = tl.arange(0, HALF)[None, :]
    m2 = rmask[:, None]
    src = X + (tok * stride_xt + head * stride_xh)[:, None] + 2 * pair
    a = tl.load(src, mask=m2, other=0.0).to(tl.float32)
    b = tl.load(src + 1, mask=m2, other=0.0).to(tl.float32)
    c = tl.load(COS + tok[:, None] * stride_c + pair, mask=m2, other=0.0)
    s = tl.load(SIN + tok[:, None] * stride_s + pair, mask=m2, other=0.0)
    dst = OUT + (tok * stride_ot + head * stride_oh)[:, None] + 2 * pair
    tl.store(dst, (a * c - b * s).to(OUT.dtype.element_ty), mask=m2)
    tl.store(dst + 1, (a * s + b * c).to(OUT.dtype.element_ty), mask=m2)


def supported(r: int) -> bool:
    """A power-of-two rope width (``tl.arange`` over its pairs)."""
    return r >= 2 and r & (r - 1) == 0


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """Writes out from x (module docstring)."""
    t, h, r = x.shape
    if t * h == 0:
        return
    _rope_interleaved[check_grid((cdiv(t * h, BLOCK),))](
        x, cos, sin, out, t * h, h, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0),
        out.stride(1), HALF=r // 2, BLOCK_R=BLOCK, num_warps=4, enable_fp_fusion=False)
