"""Triton kernel: the MoE router's scores (reference: ``cpkv.kernels.router.ref``).

    router_scores(x [T, K] bf16/fp16, gate [N, K] bf16/fp16/float32, out float32 [T, N])
        out = sigmoid(float32(x) @ float32(gate)^T)

One [BLOCK_M, BLOCK_N] tile per program (the N tiles of one row block on neighbouring programs: x read from HBM
once); a grid of few tiles (a decode step's rows) also splits K over up to K_SLICES programs per tile, their float32
sums added in slice order by a second kernel (the order, and so the rounding, depends only on the grid's size);
K in BLOCK_K steps on the tensor cores with a float32 accumulator. A 16-bit gate: one dot per step (the
products of two bf16 / fp16 values are exact in float32, only the sums round). A float32 gate: split in the
kernel into three bfloat16 parts g = g_hi + g_mid + g_lo (each the rne rounding of what the previous left: g less
them is at most 2^-27 |g|), three dots into the same accumulator (small parts first): float32-level accuracy
without tf32. The sums run in another order than cuBLAS's: the logits agree with a float64 reference within
2^-18 sum_k |x_k g_k| (tests), as the float32 reference does. sigmoid in float32 (``tl.sigmoid``). The kernel's
name says GEMM: ``cpkv.bench.breakdown`` counts it with the GEMMs (as the cuBLAS GEMM it replaces). CONFIG's tile
is the fastest on GLM-5's shapes (other tiles: BENCHMARKS.md).
"""
from __future__ import annotations

import torch

from cpkv.kernels.fp8_gemm.triton import _jit, tl
from cpkv.kernels.grid import cdiv, check_grid

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for x [T, 6144] x bf16 gate [256, 6144] (GLM-5; far below
# F.linear in float32: benchmarks/elem_kernels.py). A float32 gate: at most 128 columns and 2 stages (launch_config)
CONFIG = (128, 256, 64, 8, 3)
SHARED_LIMIT = 232448  # sm_90's shared memory per block


def launch_config(float32_gate: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of CONFIG; a float32 gate's three bf16 parts per stage
    need more shared memory: at most 128 columns and 2 stages then (128 x 128 tiles at 4 stages asked 278,528 B on
    the H200)."""
    bm, bn, bk, warps, stages = CONFIG
    if float32_gate:
        bn, stages = min(bn, 128), min(stages, 2)
    return bm, bn, bk, warps, stages


@_jit
def _router_gemm(X, G, OUT, T, N, K, stride_x, stride_g, stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, KS: tl.constexpr, PARTIAL: tl.constexpr):
    # program (tile, slice): slice program_id(1) of K (KS wide; the whole of K when not PARTIAL); PARTIAL writes the
    # float32 sums into OUT [slices, T, N] for _router_sum, else sigmoid(sums) into OUT [T, N]
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < T
    cmask = cols < N
    r64 = rows.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * KS
    k_hi = tl.minimum(k_lo + KS, K)
    xp = X + r64[:, None] * stride_x + ks[None, :]
    gp = G + cols[None, :].to(tl.int64) * stride_g + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kmask = k0 + ks < k_hi
        a = tl.load(xp + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(gp + k0, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if SPLIT:
            hi = b.to(tl.bfloat16, fp_downcast_rounding="rtne")
            rest = b - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16, fp_downcast_rounding="rtne")
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16, fp_downcast_rounding="rtne")
            acc = tl.dot(a, lo, acc)
            acc = tl.dot(a, mid, acc)
            acc = tl.dot(a, hi, acc)
        else:
            acc = tl.dot(a, b, acc)
    mask = rmask[:, None] & cmask[None, :]
    if PARTIAL:
        tl.store(OUT + (tl.program_id(1) * T + r64)[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        tl.store(OUT + r64[:, None] * stride_o + cols[None, :], tl.sigmoid(acc), mask=mask)


@_jit
def _router_sum(WS, OUT, T, N, stride_o, SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # out = sigmoid(the slices' partial sums added in slice order)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r64 = rows.to(tl.int64)
    mask = (rows < T)[:, None] & (cols < N)[None, :]
    acc = tl.load(WS + r64[:, None] * N + cols[None, :], mask=mask, other=0.0)
    for s in tl.static_range(1, SLICES):
        acc += tl.load(WS + (s * T + r64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + r64[:, None] * stride_o + cols[None, :], tl.sigmoid(acc), mask=mask)


K_SLICES = 8  # a grid of fewer than FEW_TILES tiles (a decode step's or a short batch's rows) takes K in up to this
FEW_TILES = 16  # many slices, one program each, summed in order by _router_sum: one program walking K = 6144 for
#                 a decode step's row took 73 us on an H200. Larger grids keep one program per tile (no workspace)


def k_slices(tiles: int, k: int, bk: int) -> tuple[int, int]:
    """(slices, K per slice: a multiple of ``bk``) for a grid of ``tiles`` tiles at K = ``k``: 1 slice of all of K
    unless the grid is small; slices of at least four K tiles."""
    split = max(1, min(K_SLICES, k // (4 * bk))) if tiles < FEW_TILES else 1
    per = cdiv(cdiv(k, split), bk) * bk
    return cdiv(k, per), per


def supported(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """x bf16 [T, K] with a bf16 / float32 gate, or x fp16 with an fp16 gate (products exact in float32)."""
    if x.dim() != 2 or gate.dim() != 2 or x.shape[1] != gate.shape[1]:
        return False
    if x.dtype == torch.bfloat16:
        return gate.dtype in (torch.bfloat16, torch.float32)
    return x.dtype == torch.float16 and gate.dtype == torch.float16


def router_scores(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor) -> None:
    """Writes out [T, N] = sigmoid(float32(x) @ float32(gate)^T) (module docstring); unit column strides,
    ``supported(x, gate)``."""
    t, k = x.shape
    n = gate.shape[0]
    if t == 0 or n == 0:
        return
    bm, bn, bk, warps, stages = launch_config(gate.dtype == torch.float32)
    bn = min(bn, max(16, 1 << (n - 1).bit_length()))
    tiles = cdiv(t, bm) * cdiv(n, bn)
    slices, per = k_slices(tiles, k, bk)
    ws = out if slices == 1 else torch.empty((slices, t, n), dtype=torch.float32, device=x.device)
    _router_gemm[check_grid((tiles, slices))](
        x, gate, ws, t, n, k, x.stride(0), gate.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT=gate.dtype == torch.float32, KS=per, PARTIAL=slices > 1, num_warps=warps, num_stages=stages)
    if slices > 1:
        _router_sum[check_grid((cdiv(t, 64), cdiv(n, 64)))](ws, out, t, n, out.stride(0), SLICES=slices, BLOCK_M=64,
                                                           BLOCK_N=64, num_warps=4)
