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


@_jit
def _butterfly(y, BLOCK: tl.constexpr, D: tl.constexpr, STEP: tl.constexpr):
    # one stage of the fast Walsh-Hadamard transform: each pair (i, i + STEP), i's bit STEP clear, -> (a + b, a - b)
    y4 = tl.permute(tl.reshape(y, (BLOCK, D // (2 * STEP), 2, STEP)), (0, 1, 3, 2))
    a, b = tl.split(y4)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK, D))


@_jit
def _index_rows_v2(X, LW, LB, COS, SIN, HAD, WIN, FP8, OUT, R, HEADS, eps, hscale, stride_x, stride_c, stride_s,
                   stride_f, stride_o, D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
                   NORM: tl.constexpr, FOLD: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                   FWHT: tl.constexpr = False, LOG_D: tl.constexpr = 0, PAIR_LOADS: tl.constexpr = False):
    # ``_index_rows`` with the loop-invariant work out of the row loop: programs walk blocks program_id,
    # program_id + num_programs, ... (a persistent grid when fewer programs than blocks are launched), the
    # Hadamard operand, the partner / frequency maps and LayerNorm's weight and bias read once per program.
    # SPLIT: y = hscale * ((y_lo @ S + y_mid @ S) + y_hi @ S), S = sign(had) (+-1, exact in bf16), y = y_hi + y_mid
    # + y_lo three bfloat16 parts (each the rne rounding of what the previous left: y less them is 2^-27 |y| at
    # most), bf16 products exact in the float32 accumulator; FWHT: y = hscale * (LOG_D butterfly stages in float32,
    # Sylvester order: H_D = H_2 (x) ... (x) H_2, one stage per index bit), no dot; else one tf32x3 dot with had.
    # PAIR_LOADS (interleaved RoPE only): each pair split from the row's one load, cos / sin read [BLOCK, D / 2]
    # (contiguous), instead of a second load of the row at the partner columns.
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
    turn = (d < ROPE)[None, :]
    hm = tl.load(HAD + d[:, None] * D + d[None, :]) if not FWHT else 0.0
    if SPLIT and not FWHT:
        hm = tl.where(hm > 0, 1.0, -1.0).to(tl.bfloat16)
    PAIRS: tl.constexpr = PAIR_LOADS and INTERLEAVED
    if NORM:
        lw = tl.load(LW + d).to(tl.float32)[None, :]
        lb = tl.load(LB + d).to(tl.float32)[None, :]
        if not PAIRS:
            lwp = tl.load(LW + partner).to(tl.float32)[None, :]
            lbp = tl.load(LB + partner).to(tl.float32)[None, :]
    for blk in range(tl.program_id(0), tl.cdiv(R, BLOCK), tl.num_programs(0)):
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < R
        r64 = rows.to(tl.int64)
        tok = r64 // HEADS
        m2 = rmask[:, None]
        src = X + r64[:, None] * stride_x
        x = tl.load(src + d[None, :], mask=m2, other=0.0).to(tl.float32)
        if not PAIRS:
            xp = tl.load(src + partner[None, :], mask=m2, other=0.0).to(tl.float32)
        if NORM:
            mean = tl.div_rn(tl.sum(x, axis=1), D * 1.0)
            xc = x - mean[:, None]
            var = tl.div_rn(tl.sum(xc * xc, axis=1), D * 1.0)
            rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
            x = (xc * rstd[:, None]) * lw + lb
            if not PAIRS:
                xp = ((xp - mean[:, None]) * rstd[:, None]) * lwp + lbp
        if PAIRS:  # interleaved pairs from one load: x [BLOCK, D / 2, 2] split, rotated, joined
            a, b = tl.split(tl.reshape(x, (BLOCK, D // 2, 2)))
            j = tl.arange(0, D // 2)
            rot = (j < half)[None, :]
            pm = m2 & rot
            c = tl.load(COS + tok[:, None] * stride_c + j[None, :], mask=pm, other=1.0)
            s = tl.load(SIN + tok[:, None] * stride_s + j[None, :], mask=pm, other=0.0)
            y = tl.reshape(tl.join(tl.where(rot, a * c - b * s, a), tl.where(rot, a * s + b * c, b)), (BLOCK, D))
        else:
            cmask = m2 & turn
            c = tl.load(COS + tok[:, None] * stride_c + freq[None, :], mask=cmask, other=1.0)
            s = tl.load(SIN + tok[:, None] * stride_s + freq[None, :], mask=cmask, other=0.0)
            y = tl.where(first[None, :], x * c - xp * s, xp * s + x * c)
            y = tl.where(turn, y, x)
        if FWHT:
            for stage in tl.static_range(LOG_D):
                y = _butterfly(y, BLOCK, D, 1 << stage)
            y = y * hscale
        elif SPLIT:
            hi = y.to(tl.bfloat16, fp_downcast_rounding="rtne")
            rest = y - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16, fp_downcast_rounding="rtne")
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
            acc = tl.dot(lo, hm)
            acc = tl.dot(mid, hm, acc)
            y = tl.dot(hi, hm, acc) * hscale
        else:
            y = tl.dot(y, hm, input_precision="tf32x3")
        amax = tl.max(tl.abs(y), axis=1)
        scale = tl.maximum(tl.div_rn(amax, 448.0), 1e-10)
        q = tl.clamp(tl.div_rn(y, scale[:, None]), -448.0, 448.0)
        tl.store(FP8 + r64[:, None] * stride_f + d[None, :], q.to(FP8.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=m2)
        if FOLD:
            scale = tl.load(WIN + r64, mask=rmask, other=0.0) * scale
        tl.store(OUT + r64 * stride_o, scale, mask=rmask)


# The launch variants (``cpkv bench index-rows`` times each against a copy of the same bytes and checks it against
# the reference). kernel "v1": ``_index_rows`` (one BLOCK-row block per program); "v2": ``_index_rows_v2`` with
# PER_SM programs per SM walking the blocks (0: one program per block), SPLIT the bf16 three-part dot.
VARIANTS = {
    "v1": dict(kernel="v1", BLOCK=32, num_warps=4),  # tf32x3, HAD read and split by every program
    "bf16x3_p": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=8, SPLIT=True),
    "bf16x3_p64": dict(kernel="v2", BLOCK=64, num_warps=4, PER_SM=4, SPLIT=True),
    "fwht": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=0, SPLIT=False, FWHT=True),
    "fwht_p": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=8, SPLIT=False, FWHT=True),
    "fwht_p16": dict(kernel="v2", BLOCK=16, num_warps=4, PER_SM=16, SPLIT=False, FWHT=True),
    "fwht_pairs": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=0, SPLIT=False, FWHT=True, PAIR_LOADS=True),
    "fwht_pairs_p": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=8, SPLIT=False, FWHT=True, PAIR_LOADS=True),
    "fwht_pairs_64": dict(kernel="v2", BLOCK=64, num_warps=8, PER_SM=0, SPLIT=False, FWHT=True, PAIR_LOADS=True),
    "bf16x3_pairs_p": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=8, SPLIT=True, PAIR_LOADS=True),
}
DEFAULT = "v1"  # the variant prepare_index_keys / _queries launch


