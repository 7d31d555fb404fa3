"""Triton kernel: the indexer's fp8 keys or queries from their projections (reference:
``cpkv.kernels.index_rows.ref``).

    index_rows(x [R, D] (R = T x heads rows of one head each), heads, cos / sin float32 [T, r / 2], r, interleaved,
               fp8 [R, D], out float32 [R] (any stride), norm=(weight, bias, eps) | None, weights float32 [R] | None)

BLOCK rows per program, each row held by one thread (token = row // heads):
    keys     (norm)    LayerNorm: mean, var = div_rn(sum, D) in float32, rstd = div_rn(1, sqrt_rn(var + eps)),
                       ((x - mean) * rstd) * weight + bias
    both               the first r dims rotated (interleaved pairs split from the row's one load, or halves with the
                       partner read by a second (cached) load; (a c - b s, a s + b c)), normed the same way
                       y = float32(D^-0.5) * FWHT(y): the Hadamard rotation as log2 D butterfly stages in float32
                       (Sylvester order, the matrix ``ref._hadamard(D)`` / its scale), all in the thread's registers
                       scale = max(div_rn(amax |y|, 448), 1e-10), fp8 = rne(clamp(y / scale, +-448)) with y / scale as
                       q0 = y * r, r = div_rn(1, scale) once per row, plus one fma correction step (the correctly
                       rounded quotient but in rare cases one ulp off: fp8 bytes within one step)
    out                keys: the scale (the index row's float32); queries (``weights``): weights * scale (the
                       folded head weight)
    head_weights(x [T, K] bf16/f32, w float32 [N, K], scale, out float32 [T, N])
        out = (float32(x) @ w^T) * scale: the indexer's head weights (``weights_proj`` kept in float32) without
        a float32 copy of x; ``tl.dot`` in DOT_PRECISION (tf32x3 on the tensor cores: float32-level accuracy;
        ieee float32 on the FMA units ran at a sixth of the bandwidth of x), BLOCK_M rows and one of up to
        HEAD_SPLIT slices of K per program, the slices summed in order by a second kernel

One row per thread with the Hadamard rotation as an in-register butterfly: the other forms (tensor-core
Hadamard dots, FWHT across lanes, other block / warp / persistent shapes) were slower (BENCHMARKS.md).

Compiled without floating-point contraction. Not bit-equal to the reference: LayerNorm's reductions and the
Hadamard sums run in another order than torch's (float32 values within a few ulps): scales agree within 2e-5
relative, fp8 values within one e4m3 step (a value near a rounding midpoint can fall on either side).
"""
from __future__ import annotations

import torch

from cpkv.kernels.fp8_gemm.triton import _jit, tl
from cpkv.kernels.grid import cdiv, check_grid

DOT_PRECISION = "tf32x3"  # head_weights: three tf32 products, float32-level accuracy on the tensor cores
BLOCK_ROWS, NUM_WARPS = 64, 2  # index_rows: rows per program (one per thread); the fastest shape on GLM-5's rows
#                                (benchmarks/elem_kernels.py, BENCHMARKS.md)


@_jit
def _bf_k(y, BLOCK: tl.constexpr, KD: tl.constexpr, J: tl.constexpr, S: tl.constexpr):
    # FWHT stage on bit S of the slice index k (dim 1 of y [BLOCK, KD, J])
    y5 = tl.permute(tl.reshape(y, (BLOCK, KD // (2 * S), 2, S, J)), (0, 1, 3, 4, 2))
    a, b = tl.split(y5)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 4, 2, 3)), (BLOCK, KD, J))


@_jit
def _bf_j(y, BLOCK: tl.constexpr, KD: tl.constexpr, J: tl.constexpr, S: tl.constexpr):
    # FWHT stage on bit S of the in-slice index j (dim 2 of y [BLOCK, KD, J])
    y5 = tl.permute(tl.reshape(y, (BLOCK, KD, J // (2 * S), 2, S)), (0, 1, 2, 4, 3))
    a, b = tl.split(y5)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 2, 4, 3)), (BLOCK, KD, J))


