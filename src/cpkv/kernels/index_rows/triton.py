"""Triton kernel: the indexer's fp8 keys or queries from their projections (reference:
``cpkv.kernels.index_rows.ref``).

    index_rows(x [R, D] (R = T x heads rows of one head each), heads, cos / sin float32 [T, r / 2], r, interleaved,
               had float32 [D, D], fp8 [R, D], out float32 [R] (any stride), norm=(weight, bias, eps) | None,
               weights float32 [R] | None)

BLOCK_R rows per program, each row a [D] vector (token = row // heads):
    keys     (norm)    LayerNorm: mean, var = div_rn(sum, D) in float32, rstd = div_rn(1, sqrt_rn(var + eps)),
                       ((x - mean) * rstd) * weight + bias
    both               the first r dims rotated (interleaved pairs or halves: (a c - b s, a s + b c)); each element
                       reads its partner by a second (cached) load, normed the same way
                       y = x @ had (the Hadamard rotation, ``tl.dot`` in DOT_PRECISION)
                       scale = max(div_rn(amax |y|, 448), 1e-10), fp8 = rne(clamp(div_rn(y, scale), +-448))
    out                keys: the scale (the index row's float32); queries (``weights``): weights * scale (the
                       folded head weight)
    head_weights(x [T, K] bf16/f32, w float32 [N, K], scale, out float32 [T, N])
        out = (float32(x) @ w^T) * scale: the indexer's head weights (``weights_proj`` kept in float32) without
        a float32 copy of x; ``tl.dot`` in DOT_PRECISION (tf32x3 on the tensor cores: float32-level accuracy;
        ieee float32 on the FMA units ran at a sixth of the bandwidth of x), BLOCK_M rows per program

Compiled without floating-point contraction. Not bit-equal to the reference: LayerNorm's reductions and the
Hadamard sums run in another order than torch's (float32 values within a few ulps): scales agree within 2e-5
relative, fp8 values within one e4m3 step (a value near a rounding midpoint can fall on either side).
"""
from __future__ import annotations

import torch

from cpkv.kernels.fp8_gemm.triton import _jit, tl
from cpkv.kernels.grid import cdiv, check_grid

BLOCK_R = 32  # rows per program at 4 warps (tl.dot wants >= 16). Measured on the H200 (GLM-5, 4 layers, cold 32K):
#               5.7 ms per batch; 64 rows at 8 warps 8.7 ms although ptxas spills 404 B here and not there
DOT_PRECISION = "tf32x3"  # three tf32 products: float32-level accuracy on the tensor cores ("ieee": FMA units)