def supported(d: int, r: int) -> bool:
    """A power-of-two head dim >= 16 (``tl.arange``, ``tl.dot``) and an even rope width <= it."""
    return d >= 16 and d & (d - 1) == 0 and r % 2 == 0 and 0 < r <= d


def index_rows(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, r: int, interleaved: bool,
               had: torch.Tensor, fp8: torch.Tensor, out: torch.Tensor,
               norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
               weights: torch.Tensor | None = None, variant: str | None = None) -> None:
    """Writes fp8 [R, D] and out [R] from x [R, D] (module docstring); unit column strides, ``had`` contiguous
    (``hadamard_matrix(D)``: entries +-float32(D^-0.5)). ``variant``: a key of VARIANTS (None: DEFAULT)."""
    rows, d = x.shape
    if rows == 0:
        return
    v = VARIANTS[variant or DEFAULT]
    lw, lb, eps = norm if norm is not None else (x, x, 0.0)
    win = weights if weights is not None else out
    blocks = cdiv(rows, v["BLOCK"])
    if v["kernel"] == "v1":
        _index_rows[check_grid((blocks,))](
            x, lw, lb, cos, sin, had, win, fp8, out, rows, heads, float(eps),
            x.stride(0), cos.stride(0), sin.stride(0), fp8.stride(0), out.stride(0), D=d, ROPE=r,
            INTERLEAVED=interleaved, NORM=norm is not None, FOLD=weights is not None, BLOCK=v["BLOCK"],
            PRECISION=DOT_PRECISION, num_warps=v["num_warps"], enable_fp_fusion=False)
        return
    programs = min(blocks, _programs(x, v["PER_SM"])) if v["PER_SM"] else blocks
    _index_rows_v2[check_grid((programs,))](
        x, lw, lb, cos, sin, had, win, fp8, out, rows, heads, float(eps), d ** -0.5,
        x.stride(0), cos.stride(0), sin.stride(0), fp8.stride(0), out.stride(0), D=d, ROPE=r,
        INTERLEAVED=interleaved, NORM=norm is not None, FOLD=weights is not None, BLOCK=v["BLOCK"],
        SPLIT=v["SPLIT"], FWHT=v.get("FWHT", False), LOG_D=d.bit_length() - 1, PAIR_LOADS=v.get("PAIR_LOADS", False),
        num_warps=v["num_warps"],
        num_stages=v.get("num_stages", 1), enable_fp_fusion=False)


def _programs(x: torch.Tensor, per_sm: int) -> int:
    """per_sm programs per SM of x's GPU (CPU tensors, Triton's interpreter: per_sm, so the loop runs)."""
    if not x.is_cuda:
        return per_sm
    from cpkv.kernels.platform import sm_count

    return per_sm * sm_count(x)


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
