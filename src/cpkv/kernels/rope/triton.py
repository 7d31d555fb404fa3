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

BLOCK = 64  # (token, head) rows per program


@_jit
def _rope_interleaved(X, COS, SIN, OUT, R, H, stride_xt, stride_xh, stride_c, stride_s, stride_ot, stride_oh,
                      HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    # each row read and written as one contiguous [2 HALF] vector, its pairs split / joined in registers (two
    # stride-2 loads and stores of single elements ran at a tenth of the memory bandwidth)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    tok, head = r64 // H, r64 % H
    cols = tl.arange(0, 2 * HALF)[None, :]
    pair = tl.arange(0, HALF)[None, :]
    m2 = rmask[:, None]
    x = tl.load(X + (tok * stride_xt + head * stride_xh)[:, None] + cols, mask=m2, other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(x, [BLOCK_R, HALF, 2]))
    c = tl.load(COS + tok[:, None] * stride_c + pair, mask=m2, other=0.0)
    s = tl.load(SIN + tok[:, None] * stride_s + pair, mask=m2, other=0.0)
    y = tl.reshape(tl.join(a * c - b * s, a * s + b * c), [BLOCK_R, 2 * HALF])
    tl.store(OUT + (tok * stride_ot + head * stride_oh)[:, None] + cols, y.to(OUT.dtype.element_ty), mask=m2)


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
