"""Triton kernels of the block-scaled fp8 GEMMs (reference: ``cpkv.kernels.fp8_gemm.ref``).

    act_quant(x [M, K] bf16/f32, q fp8 [M, K], s float32 (M, ceil(K/128)) any strides)
        per token per 1 x 128 group: s = amax / 448 (0 for a zero group), q = rne(x / s); the scale tensor's
        strides are the caller's (``torch._scaled_mm`` wants them outer-dim-major: strides (1, M))
    swiglu_quant(gu [M, 2I], rw float32 [M] | None, q fp8 [M, I], s float32 [M, ceil(I/128)])
        a = silu(g) * u (* rw), g = gu[:, :I], u = gu[:, I:], quantised as act_quant
    grouped_gemm(a fp8 [R, K], a_s float32 [R, ceil(K/128)] (row-major), offs int32 [E], b fp8 [E, N, K],
                 b_s float32 [E, ceil(N/128), ceil(K/128)], c bf16 [R, N])
        rows sorted by expert: row i of expert e (offs[e-1] <= i < offs[e]) gets
        c[i] = sum_g a_s[i, g] b_s[e, n // 128, g] (a[i, g] . b[e, n, g]) for every group g of 128 along K.
        Rows at or past offs[-1] are not written.

The grouped GEMM never reads the offsets on the host: it launches cdiv(R, 128) + E row tiles of 128 rows
(each expert adds at most one partial tile) times cdiv(N, BLOCK_N) column tiles; ``tile_ends`` (three
small torch ops on the device) counts each expert's tiles cumulatively, a program finds its expert by a
binary search over those counts, and a program past the last expert's tiles returns. Any R (0 included), any
expert loads (empty experts included), any K and N (masked). This module imports Triton: only the
dispatch points import it, after ``cpkv.kernels.platform.use_triton``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpkv.kernels.grid import cdiv, check_grid, flat_grid

GROUP = 128
QUANT_ROWS = 16  # rows per program of the quantisation kernels (one 128-wide group each)


@triton.jit
def _store_quant(x, rows, rmask, cols, cmask, Q, S, g, stride_q, stride_sm, stride_sg):
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.div_rn(amax, 448.0)  # IEEE division, as the reference (a plain / is approximate on the GPU)
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.clamp(tl.div_rn(x, safe[:, None]), -448.0, 448.0)
    r64 = rows.to(tl.int64)
    tl.store(Q + r64[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=rmask[:, None] & cmask[None, :])
    tl.store(S + r64 * stride_sm + g.to(tl.int64) * stride_sg, scale, mask=rmask)


@triton.jit
def _act_quant(X, Q, S, M, K, stride_x, stride_q, stride_sm, stride_sg, G, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    g, mb = pid % G, pid // G
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * 128 + tl.arange(0, 128)
    rmask, cmask = rows < M, cols < K
    r64 = rows.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    _store_quant(x, rows, rmask, cols, cmask, Q, S, g, stride_q, stride_sm, stride_sg)


@triton.jit
def _swiglu_quant(GU, RW, Q, S, M, I, stride_gu, stride_q, stride_sm, stride_sg, G,
                  HAS_RW: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    g, mb = pid % G, pid // G
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * 128 + tl.arange(0, 128)
    rmask, cmask = rows < M, cols < I
    m2 = rmask[:, None] & cmask[None, :]
    base = GU + rows.to(tl.int64)[:, None] * stride_gu + cols[None, :]
    gate = tl.load(base, mask=m2, other=0.0).to(tl.float32)
    up = tl.load(base + I, mask=m2, other=0.0).to(tl.float32)
    a = gate / (1.0 + tl.exp(-gate)) * up
    if HAS_RW:
        a = a * tl.load(RW + rows, mask=rmask, other=0.0)[:, None]
    _store_quant(a, rows, rmask, cols, cmask, Q, S, g, stride_q, stride_sm, stride_sg)


TILE_M = 128  # rows per tile of the grouped GEMM (its tile map, ``tile_ends``, is built for this size)
# autotuned per (N, K) on first use (the engine's untimed warm-up pass); shared memory per stage:
# (128 + BLOCK_N) x 128 B of fp8 operands, within the H200's 227 KB up to 5 stages at BLOCK_N 128
CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
           for bn, w, st in ((128, 8, 3), (128, 8, 4), (128, 8, 5), (256, 8, 3), (256, 8, 4), (128, 4, 4),
                             (64, 4, 4))]


@triton.jit
def _grouped_gemm(A, AS, OFFS, TILE_END, B, BS, C, E, N, K, stride_a, stride_as, stride_be, stride_bn,
                  stride_bse, stride_bsn, stride_c,
                  LOG_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n, pid_m = pid % n_tiles, pid // n_tiles
    # this program's expert: the first whose cumulative tile count passes pid_m (binary search, device data)
    lo = pid_m * 0
    hi = lo + E
    for _ in tl.static_range(LOG_E):
        mid = (lo + hi) // 2
        v = tl.load(TILE_END + mid, mask=mid < E, other=2147483647)
        right = v <= pid_m
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    expert = lo
    if expert < E:
        first_tile = tl.load(TILE_END + expert - 1, mask=expert > 0, other=0)
        row_start = tl.load(OFFS + expert - 1, mask=expert > 0, other=0)
        row_end = tl.load(OFFS + expert)
        rows = row_start + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < row_end, cols < N
        r64, c64, e64 = rows.to(tl.int64), cols.to(tl.int64), expert.to(tl.int64)
        ks = tl.arange(0, 128)
        a_ptr = A + r64[:, None] * stride_a + ks[None, :]
        b_ptr = B + e64 * stride_be + c64[None, :] * stride_bn + ks[:, None]
        as_ptr = AS + r64 * stride_as
        bs_ptr = BS + e64 * stride_bse + (cols // 128).to(tl.int64) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, 128)):
            kmask = kb * 128 + ks < K
            a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptr, mask=kmask[:, None] & cmask[None, :], other=0.0)
            sa = tl.load(as_ptr + kb, mask=rmask, other=0.0)
            sb = tl.load(bs_ptr + kb, mask=cmask, other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
            a_ptr += 128
            b_ptr += 128
        tl.store(C + r64[:, None] * stride_c + c64[None, :], acc.to(C.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


_grouped_tuned = triton.autotune(configs=CONFIGS, key=["N", "K"])(_grouped_gemm)


def act_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """x [M, K] -> q fp8 [M, K] (contiguous rows), s float32 (M, ceil(K/128)) in its own strides."""
    m, k = x.shape
    if m == 0:
        return
    g = cdiv(k, GROUP)
    _act_quant[check_grid(flat_grid(g, cdiv(m, QUANT_ROWS)))](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), g, BLOCK_M=QUANT_ROWS, num_warps=4)


def swiglu_quant(gu: torch.Tensor, rw: torch.Tensor | None, q: torch.Tensor, s: torch.Tensor) -> None:
    """gu [M, 2I] (gate | up), rw float32 [M] or None -> q fp8 [M, I], s float32 (M, ceil(I/128))."""
    m, i = q.shape
    if m == 0:
        return
    g = cdiv(i, GROUP)
    _swiglu_quant[check_grid(flat_grid(g, cdiv(m, QUANT_ROWS)))](
        gu, gu if rw is None else rw, q, s, m, i, gu.stride(0), q.stride(0), s.stride(0), s.stride(1), g,
        HAS_RW=rw is not None, BLOCK_M=QUANT_ROWS, num_warps=4)


def tile_ends(offs: torch.Tensor) -> torch.Tensor:
    """offs int32 [E] cumulative row ends -> int32 [E] cumulative TILE_M-row tile counts (on the device)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.cumsum(torch.div(counts + (TILE_M - 1), TILE_M, rounding_mode="floor"), 0, dtype=torch.int32)


