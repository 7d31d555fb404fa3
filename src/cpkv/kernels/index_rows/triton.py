"""Triton kernel: the indexer's fp8 keys or queries from their projections (reference:
``cpkv.kernels.index_rows.ref``).

    index_rows(x [R, D] (R = T x heads rows of one head each), heads, cos / sin float32 [T, r / 2], r, interleaved,
               had float32 [D, D], fp8 [R, D], out float32 [R] (any stride), norm=(weight, bias, eps) | None,
               weights float32 [R] | None, variant=None)

v1: BLOCK rows per program, each row a [D] vector (token = row // heads):
    keys     (norm)    LayerNorm: mean, var = div_rn(sum, D) in float32, rstd = div_rn(1, sqrt_rn(var + eps)),
                       ((x - mean) * rstd) * weight + bias
    both               the first r dims rotated (interleaved pairs or halves: (a c - b s, a s + b c)); each element
                       reads its partner by a second (cached) load, normed the same way
                       y = x @ had (the Hadamard rotation, ``tl.dot`` in DOT_PRECISION; v2 / v3 below)
                       scale = max(div_rn(amax |y|, 448), 1e-10), fp8 = rne(clamp(div_rn(y, scale), +-448))
    out                keys: the scale (the index row's float32); queries (``weights``): weights * scale (the
                       folded head weight)
    head_weights(x [T, K] bf16/f32, w float32 [N, K], scale, out float32 [T, N])
        out = (float32(x) @ w^T) * scale: the indexer's head weights (``weights_proj`` kept in float32) without
        a float32 copy of x; ``tl.dot`` in DOT_PRECISION (tf32x3 on the tensor cores: float32-level accuracy;
        ieee float32 on the FMA units ran at a sixth of the bandwidth of x), BLOCK_M rows per program

Variants (``VARIANTS``, ``DEFAULT`` the one the dispatch launches; ``index_rows(..., variant=)`` any): v1 above;
v2 the same steps with the loop-invariant work hoisted out of a loop over blocks and y @ had as either three bf16
dots against the matrix's signs (y = y_hi + y_mid + y_lo, each part the rne rounding of what the previous left:
float32-level sums) times float32(D^-0.5), or a fast Walsh-Hadamard transform (log2 D butterfly stages in float32,
Sylvester order) times float32(D^-0.5); v3 that transform with each row in one thread. PAIR_LOADS / interleaved
v3: the RoPE pairs split from the row's one load. RCP: y / scale as y * r, r = div_rn(1, scale) once per row,
plus one fma correction step (the correctly rounded quotient but in rare cases one ulp off).

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
                   FWHT: tl.constexpr = False, LOG_D: tl.constexpr = 0, PAIR_LOADS: tl.constexpr = False,
                   RCP: tl.constexpr = False):
    # ``_index_rows`` with the loop-invariant work out of the row loop: programs walk blocks program_id,
    # program_id + num_programs, ... (a persistent grid when fewer programs than blocks are launched), the
    # Hadamard operand, the partner / frequency maps and LayerNorm's weight and bias read once per program.
    # SPLIT: y = hscale * ((y_lo @ S + y_mid @ S) + y_hi @ S), S = sign(had) (+-1, exact in bf16), y = y_hi + y_mid
    # + y_lo three bfloat16 parts (each the rne rounding of what the previous left: y less them is 2^-27 |y| at
    # most), bf16 products exact in the float32 accumulator; FWHT: y = hscale * (LOG_D butterfly stages in float32,
    # Sylvester order: H_D = H_2 (x) ... (x) H_2, one stage per index bit), no dot; else one tf32x3 dot with had.
    # PAIR_LOADS (interleaved RoPE only): each pair split from the row's one load, cos / sin read [BLOCK, D / 2]
    # (contiguous), instead of a second load of the row at the partner columns. RCP: y / scale as q0 = y * r,
    # r = div_rn(1, scale) once per row, then one Markstein step q0 + fma(-q0, scale, y) * r (the quotient
    # correctly rounded but in rare cases, then one ulp off: fp8 bytes within one step) instead of div_rn per value.
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
        if RCP:
            r = tl.div_rn(1.0, scale)[:, None]
            q0 = y * r
            q = tl.fma(tl.fma(-q0, scale[:, None], y), r, q0)
        else:
            q = tl.div_rn(y, scale[:, None])
        q = tl.clamp(q, -448.0, 448.0)
        tl.store(FP8 + r64[:, None] * stride_f + d[None, :], q.to(FP8.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=m2)
        if FOLD:
            scale = tl.load(WIN + r64, mask=rmask, other=0.0) * scale
        tl.store(OUT + r64 * stride_o, scale, mask=rmask)


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
def _index_rows_v3(X, LW, LB, COS, SIN, WIN, FP8, OUT, R, HEADS, eps, hscale, stride_x, stride_c, stride_s,
                   stride_f, stride_o, D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
                   NORM: tl.constexpr, FOLD: tl.constexpr, BLOCK: tl.constexpr, LOG_K: tl.constexpr,
                   RCP: tl.constexpr):
    # ``_index_rows_v2``'s FWHT with each row held by one thread: the row as y [BLOCK, KD, J] (d = J k + j, J = 8
    # bf16 values = one 16-byte load). Triton's coalescing orders equally non-contiguous dims by index, so the
    # lanes go to the rows (dim 0) and the slices k stay in registers: every butterfly stage, LayerNorm's sums
    # and the row's amax stay in the thread. Interleaved RoPE pairs split from the load; halves read the partner
    # columns by a second (cached) load.
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
        if RCP:
            r = tl.div_rn(1.0, scale)[:, None, None]
            q0 = y * r
            q = tl.fma(tl.fma(-q0, sc, y), r, q0)
        else:
            q = tl.div_rn(y, sc)
        q = tl.clamp(q, -448.0, 448.0)
        tl.store(FP8 + r64[:, None, None] * stride_f + dd, q.to(FP8.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=m3)
        if FOLD:
            scale = tl.load(WIN + r64, mask=rmask, other=0.0) * scale
        tl.store(OUT + r64 * stride_o, scale, mask=rmask)


# The launch variants (``benchmarks/elem_kernels.py`` checks each against the reference and times it next to a
# copy_ of the same bytes). kernel "v1": ``_index_rows``, one BLOCK-row block per program, the float32 Hadamard
# matrix split for tf32x3 by every program (ptxas, sm_90a: 255 registers, ~400 B spilled); "v2":
# ``_index_rows_v2`` (blocks walked per program, PER_SM programs per SM, 0: one per block) with SPLIT (the bf16
# three-part dot against the +-1 matrix) or FWHT (butterflies on registers: Triton spreads each row over 16
# lanes, ~180 shuffles and ~160 shared-memory accesses per thread per block), PAIR_LOADS, RCP; "v3":
# ``_index_rows_v3``, one row per thread (FWHT with no shuffle and, for queries, no shared memory: ~94
# instructions per warp per row against v1's ~460 and v2 FWHT's ~250). Offline figures: tests/kernels/
# test_elem_kernels.py; every variant but bf16x3_p64 (keys: 444 B) compiles without spills.
VARIANTS = {
    "v1": dict(kernel="v1", BLOCK=BLOCK_R, num_warps=4),
    "bf16x3_p": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=8, SPLIT=True),
    "bf16x3_p64": dict(kernel="v2", BLOCK=64, num_warps=4, PER_SM=4, SPLIT=True),  # wgmma
    "bf16x3_pairs_p": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=8, SPLIT=True, PAIR_LOADS=True),
    "fwht_pairs": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=0, FWHT=True, PAIR_LOADS=True),
    "fwht_pairs_p": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=8, FWHT=True, PAIR_LOADS=True),
    "fwht_pairs_64": dict(kernel="v2", BLOCK=64, num_warps=8, PER_SM=0, FWHT=True, PAIR_LOADS=True),
    "fwht_pairs_rcp": dict(kernel="v2", BLOCK=32, num_warps=4, PER_SM=0, FWHT=True, PAIR_LOADS=True, RCP=True),
    "fwht_pairs_64_rcp": dict(kernel="v2", BLOCK=64, num_warps=8, PER_SM=0, FWHT=True, PAIR_LOADS=True, RCP=True),
    "rows": dict(kernel="v3", BLOCK=128, num_warps=4, PER_SM=0, RCP=False),
    "rows_rcp": dict(kernel="v3", BLOCK=128, num_warps=4, PER_SM=0, RCP=True),
    "rows_rcp_64": dict(kernel="v3", BLOCK=64, num_warps=2, PER_SM=0, RCP=True),
    "rows_rcp_p": dict(kernel="v3", BLOCK=128, num_warps=4, PER_SM=2, RCP=True),
}
DEFAULT = "rows_rcp_64"  # the variant prepare_index_keys / _queries launch. 2026-12-01, one H200, T 32768 (GLM-5):
#                          queries 0.317 ms, keys 0.023 ms (v1: 1.646 / 0.087 ms; benchmarks/elem_kernels.py)


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
    if v["kernel"] == "v3":
        _index_rows_v3[check_grid((programs,))](
            x, lw, lb, cos, sin, win, fp8, out, rows, heads, float(eps), d ** -0.5,
            x.stride(0), cos.stride(0), sin.stride(0), fp8.stride(0), out.stride(0), D=d, ROPE=r,
            INTERLEAVED=interleaved, NORM=norm is not None, FOLD=weights is not None, BLOCK=v["BLOCK"],
            LOG_K=(d // 8).bit_length() - 1, RCP=v["RCP"], num_warps=v["num_warps"], num_stages=1,
            enable_fp_fusion=False)
        return
    _index_rows_v2[check_grid((programs,))](
        x, lw, lb, cos, sin, had, win, fp8, out, rows, heads, float(eps), d ** -0.5,
        x.stride(0), cos.stride(0), sin.stride(0), fp8.stride(0), out.stride(0), D=d, ROPE=r,
        INTERLEAVED=interleaved, NORM=norm is not None, FOLD=weights is not None, BLOCK=v["BLOCK"],
        SPLIT=v.get("SPLIT", False), FWHT=v.get("FWHT", False), LOG_D=d.bit_length() - 1, PAIR_LOADS=v.get("PAIR_LOADS", False),
        RCP=v.get("RCP", False), num_warps=v["num_warps"],
        num_stages=v.get("num_stages", 1), enable_fp_fusion=False)


def _programs(x: torch.Tensor, per_sm: int) -> int:
    """per_sm programs per SM of x's GPU (CPU tensors, Triton's interpreter: 2, so each walks several blocks)."""
    if not x.is_cuda:
        return 2
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