@_jit
def _index_rows(X, LW, LB, COS, SIN, HAD, WIN, FP8, OUT, R, HEADS, eps, stride_x, stride_c, stride_s, stride_f,
                stride_o, D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
                FOLD: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    tok = r64 // HEADS
    d = tl.arange(0, D)
    half = ROPE // 2
    if INTERLEAVED:
        partner = tl.where(d < ROPE, d ^ 1, d)
        freq = d // 2
        first = d % 2 == 0
    else:
        partner = tl.where(d < half, d + half, tl.where(d < ROPE, d - half, d))
        freq = tl.where(d < half, d, d - half)
        first = d < half
    m2 = rmask[:, None]
    src = X + r64[:, None] * stride_x
    x = tl.load(src + d[None, :], mask=m2, other=0.0).to(tl.float32)
    xp = tl.load(src + partner[None, :], mask=m2, other=0.0).to(tl.float32)
    if NORM:
        mean = tl.div_rn(tl.sum(x, axis=1), D * 1.0)
        xc = x - mean[:, None]
        var = tl.div_rn(tl.sum(xc * xc, axis=1), D * 1.0)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        x = (xc * rstd[:, None]) * tl.load(LW + d).to(tl.float32)[None, :] + tl.load(LB + d).to(tl.float32)[None, :]
        xp = ((xp - mean[:, None]) * rstd[:, None]) * tl.load(LW + partner).to(tl.float32)[None, :] \
            + tl.load(LB + partner).to(tl.float32)[None, :]
    turn = (d < ROPE)[None, :]
    cmask = m2 & turn
    c = tl.load(COS + tok[:, None] * stride_c + freq[None, :], mask=cmask, other=1.0)
    s = tl.load(SIN + tok[:, None] * stride_s + freq[None, :], mask=cmask, other=0.0)
    y = tl.where(first[None, :], x * c - xp * s, xp * s + x * c)
    y = tl.where(turn, y, x)
    had = tl.load(HAD + d[:, None] * D + d[None, :])
    y = tl.dot(y, had, input_precision=PRECISION)
    amax = tl.max(tl.abs(y), axis=1)
    scale = tl.maximum(tl.div_rn(amax, 448.0), 1e-10)  # IEEE division, at least MIN_SCALE (indexer.quant)
    q = tl.clamp(tl.div_rn(y, scale[:, None]), -448.0, 448.0)
    tl.store(FP8 + r64[:, None] * stride_f + d[None, :], q.to(FP8.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=m2)
    if FOLD:
        scale = tl.load(WIN + r64, mask=rmask, other=0.0) * scale
    tl.store(OUT + r64 * stride_o, scale, mask=rmask)


def supported(d: int, r: int) -> bool:
    """A power-of-two head dim >= 16 (``tl.arange``, ``tl.dot``) and an even rope width <= it."""
    return d >= 16 and d & (d - 1) == 0 and r % 2 == 0 and 0 < r <= d


def index_rows(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, r: int, interleaved: bool,
               had: torch.Tensor, fp8: torch.Tensor, out: torch.Tensor,
               norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
               weights: torch.Tensor | None = None) -> None:
    """Writes fp8 [R, D] and out [R] from x [R, D] (module docstring); unit column strides, ``had`` contiguous."""
    rows, d = x.shape
    if rows == 0:
        return
    lw, lb, eps = norm if norm is not None else (x, x, 0.0)
    _index_rows[check_grid((cdiv(rows, BLOCK_R),))](
        x, lw, lb, cos, sin, had, weights if weights is not None else out, fp8, out, rows, heads, float(eps),
        x.stride(0), cos.stride(0), sin.stride(0), fp8.stride(0), out.stride(0), D=d, ROPE=r,
        INTERLEAVED=interleaved, NORM=norm is not None, FOLD=weights is not None, BLOCK=BLOCK_R,
        PRECISION=DOT_PRECISION, num_warps=4, enable_fp_fusion=False)


HEAD_BLOCKS = (64, 64)  # head_weights: (rows, K) per tile (155 registers at tf32x3; 128 rows: 255)


@_jit
def _head_weights(X, W, OUT, T, N, scale, stride_x, stride_w, stride_o, K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    r64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K a compile-time constant (the model's hidden size)
        kmask = k0 + ks < K
        a = tl.load(X + r64[:, None] * stride_x + (k0 + ks)[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        b = tl.load(W + cols[None, :].to(tl.int64) * stride_w + (k0 + ks)[:, None],
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(OUT + r64[:, None] * stride_o + cols[None, :], acc * scale, mask=rmask[:, None] & cmask[None, :])


def head_weights(x: torch.Tensor, w: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Writes out [T, N] = (float32(x) @ w^T) * scale (module docstring); unit column strides."""
    t, k = x.shape
    n = w.shape[0]
    if t == 0:
        return
    bm, bk = HEAD_BLOCKS
    _head_weights[check_grid((cdiv(t, bm),))](
        x, w, out, t, n, float(scale), x.stride(0), w.stride(0), out.stride(0), K=k, BLOCK_M=bm,
        BLOCK_N=max(16, 1 << (n - 1).bit_length()), BLOCK_K=bk, PRECISION=DOT_PRECISION, num_warps=4,
        num_stages=3, enable_fp_fusion=False)