@_jit
def _index_rows(X, LW, LB, COS, SIN, WIN, FP8, OUT, R, HEADS, eps, hscale, stride_x, stride_c, stride_s,
                stride_f, stride_o, D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
                NORM: tl.constexpr, FOLD: tl.constexpr, BLOCK: tl.constexpr, LOG_K: tl.constexpr):
    # The FWHT with each row held by one thread: the row as y [BLOCK, KD, J] (d = J k + j, J = 8
    # bf16 values = one 16-byte load). Triton's coalescing orders equally non-contiguous dims by index, so the
    # lanes go to the rows (dim 0) and the slices k stay in registers: every butterfly stage, LayerNorm's sums
    # and the row's amax stay in the thread. Interleaved RoPE pairs split from the load; halves read the partner
    # columns by a second (cached) load. Launched with one program per block, so the block loop runs once; it
    # stays because the straight-line form compiles to other code (the PTX differs), which was never measured.
    J: tl.constexpr = 8
    KD: tl.constexpr = D // J
    k = tl.arange(0, KD)[None, :, None]
    j = tl.arange(0, J)[None, None, :]
    dd = k * J + j  # [1, KD, J]
    half = ROPE // 2
    if not INTERLEAVED:
        partner = tl.where(dd < half, dd + half, tl.where(dd < ROPE, dd - half, dd))
        freq = tl.where(dd < half, dd, dd - half)
        first = dd < half
    for blk in range(tl.program_id(0), tl.cdiv(R, BLOCK), tl.num_programs(0)):
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < R
        r64 = rows.to(tl.int64)
        tok = (r64 // HEADS)[:, None, None]
        m3 = rmask[:, None, None]
        src = X + r64[:, None, None] * stride_x
        x = tl.load(src + dd, mask=m3, other=0.0).to(tl.float32)
        if not INTERLEAVED:
            xp = tl.load(src + partner, mask=m3, other=0.0).to(tl.float32)
        if NORM:  # LayerNorm's weight and bias read per block (L1; held across blocks they spill, 128
            # registers each; their [1, KD, J] layout is converted to x's through 64 KB of shared memory)
            mean = tl.div_rn(tl.sum(tl.sum(x, axis=2), axis=1), D * 1.0)[:, None, None]
            xc = x - mean
            var = tl.div_rn(tl.sum(tl.sum(xc * xc, axis=2), axis=1), D * 1.0)
            rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))[:, None, None]
            x = (xc * rstd) * tl.load(LW + dd).to(tl.float32) + tl.load(LB + dd).to(tl.float32)
            if not INTERLEAVED:
                xp = ((xp - mean) * rstd) * tl.load(LW + partner).to(tl.float32) \
                    + tl.load(LB + partner).to(tl.float32)
        if INTERLEAVED:
            a, b = tl.split(tl.reshape(x, (BLOCK, KD, J // 2, 2)))
            f = k * (J // 2) + tl.arange(0, J // 2)[None, None, :]  # [1, KD, J / 2]: the pair's frequency
            rot = f < half
            pm = m3 & rot
            c = tl.load(COS + tok * stride_c + f, mask=pm, other=1.0)
            s = tl.load(SIN + tok * stride_s + f, mask=pm, other=0.0)
            y = tl.reshape(tl.join(tl.where(rot, a * c - b * s, a), tl.where(rot, a * s + b * c, b)), (BLOCK, KD, J))
        else:
            turn = dd < ROPE
            cmask = m3 & turn
            c = tl.load(COS + tok * stride_c + freq, mask=cmask, other=1.0)
            s = tl.load(SIN + tok * stride_s + freq, mask=cmask, other=0.0)
            y = tl.where(first, x * c - xp * s, xp * s + x * c)
            y = tl.where(turn, y, x)
        for st in tl.static_range(3):
            y = _bf_j(y, BLOCK, KD, J, 1 << st)
        for st in tl.static_range(LOG_K):
            y = _bf_k(y, BLOCK, KD, J, 1 << st)
        y = y * hscale
        amax = tl.max(tl.max(tl.abs(y), axis=2), axis=1)
        scale = tl.maximum(tl.div_rn(amax, 448.0), 1e-10)
        sc = scale[:, None, None]
        r = tl.div_rn(1.0, scale)[:, None, None]
        q0 = y * r
        q = tl.fma(tl.fma(-q0, sc, y), r, q0)
        q = tl.clamp(q, -448.0, 448.0)
        tl.store(FP8 + r64[:, None, None] * stride_f + dd, q.to(FP8.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=m3)
        if FOLD:
            scale = tl.load(WIN + r64, mask=rmask, other=0.0) * scale
        tl.store(OUT + r64 * stride_o, scale, mask=rmask)


def supported(d: int, r: int) -> bool:
    """A power-of-two head dim >= 16 (``tl.arange``) and an even rope width <= it."""
    return d >= 16 and d & (d - 1) == 0 and r % 2 == 0 and 0 < r <= d


def index_rows(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, r: int, interleaved: bool,
               fp8: torch.Tensor, out: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
               weights: torch.Tensor | None = None) -> None:
    """Writes fp8 [R, D] and out [R] from x [R, D] (module docstring); unit column strides."""
    rows, d = x.shape
    if rows == 0:
        return
    lw, lb, eps = norm if norm is not None else (x, x, 0.0)
    win = weights if weights is not None else out
    _index_rows[check_grid((cdiv(rows, BLOCK_ROWS),))](
        x, lw, lb, cos, sin, win, fp8, out, rows, heads, float(eps), d ** -0.5,
        x.stride(0), cos.stride(0), sin.stride(0), fp8.stride(0), out.stride(0), D=d, ROPE=r,
        INTERLEAVED=interleaved, NORM=norm is not None, FOLD=weights is not None, BLOCK=BLOCK_ROWS,
        LOG_K=(d // 8).bit_length() - 1, num_warps=NUM_WARPS, num_stages=1, enable_fp_fusion=False)


HEAD_BLOCKS = (64, 64)  # head_weights: (rows, K) per tile (155 registers at tf32x3; 128 rows: 255)
HEAD_SPLIT = 8  # head_weights: K in up to this many slices, one program each (a decode step's few rows took one
#                 program walking all of K: 84 us for one row at K 6144 on an H200; sliced, every row count fills more
#                 of the GPU), summed in slice order by a second kernel: a row's value does not depend on T


def head_split(k: int) -> tuple[int, int]:
    """(slices, K per slice: a multiple of the K tile) for ``head_weights`` at K = ``k``; slices of at least four
    K tiles."""
    bk = HEAD_BLOCKS[1]
    split = max(1, min(HEAD_SPLIT, k // (4 * bk)))
    per = cdiv(cdiv(k, split), bk) * bk
    return cdiv(k, per), per


@_jit
def _head_weights(X, W, WS, T, N, stride_x, stride_w, K: tl.constexpr, KS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # program (row block, slice): the slice's partial products of the block's rows, float32, into WS [slices, T, N]
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    r64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * KS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KS, BLOCK_K):  # KS and K compile-time constants (the model's hidden size)
        kk = k_lo + k0 + ks
        kmask = kk < K
        a = tl.load(X + r64[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        b = tl.load(W + cols[None, :].to(tl.int64) * stride_w + kk[:, None],
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    at = (tl.program_id(1) * T + r64)[:, None] * N + cols[None, :]
    tl.store(WS + at, acc, mask=rmask[:, None] & cmask[None, :])


@_jit
def _head_weights_sum(WS, OUT, T, N, scale, stride_o, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # out = (the slices' partials summed in slice order) * scale
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < T)[:, None] & (cols < N)[None, :]
    acc = tl.load(WS + r64[:, None] * N + cols[None, :], mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(WS + (s * T + r64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + r64[:, None] * stride_o + cols[None, :], acc * scale, mask=mask)


def head_weights(x: torch.Tensor, w: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Writes out [T, N] = (float32(x) @ w^T) * scale (module docstring); unit column strides. K in ``head_split``
    slices (a float32 workspace [slices, T, N]), summed in order: a row's value is the same at any T."""
    t, k = x.shape
    n = w.shape[0]
    if t == 0:
        return
    bm, bk = HEAD_BLOCKS
    split, per = head_split(k)
    bn = max(16, 1 << (n - 1).bit_length())
    ws = torch.empty((split, t, n), dtype=torch.float32, device=x.device)
    _head_weights[check_grid((cdiv(t, bm), split))](
        x, w, ws, t, n, x.stride(0), w.stride(0), K=k, KS=per, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION=DOT_PRECISION, num_warps=4, num_stages=3, enable_fp_fusion=False)
    _head_weights_sum[check_grid((cdiv(t, bm),))](
        ws, out, t, n, float(scale), out.stride(0), SPLIT=split, BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
        enable_fp_fusion=False)
