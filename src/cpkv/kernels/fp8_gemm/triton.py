"""Triton kernels of the block-scaled fp8 GEMMs (reference: ``cpkv.kernels.fp8_gemm.ref``).

    act_quant(x [M, K] bf16/f32, q fp8 [M, K], s float32 (M, ceil(K/128)) any strides)
        per token per 1 x 128 group: s = amax / 448 (0 for a zero group), q = rne(x / s); the scale tensor's
        strides are the caller's (``torch._scaled_mm`` wants them outer-dim-major: strides (1, M))
    swiglu_quant(gu [M, 2I], rw float32 [M] | None, q fp8 [M, I], s float32 [M, ceil(I/128)])
        a = silu(g) * u (* rw), g = gu[:, :I], u = gu[:, I:], quantised as act_quant
    grouped_gemm(a fp8 [R, K], a_s float32 [R, ceil(K/128)], offs int32 [E], b fp8 [E, N, K],
                 b_s float32 [E, ceil(N/128), ceil(K/128)], c bf16 [R, N])
        rows sorted by expert: row i of expert e (offs[e-1] <= i < offs[e]) gets
        c[i] = sum_g a_s[i, g] b_s[e, n // 128, g] (a[i, g] . b[e, n, g]) for every group g of 128 along K.
        Rows at or past offs[-1] are not written.

The grouped GEMM never reads the offsets on the host: it launches cdiv(R, BLOCK_M) + E row tiles (each
expert adds at most one partial tile) times cdiv(N, BLOCK_N) column tiles; a program walks the offsets to
find its expert and tile, and a program past the last expert's tiles returns. Any R (0 included), any
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
    scale = amax / 448.0
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.clamp(tl.div_rn(x, safe[:, None]), -448.0, 448.0)
    r64 = rows.to(tl.int64)
    tl.store(Q + r64[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=rmask[:, None] & cmask[None, :])
    tl.store(S + r64 * stride_sm + g * stride_sg, scale, mask=rmask)


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


CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
           for bm, bn, w, s in ((128, 128, 8, 3), (64, 128, 4, 4), (128, 256, 8, 3), (128, 64, 4, 4))]

@triton.jit
def _grouped_gemm(A, AS, OFFS, B, BS, C, E, N, K, stride_a, stride_as, stride_be, stride_bn,
                  stride_bse, stride_bsn, stride_c,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n, pid_m = pid % n_tiles, pid // n_tiles
    # find this program's expert and row tile by walking the cumulative row ends (no host offsets)
    expert, row0, row_end = -1, 0, 0
    tiles, prev = 0, 0
    for e in range(0, E):
        end = tl.load(OFFS + e)
        t = tl.cdiv(end - prev, BLOCK_M)
        hit = (pid_m >= tiles) & (pid_m < tiles + t)
        expert = tl.where(hit, e, expert)
        row0 = tl.where(hit, prev + (pid_m - tiles) * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        tiles += t
        prev = end
    if expert >= 0:
        rows = row0 + tl.arange(0, BLOCK_M)
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


def grouped_gemm(a: torch.Tensor, a_s: torch.Tensor, offs: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                 c: torch.Tensor, config: dict | None = None) -> None:
    """c [R, N] (rows < offs[-1]) = the block-scaled product of each expert's rows (module docstring).
    ``config``: {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} instead of autotuning (the interpreter)."""
    r, k = a.shape
    e, n, _ = b.shape
    if r == 0 or e == 0:
        return

    def grid(meta: dict) -> tuple[int]:
        n_tiles = cdiv(n, meta["BLOCK_N"])
        return check_grid(flat_grid(n_tiles, cdiv(r, meta["BLOCK_M"]) + e))

    args = (a, a_s, offs, b, b_s, c, e, n, k, a.stride(0), a_s.stride(0), b.stride(0), b.stride(1), b_s.stride(0),
            b_s.stride(1), c.stride(0))
    if config is None:
        _grouped_tuned[grid](*args)
    else:
        _grouped_gemm[grid](*args, **config)
