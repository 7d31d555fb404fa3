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

Few rows: the split path. One program a row leaves most SMs idle when the rows are few (the decode step: T = 1..32
generations, N = 32K..128K keys). ``topk_triton`` decides from the shapes and the SM count alone (``splits_for``):
rows longer than C and fewer than the GPU's program slots (programs_per_sm x SMs) share each row among S programs
(a power of two, T * S within the slots, >= MIN_SEGMENT keys each, <= MAX_SPLITS) in two launches
(``topk_split``); every other launch (prefill's thousands of rows) runs the stream kernel above.
``TopkConfig.splits`` forces either (1: the stream kernel).

    compact  grid (T, S): program (i, s) takes segment s of row i, [lo + s*seg, lo + (s+1)*seg) within [lo, hi)
             (seg = n / S rounded up to a multiple of 4). Every program of a row computes the same sample
             threshold t_low (every key when n <= C) and copies its segment's candidates with their columns, in
             index order, into its own slice of CAP slots; its count goes to meta[i, s]
    merge    grid (T,): n <= k rows as above. Otherwise m = the sum of the row's counts; k <= m <= C: the union
             in index order (slice s's candidates after slice s-1's: each union position finds its slice by a
             binary search over the counts' exclusive prefix) is loaded into registers and selected as from the
             stream kernel's scratch. Otherwise (a sample miss): the stream kernel's row path, retries and
             32-pass fallback included, with the row's slices as its scratch.

Slices: [T, S, 2, CAP] int32 (columns, keys), CAP = C, so a slice overflows only when m > C (the merge then reads
none). CAP is a compile-time constant of k alone: sized from N / S it compiled a pair of kernels for every prompt
length, and a first server's cached turns paid 1.7-1.9 s each for them at 78 layers (session 24); at most
T * S <= the GPU's program slots (528 on an H200) slices of 2 C int32: 17 MB; meta: [T, 2S] int32 (counts, then their prefix). Sizes come from shapes only: no
host sync, one CUDA graph capture serves any lo / hi. The split path's bisections stop once the count above the
threshold is exact (the select: the same keys as the full 32 steps) or within 1/16 of the sample rank (t_low),
saving block-wide reductions on the launch's critical path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from cpkv.errors import ConfigError
from cpkv.kernels.platform import sm_count

SAMPLE = 4096
MAX_SPLITS = 64  # programs per row at most (the split path)
MIN_SEGMENT = 1024  # keys per program at least when the split is chosen from the shapes


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
def _write_short(out, n, ob, K: tl.constexpr, KBLOCK: tl.constexpr):
    """A row of n <= K keys: 0, 1, ..., n - 1 (+ ob), then -1."""
    for c in range(0, K, KBLOCK):
        offs = c + tl.arange(0, KBLOCK)
        tl.store(out + offs, tl.where(offs < n, offs + ob, -1), mask=offs < K)


@triton.jit
def _first_rank(n, TARGET: tl.constexpr, SAMPLE: tl.constexpr):
    """The sample rank expected to leave TARGET of a row's n keys above its key."""
    return tl.minimum(tl.maximum((TARGET * SAMPLE + n - 1) // n, 1), SAMPLE)


@triton.jit
def _rescale(r, m, K: tl.constexpr, C: tl.constexpr, TARGET: tl.constexpr, SAMPLE: tl.constexpr):
    """The next sample rank after rank r left m keys above it: toward TARGET keys, moved by at least one on a miss."""
    r_new = tl.minimum(tl.maximum((r * TARGET) // tl.maximum(m, 1), 1), SAMPLE)
    r_new = tl.where((m < K) & (r_new <= r), r + 1, r_new)
    r_new = tl.where((m > C) & (r_new >= r), r - 1, r_new)
    return tl.minimum(tl.maximum(r_new, 1), SAMPLE)


@triton.jit
def _row_topk(rowp, lo, n, out, ob, scols, skeys, r, K: tl.constexpr, C: tl.constexpr, TARGET: tl.constexpr,
              BLOCK: tl.constexpr, SAMPLE: tl.constexpr, CBLOCK: tl.constexpr, RETRIES: tl.constexpr,
              DEPTH: tl.constexpr):
    """One program's exact top-K of the n > K keys rowp[lo:lo + n] (module docstring), starting from sample rank r;
    scols / skeys: C scratch slots each."""
    base = rowp + lo
    m = tl.full([], -1, tl.int32)
    tries = tl.zeros([], tl.int32)
    while ((m < K) | (m > C)) & (tries <= RETRIES):
        t_low = tl.full([], -2147483648, tl.int32)
        if n > C:
            t_low = _rank_threshold(base, n, r, SAMPLE)
        tl.debug_barrier()
        m = _compact(rowp, lo, lo + n, t_low, scols, skeys, C, BLOCK, DEPTH)
        # m keys lie above the sample's rank-r key: rescale the rank toward TARGET keys
        r = _rescale(r, m, K, C, TARGET, SAMPLE)
        tries = tl.where(n > C, tries + 1, RETRIES + 1)
    tl.debug_barrier()
    if (m >= K) & (m <= C):
        _select_from_scratch(scols, skeys, m, out, ob, K, C, CBLOCK)
    else:
        thr = _kth_largest_row_loop(base, n, K, CBLOCK)
        remaining = K - _count_ge_row(base, n, thr, CBLOCK) + _count_eq_row(base, n, thr, CBLOCK)
        _write_row(base, n, thr, remaining, out, ob, CBLOCK)


# T and the program count vary with every batch's token count: not specialised (a value divisible by 16 or not would
# compile another variant mid-serving)
@triton.jit(do_not_specialize=["T", "nprog", "stride_x4"])
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
            _write_short(out, n, ob, K, KBLOCK)
        else:
            _row_topk(rowp, lo, n, out, ob, scols, skeys, _first_rank(n, TARGET, SAMPLE), K, C, TARGET, BLOCK, SAMPLE,
                      CBLOCK, RETRIES, DEPTH)
            tl.debug_barrier()


@triton.jit
def _segment(n, S: tl.constexpr):
    """Keys per segment of a row of n keys split S ways: ceil(n / S) rounded up to a multiple of 4."""
    return ((n + S - 1) // S + 3) // 4 * 4


@triton.jit
def _rank_key(skey, valid, r, total, slack):
    """A key t with r <= count(valid & skey >= t) <= r + slack, or the exact r-th largest key when no bisection
    prefix gets that close (ties); r >= 1 and <= total = count(valid). A bisection on the key bits (as
    _kth_largest_loop) that stops once the count is within the slack."""
    t_u = tl.full([], -2147483648, tl.int32)
    cnt = tl.sum((valid & (skey >= 0)).to(tl.int32), axis=0)
    ok = cnt >= r
    t_u = tl.where(ok, t_u, 0)
    c_t = tl.where(ok, cnt, total)
    b = tl.full([], 1, tl.int32)
    while (b < 32) & (c_t > r + slack):
        trial = t_u | (1 << (31 - b))
        cnt = tl.sum((valid & (skey >= (trial ^ -2147483648))).to(tl.int32), axis=0)
        ok = cnt >= r
        t_u = tl.where(ok, trial, t_u)
        c_t = tl.where(ok, cnt, c_t)
        b += 1
    return t_u ^ -2147483648


@triton.jit
def _sample_threshold(base, n, r, SAMPLE: tl.constexpr):
    """A key with r..r + r/16 of the row's SAMPLE sample keys (the stream kernel's sample; n > SAMPLE) at or above."""
    s = tl.arange(0, SAMPLE)
    offs = ((s // 64).to(tl.int64) * n // (SAMPLE // 64)).to(tl.int32) + s % 64
    return _rank_key(_skey(tl.load(base + offs)), s < SAMPLE, r, SAMPLE, r // 16)


@triton.jit(do_not_specialize=["stride_x4"])
def topk_compact_kernel(x_ptr, lo_ptr, hi_ptr, meta_ptr, scratch_ptr, stride_x4,
                        K: tl.constexpr, C: tl.constexpr, CAP: tl.constexpr, S: tl.constexpr, TARGET: tl.constexpr,
                        BLOCK: tl.constexpr, SAMPLE: tl.constexpr, DEPTH: tl.constexpr, PDL: tl.constexpr):
    """The split path's compact launch (module docstring), grid (T, S); stride_x4 = x's row stride / 4. PDL: let
    the merge launch start now (it waits for this launch's end before reading what it wrote)."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0)
    s = tl.program_id(1)
    lo = tl.load(lo_ptr + row)
    n = tl.maximum(tl.load(hi_ptr + row) - lo, 0)
    seg = _segment(n, S)
    start = s * seg
    m = tl.zeros([], tl.int32)
    if (n > K) & (start < n):
        rowp = x_ptr + row.to(tl.int64) * stride_x4 * 4
        t_low = tl.full([], -2147483648, tl.int32)
        if n > C:
            t_low = _sample_threshold(rowp + lo, n, _first_rank(n, TARGET, SAMPLE), SAMPLE)
        cols = scratch_ptr + (row * S + s).to(tl.int64) * (2 * CAP)
        m = _compact(rowp, lo + start, lo + tl.minimum(start + seg, n), t_low, cols, cols + CAP, CAP, BLOCK, DEPTH)
    tl.store(meta_ptr + row * (2 * S) + s, m)


@triton.jit
def _select_union(slices, excl, m, seg, out, ob, K: tl.constexpr, C: tl.constexpr, CAP: tl.constexpr,
                  S: tl.constexpr, LOG_S: tl.constexpr):
    """Exact top-K of the row's m (K <= m <= C) candidates, slice s's excl[s] .. excl[s + 1] - 1 in union order,
    written (+ ob) to out in index order."""
    p = tl.arange(0, C)
    valid = p < m
    part = tl.zeros([C], tl.int32)
    for i in tl.static_range(LOG_S):  # part = the last slice whose first union position is <= p
        b = S >> (i + 1)
        part = tl.where(tl.load(excl + part + b) <= p, part + b, part)
    slot = part * (2 * CAP) + p - tl.load(excl + part)
    sk = tl.load(slices + slot + CAP, mask=valid, other=-2147483648)
    col = tl.load(slices + slot, mask=valid, other=0) + part * seg
    thr = _rank_key(sk, valid, K, m, 0)
    remaining = K - tl.sum((valid & (sk > thr)).to(tl.int32), axis=0)
    eq = (valid & (sk == thr)).to(tl.int32)
    sel = (valid & (sk > thr)) | ((eq != 0) & (tl.cumsum(eq, axis=0) - eq < remaining))
    si = sel.to(tl.int32)
    tl.store(out + tl.cumsum(si, axis=0) - si, col + ob, mask=sel)


@triton.jit(do_not_specialize=["stride_x4"])
def topk_merge_kernel(x_ptr, lo_ptr, hi_ptr, base_ptr, out_ptr, meta_ptr, scratch_ptr, stride_x4, stride_out,
                      BASE: tl.constexpr, K: tl.constexpr, C: tl.constexpr, CAP: tl.constexpr, S: tl.constexpr,
                      LOG_S: tl.constexpr, TARGET: tl.constexpr, BLOCK: tl.constexpr, SAMPLE: tl.constexpr,
                      KBLOCK: tl.constexpr, CBLOCK: tl.constexpr, RETRIES: tl.constexpr, DEPTH: tl.constexpr,
                      PDL: tl.constexpr):
    """The split path's merge launch (module docstring), grid (T,). PDL: launched as a programmatic dependent of the
    compact launch, it waits for that launch's end before reading its counts and slices (its other inputs, and out,
    were settled before the compact launch started)."""
    row = tl.program_id(0)
    lo = tl.load(lo_ptr + row)
    n = tl.maximum(tl.load(hi_ptr + row) - lo, 0)
    out = out_ptr + row.to(tl.int64) * stride_out
    ob = tl.zeros([], tl.int32)
    if BASE:
        ob = tl.load(base_ptr + row)
    if n <= K:
        _write_short(out, n, ob, K, KBLOCK)
    else:
        if PDL:
            gdc_wait()
        meta = meta_ptr + row * (2 * S)
        cnt = tl.load(meta + tl.arange(0, S))
        m = tl.sum(cnt, axis=0)
        slices = scratch_ptr + row.to(tl.int64) * (S * 2 * CAP)
        if (m >= K) & (m <= C):
            tl.store(meta + S + tl.arange(0, S), tl.cumsum(cnt, axis=0) - cnt)
            tl.debug_barrier()
            _select_union(slices, meta + S, m, _segment(n, S), out, ob, K, C, CAP, S, LOG_S)
        else:  # n > C here (else every key is a candidate): S * CAP >= C slots are the row's scratch
            rowp = x_ptr + row.to(tl.int64) * stride_x4 * 4
            r = _rescale(_first_rank(n, TARGET, SAMPLE), m, K, C, TARGET, SAMPLE)
            _row_topk(rowp, lo, n, out, ob, slices, slices + C, r, K, C, TARGET, BLOCK, SAMPLE, CBLOCK, RETRIES, DEPTH)


@dataclass(frozen=True)
class TopkConfig:
    """Launch shape of topk_stream_kernel: warps per program, programs per SM, keys per streaming step
    (block), blocks whose loads are in flight while one is scanned (depth), register cap. ``splits``: programs per
    row (None: from the shapes and the SM count, ``splits_for``; 1: the stream kernel, one program per row; a power
    of two up to MAX_SPLITS: ``topk_split``, whose compact launch takes the fields above and whose merge
    launch runs ``merge_warps`` warps per row; ``pdl``: the merge as a programmatic dependent launch (Hopper on, its
    launch overlapping the compact launch's run)."""

    num_warps: int = 4
    programs_per_sm: int = 4
    block: int = 1024
    maxnreg: int | None = 128
    depth: int = 1
    splits: int | None = None
    merge_warps: int = 16
    pdl: bool = False

    def __post_init__(self) -> None:
        s = self.splits
        if s is not None and (s < 1 or s > MAX_SPLITS or s & (s - 1)):
            raise ConfigError(f"TopkConfig.splits: expected None or a power of two in 1..{MAX_SPLITS}, got {s!r}")


DEFAULT_CONFIG = TopkConfig()
RETRIES = 2


def splits_for(T: int, N: int, k: int, cfg: TopkConfig, device: torch.device) -> int:
    """Programs per row for T rows of N columns: cfg.splits when set; else 1 (the stream kernel) unless the rows are
    longer than the candidate slots and fewer than the GPU's program slots, then the largest power of two that keeps
    T * splits within them, segments of at least MIN_SEGMENT keys and splits <= MAX_SPLITS."""
    if cfg.splits is not None:
        return cfg.splits
    if N <= candidate_slots(k):
        return 1
    s = min(MAX_SPLITS, cfg.programs_per_sm * sm_count(device) // T, N // MIN_SEGMENT)
    return 1 << (s.bit_length() - 1) if s >= 2 else 1


def topk_triton(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int, out: torch.Tensor,
                config: TopkConfig | None = None, base: torch.Tensor | None = None) -> torch.Tensor:
    """Fill out [T, k] int32 with the top-k relative indices of each row's x[i, lo[i]:hi[i]]
    (module docstring), each plus base[i] when ``base`` (int32 [T]) is given (-1 fill kept): the absolute
    rows the attention reads, without a pass over out. Inputs must already be validated (cpkv.indexer.topk does it).
    Few rows go to ``topk_split`` (``splits_for``), the rest to the stream kernel."""
    cfg = config or DEFAULT_CONFIG
    T = x.shape[0]
    if T == 0:
        return out
    splits = splits_for(T, x.shape[1], k, cfg, x.device)
    if splits > 1:
        return topk_split(x, lo, hi, k, out, splits, cfg, base)
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


def topk_split(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int, out: torch.Tensor, splits: int,
               cfg: TopkConfig, base: torch.Tensor | None = None) -> torch.Tensor:
    """``topk_triton``'s result (its arguments; T >= 1) through the two split launches, each row over ``splits``
    (a power of two, 2..MAX_SPLITS) programs."""
    meta, scratch = split_compact(x, lo, hi, k, splits, cfg)
    return split_merge(x, lo, hi, k, out, meta, scratch, cfg, base)


def _shape(x: torch.Tensor, k: int, splits: int) -> dict:
    c = candidate_slots(k)
    return dict(K=k, C=c, CAP=c, S=splits, TARGET=int((k * c) ** 0.5))  # CAP: the module docstring's


def split_compact(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int, splits: int,
                  cfg: TopkConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact launch -> (meta int32 [T, 2 * splits]: each segment's candidate count, then room for their prefix;
    scratch int32 [T, splits, 2 * CAP]: each segment's candidate columns, then keys)."""
    T, N = x.shape
    shape = _shape(x, k, splits)
    meta = torch.empty(T, 2 * splits, dtype=torch.int32, device=x.device)
    scratch = torch.empty(T, splits, 2 * shape["CAP"], dtype=torch.int32, device=x.device)
    topk_compact_kernel[(T, splits)](x, lo, hi, meta, scratch, x.stride(0) // 4, **shape, BLOCK=cfg.block,
                                     SAMPLE=SAMPLE, DEPTH=cfg.depth, PDL=cfg.pdl, num_warps=cfg.num_warps,
                                     **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return meta, scratch


def split_merge(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int, out: torch.Tensor, meta: torch.Tensor,
                scratch: torch.Tensor, cfg: TopkConfig, base: torch.Tensor | None = None) -> torch.Tensor:
    """The merge launch over ``split_compact``'s (meta, scratch): out [T, k] as ``topk_triton`` writes it."""
    splits = scratch.shape[1]
    topk_merge_kernel[(x.shape[0],)](
        x, lo, hi, lo if base is None else base, out, meta, scratch, x.stride(0) // 4, out.stride(0),
        BASE=base is not None, **_shape(x, k, splits), LOG_S=splits.bit_length() - 1, BLOCK=cfg.block, SAMPLE=SAMPLE,
        KBLOCK=min(4096, 1 << max(k - 1, 1).bit_length()), CBLOCK=1024, RETRIES=RETRIES, DEPTH=cfg.depth, PDL=cfg.pdl,
        num_warps=cfg.merge_warps, **({"launch_pdl": True} if cfg.pdl else {}))
    return out
