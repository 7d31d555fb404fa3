"""Triton top-k over ragged row ranges (sample, compact, bisect); reference: cpkv.kernels.topk.ref.topk_ref.

x: [T, N] float32 (any row stride), lo/hi: [T] int32 columns (row i's candidates are x[i, lo:hi]),
out: [T, k] int32 (any row stride) receives relative indices c - lo[i], ascending, ties toward the
lower index (the contract of cpkv.kernels.topk.ref).

Keys: float32 bits mapped to an int32 ``skey`` whose signed order is the float order (-0.0 folded
into +0.0). A persistent program takes rows in turn:

    n <= k      : write 0, 1, ..., n-1 then -1 (no pass over the row)
    k < n <= C  : every key is a candidate
    n > C       : a sample of SAMPLE keys (64 spread runs of 64) gives, by bisection on the key bits,
                  a threshold t_low expected to leave about sqrt(k*C) keys above it
    one pass over the row copies the candidates (skey >= t_low) with their columns, in index
    order, into the program's scratch (C slots; prefix sums give the positions)
    k <= m <= C : the exact k-th largest key t comes from a 32-step bisection over the candidates
                  in registers; a last prefix sum writes every candidate above t and the first
                  k - count(> t) equal to t, in index order
    otherwise   : (ties or a skewed sample; rare) the same bisection and write over the whole row,
                  32 counting passes: exact, only slower.

Every step is exact; the sample only decides how much work the exact steps do. The compaction pass
streams [BLOCK/4, 4] tiles of aligned 16-byte loads (the next tile's loads in flight while the current one
is scanned) and stores each candidate's key beside its column, so the exact select reads only the scratch.
A sample miss (m < k or m > C) is retried up to RETRIES times with the sample rank rescaled by TARGET / m
(one more pass each) before the 32-pass fallback, so no launch waits on one slow row. 4 warps and <= 128
registers let 4 programs share an SM; bisection loops are rolled (short compile, low register pressure).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cpkv.kernels.platform import sm_count

SAMPLE = 4096


def candidate_slots(k: int) -> int:
    """C: candidate capacity per row (a power of two, >= 2k and >= 4096)."""
    return max(4096, 1 << (2 * k - 1).bit_length())


@triton.jit
def _skey(x):
    """float32 -> int32 key with the float order (-0.0 -> +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return bits ^ ((bits >> 31) & 2147483647)


@triton.jit
def _count_ge_row(base, n, t, BLOCK: tl.constexpr):
    cnt = tl.zeros([], tl.int32)
    for c in range(0, n, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        m = offs < n
        cnt += tl.sum((m & (_skey(tl.load(base + offs, mask=m, other=0.0)) >= t)).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _write_row(base, n, thr, remaining, out, ob, BLOCK: tl.constexpr):
    """Write, in index order, every column (+ ob) with key > thr and the first `remaining` equal to it."""
    n_sel = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for c in range(0, n, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        m = offs < n
        sk = _skey(tl.load(base + offs, mask=m, other=0.0))
        eq = (m & (sk == thr)).to(tl.int32)
        sel = (m & (sk > thr)) | ((eq != 0) & ((tl.cumsum(eq, axis=0) - eq + n_eq) < remaining))
        seli = sel.to(tl.int32)
        tl.store(out + tl.cumsum(seli, axis=0) - seli + n_sel, offs + ob, mask=sel)
        n_sel += tl.sum(seli, axis=0)
        n_eq += tl.sum(eq, axis=0)


@triton.jit
def _count_eq_row(base, n, t, BLOCK: tl.constexpr):
    cnt = tl.zeros([], tl.int32)
    for c in range(0, n, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        m = offs < n
        cnt += tl.sum((m & (_skey(tl.load(base + offs, mask=m, other=0.0)) == t)).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _kth_largest_loop(skey, valid, r):
    """Largest t with count(valid & skey >= t) >= r (r >= 1 and <= count(valid)); a rolled bit loop."""
    t_u = tl.full([], -2147483648, tl.int32)
    cnt = tl.sum((valid & (skey >= 0)).to(tl.int32), axis=0)
    t_u = tl.where(cnt >= r, t_u, 0)
    for b in range(1, 32):
        trial = t_u | (1 << (31 - b))
        cnt = tl.sum((valid & (skey >= (trial ^ -2147483648))).to(tl.int32), axis=0)
        t_u = tl.where(cnt >= r, trial, t_u)
    return t_u ^ -2147483648


@triton.jit
def _kth_largest_row_loop(base, n, r, BLOCK: tl.constexpr):
    """_kth_largest_row with a rolled bit loop."""
    t_u = tl.full([], -2147483648, tl.int32)
    t_u = tl.where(_count_ge_row(base, n, 0, BLOCK) >= r, t_u, 0)
    for b in range(1, 32):
        trial = t_u | (1 << (31 - b))
        t_u = tl.where(_count_ge_row(base, n, trial ^ -2147483648, BLOCK) >= r, trial, t_u)
    return t_u ^ -2147483648


@triton.jit
def _rank_threshold(base, n, r, SAMPLE: tl.constexpr):
    """Sample key of rank r (1 = largest) among SAMPLE keys of the row (64 spread runs; n > SAMPLE)."""
    s = tl.arange(0, SAMPLE)
    offs = ((s // 64).to(tl.int64) * n // (SAMPLE // 64)).to(tl.int32) + s % 64
    return _kth_largest_loop(_skey(tl.load(base + offs)), s < SAMPLE, r)


@triton.jit
def _compact(rowp, lo, hi, t_low, scols, skeys, C: tl.constexpr, BLOCK: tl.constexpr, DEPTH: tl.constexpr):
    """One streaming pass over row columns [lo, hi): (col - lo, skey) of every key >= t_low, in
    index order, into the first C scratch slots; returns the count (which may exceed C). Blocks are
    [BLOCK // 4, 4] (one aligned 16-byte quad per row of the tile); the loads of the next DEPTH
    (1 or 2) blocks are in flight while the current block is scanned (register buffers)."""
    c0 = tl.multiple_of((lo // 4) * 4, 4)
    hi_up = ((hi + 3) // 4) * 4
    offs = tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    x0 = tl.load(rowp + c0 + offs, mask=c0 + offs < hi_up, other=0.0)
    x1 = x0
    if DEPTH == 2:
        x1 = tl.load(rowp + (c0 + BLOCK) + offs, mask=(c0 + BLOCK) + offs < hi_up, other=0.0)
    m = tl.zeros([], tl.int32)
    for i in range(0, tl.cdiv(hi - c0, BLOCK)):
        cols = tl.multiple_of(c0 + i * BLOCK, 4) + offs
        ncols = tl.multiple_of(c0 + (i + DEPTH) * BLOCK, 4) + offs
        xn = tl.load(rowp + ncols, mask=ncols < hi_up, other=0.0)
        sk = _skey(x0)
        cand = ((cols >= lo) & (cols < hi) & (sk >= t_low)).to(tl.int32)
        per_quad = tl.sum(cand, axis=1)
        pos = (tl.cumsum(per_quad, axis=0) - per_quad + m)[:, None] + tl.cumsum(cand, axis=1) - cand
        ok = (cand != 0) & (pos < C)
        tl.store(scols + pos, cols - lo, mask=ok)
        tl.store(skeys + pos, sk, mask=ok)
        m += tl.sum(per_quad, axis=0)
        if DEPTH == 2:
            x0 = x1
            x1 = xn
        else:
            x0 = xn
    return m


@triton.jit
def _select_from_scratch(scols, skeys, m, out, ob, K: tl.constexpr, C: tl.constexpr, CBLOCK: tl.constexpr):
    """Exact top-K of the m (K <= m <= C) scratch candidates, written (+ ob) to out in index order."""
    slot = tl.arange(0, C)
    valid = slot < m
    sk_all = tl.load(skeys + slot, mask=valid, other=-2147483648)
    thr = _kth_largest_loop(sk_all, valid, K)
    remaining = K - tl.sum((valid & (sk_all > thr)).to(tl.int32), axis=0)
    n_sel = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for c in range(0, m, CBLOCK):
        o = c + tl.arange(0, CBLOCK)
        v = o < m
        sk = tl.load(skeys + o, mask=v, other=-2147483648)
        eq = (v & (sk == thr)).to(tl.int32)
        sel = (v & (sk > thr)) | ((eq != 0) & ((tl.cumsum(eq, axis=0) - eq + n_eq) < remaining))
        si = sel.to(tl.int32)
        tl.store(out + tl.cumsum(si, axis=0) - si + n_sel, tl.load(scols + o, mask=v, other=0) + ob, mask=sel)
        n_sel += tl.sum(si, axis=0)
        n_eq += tl.sum(eq, axis=0)


@triton.jit
def topk_stream_kernel(x_ptr, lo_ptr, hi_ptr, base_ptr, out_ptr, scratch_ptr, T, nprog, stride_x4, stride_out,
                       BASE: tl.constexpr, K: tl.constexpr, C: tl.constexpr, TARGET: tl.constexpr, BLOCK: tl.constexpr,
                       SAMPLE: tl.constexpr, KBLOCK: tl.constexpr, CBLOCK: tl.constexpr, RETRIES: tl.constexpr,
                       DEPTH: tl.constexpr):
    """Variant "stream" (module docstring of topk_triton_stream); stride_x4 = x's row stride / 4."""
    pid = tl.program_id(0)
    for it in range(0, (T - pid + nprog - 1) // nprog):
        row = pid + it * nprog
        lo = tl.load(lo_ptr + row)
        n = tl.maximum(tl.load(hi_ptr + row) - lo, 0)
        # scratch addressed through the row's loaded bounds: keeps the compiler from hoisting
        # per-slot pointer tensors out of the row loop (they would pin ~150 registers)
        scols = scratch_ptr + (pid.to(tl.int64) * (2 * C) + tl.minimum(lo, 0))
        skeys = scols + C
        rowp = x_ptr + row.to(tl.int64) * stride_x4 * 4
        out = out_ptr + row.to(tl.int64) * stride_out
        ob = tl.zeros([], tl.int32)
        if BASE:
            ob = tl.load(base_ptr + row)
        if n <= K:
            for c in range(0, K, KBLOCK):
                offs = c + tl.arange(0, KBLOCK)
                tl.store(out + offs, tl.where(offs < n, offs + ob, -1), mask=offs < K)
        else:
            base = rowp + lo
            r = tl.minimum(tl.maximum((TARGET * SAMPLE + n - 1) // n, 1), SAMPLE)
            m = tl.full([], -1, tl.int32)
            tries = tl.zeros([], tl.int32)
            while ((m < K) | (m > C)) & (tries <= RETRIES):
                t_low = tl.full([], -2147483648, tl.int32)
                if n > C:
                    t_low = _rank_threshold(base, n, r, SAMPLE)
                tl.debug_barrier()
                m = _compact(rowp, lo, lo + n, t_low, scols, skeys, C, BLOCK, DEPTH)
                # m keys lie above the sample's rank-r key: rescale the rank toward TARGET keys
                r_new = tl.minimum(tl.maximum((r * TARGET) // tl.maximum(m, 1), 1), SAMPLE)
                r_new = tl.where((m < K) & (r_new <= r), r + 1, r_new)
                r_new = tl.where((m > C) & (r_new >= r), r - 1, r_new)
                r = tl.minimum(tl.maximum(r_new, 1), SAMPLE)
                tries = tl.where(n > C, tries + 1, RETRIES + 1)
            tl.debug_barrier()
            if (m >= K) & (m <= C):
                _select_from_scratch(scols, skeys, m, out, ob, K, C, CBLOCK)
            else:
                thr = _kth_largest_row_loop(base, n, K, CBLOCK)
                remaining = K - _count_ge_row(base, n, thr, CBLOCK) + _count_eq_row(base, n, thr, CBLOCK)
                _write_row(base, n, thr, remaining, out, ob, CBLOCK)
            tl.debug_barrier()


@dataclass(frozen=True)
class TopkConfig:
    """Launch shape of topk_stream_kernel: warps per program, programs per SM, keys per streaming step
    (block), blocks whose loads are in flight while one is scanned (depth), register cap."""

    num_warps: int = 4
    programs_per_sm: int = 4
    block: int = 1024
    maxnreg: int | None = 128
    depth: int = 1


DEFAULT_CONFIG = TopkConfig()
RETRIES = 2


def topk_triton(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int, out: torch.Tensor,
                config: TopkConfig | None = None, base: torch.Tensor | None = None) -> torch.Tensor:
    """Fill out [T, k] int32 with the top-k relative indices of each row's x[i, lo[i]:hi[i]]
    (module docstring), each plus base[i] when ``base`` (int32 [T]) is given (-1 fill kept): the absolute
    rows the attention reads, without a pass over out. Inputs must already be validated (cpkv.indexer.topk does it)."""
    cfg = config or DEFAULT_CONFIG
    T = x.shape[0]
    if T == 0:
        return out
    c = candidate_slots(k)
    programs = min(T, cfg.programs_per_sm * sm_count(x.device))
    kblock = min(4096, 1 << max(k - 1, 1).bit_length())
    target = int((k * c) ** 0.5)
    scratch = torch.empty(programs, 2 * c, dtype=torch.int32, device=x.device)
    topk_stream_kernel[(programs,)](
        x, lo, hi, lo if base is None else base, out, scratch, T, programs, x.stride(0) // 4, out.stride(0),
        BASE=base is not None, K=k, C=c, TARGET=target, BLOCK=cfg.block, SAMPLE=SAMPLE, KBLOCK=kblock, CBLOCK=1024, RETRIES=RETRIES,
        DEPTH=cfg.depth,
        num_warps=cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    return out