def grouped_gemm(a: torch.Tensor, a_s: torch.Tensor, offs: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                 c: torch.Tensor, tiles: torch.Tensor | None = None, config: dict | None = None) -> None:
    """c [R, N] (rows < offs[-1]) = the block-scaled product of each expert's rows (module docstring).
    ``tiles``: ``tile_ends(offs)`` when the caller has it (one per set of offsets); ``config``:
    {"BLOCK_N", "num_warps", "num_stages"} instead of autotuning (the interpreter)."""
    r, k = a.shape
    e, n, _ = b.shape
    if r == 0 or e == 0:
        return
    tiles = tile_ends(offs) if tiles is None else tiles

    def grid(meta: dict) -> tuple[int]:
        return check_grid(flat_grid(cdiv(n, meta["BLOCK_N"]), cdiv(r, TILE_M) + e))

    args = (a, a_s, offs, tiles, b, b_s, c, e, n, k, a.stride(0), a_s.stride(0), b.stride(0), b.stride(1),
            b_s.stride(0), b_s.stride(1), c.stride(0))
    meta = {"LOG_E": e.bit_length(), "BLOCK_M": TILE_M}
    if config is None:
        _grouped_tuned[grid](*args, **meta)
    else:
        _grouped_gemm[grid](*args, **meta, **config)
