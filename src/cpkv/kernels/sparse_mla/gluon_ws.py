"""Warp-specialised Gluon sparse MLA prefill kernel for Hopper (512 + 64 dims, blocks of 64 heads).

Same contract as :mod:`cpkv.kernels.sparse_mla` (one program = one query token x 64 heads; sparse
indices or the dense causal range ``ks[t] .. ke[t]-1``), different schedule. Three warpgroups:

* producer (4 warps, few registers): loads Q once, then gathers key blocks of 64 rows with 16-byte
  ``cp.async`` into two shared buffers; each buffer is split into a part A (dims 0..255) and a part
  BR (dims 256..511 plus the 64 rope dims) with its own "ready" / "free" mbarrier, so a part is
  refilled as soon as its last reader is done. Completion is tracked per thread by
  ``cp.async.mbarrier.arrive.noinc`` (no wait_group in the consumers).
* consumer 0 (default partition) computes the scores of the even key block of each pair (buffer 0),
  consumer 1 those of the odd block (buffer 1): full [64 heads, 64 keys] tiles with m64n64 wgmma,
  so Q is read from shared memory once per key block (the single-partition kernel split every
  tile over both warpgroups with n32 wgmma, twice the Q reads). While one consumer does its
  softmax, the other's score wgmma runs ("seesaw", the schedule FlashMLA's sm90 kernels use).
* each consumer owns half of the output (d_v 0..255 / 256..511): it multiplies its own P from
  registers (RS wgmma) with its half of its block's values, and the other consumer's P from shared
  memory with its half of the other block's values. Row maxima go through shared memory: consumer
  0 publishes its max, consumer 1 takes the max over both and publishes it back, consumer 0
  rescales its P (before sharing it) and its accumulator to the common max. P of block 0 is
  written over the rope part of key buffer 0 (no longer needed once its scores are done).

Shared memory: Q 72 KB + two key buffers 2 x 72 KB + P of block 1 8 KB + barriers = 230,952 B (of
232,448). Registers: launch cap 168 x 12 warps, re-split 224 / 224 / 56 (consumer 0 / 1 / producer),
no spills. Two things ptxas needs (else it serialises every wgmma or spills): no wgmma accumulator in
flight across the loop's back edge, and shared-memory views rebuilt per iteration (``_opaque_zero``).

Against FlashMLA's sm90 sparse prefill (``csrc/sm90/prefill/sparse/phase1.cuh``, read at 9241ae3), same:
64 heads x one query token per CTA (h 128 is two CTAs, each gathering the same keys: FlashMLA does not share a
gather across 128 heads either), 64-key blocks in two 72 KB buffers split into dims 0..255 / 256..575 with
their own ready / free barriers and the same fill order (A0, BR1, BR0, A1), 16-byte ``cp.async`` from 128
producer threads completing by ``cp.async.mbarrier.arrive.noinc``, the two-consumer seesaw with each consumer
owning half of d_v, P of block 0 over block 0's rope dims. Different:

1. L2 hints on the key gathers: FlashMLA's ``cp.async.cg...L2::cache_hint.L2::256B`` with an ``evict_last``
   policy (keys are re-read by ~128 queries; 75-151 MB of keys at s_kv 64K-128K exceed the 50 MB L2). Gluon's
   ``async_copy`` drops ``eviction_policy``: variant ``gluon_ws_l2`` gets them by a PTX rewrite
   (:func:`l2_hint_ptx`, hooked into Triton's ptx stage; only kernels carrying ``L2_MARK`` change).
2. Consumer 0's next scores: FlashMLA's warpgroup 0 peels the first block's score GEMM and issues the next
   pair's score wgmmas right after its last value wgmma, waiting for that one (wait 1) only to free the
   buffer, so its tensor-core work runs back to back. Ours waits for the value wgmma, frees, and starts the
   next scores at the loop head. Variant ``gluon_ws_ahead`` has FlashMLA's order (it needs 240 registers for
   consumer 0, 208 for consumer 1, else 96 B spill).
3. Masking: FlashMLA's producer writes the 64 validity bits of each block to shared memory; our consumers
   load the 64 indices themselves (an L1 hit, issued before their barrier waits).
4. Q arrives by TMA (evict_first) and O leaves through shared memory by TMA stores (lse by a bulk copy);
   ours: Q by the producer's ``cp.async``, O and lse by register stores from the wgmma layout.
5. Syncs between the consumers: named barriers (bar.arrive / bar.sync over 256 threads) in FlashMLA; ours
   are mbarriers, each arrive after a warpgroup barrier. NAMED (variants ``..._nb``): FlashMLA's, on hardware
   barriers 8..12 (max0, max1, P0, P1 ready; row sums; Triton's partitions use 0..3), by inline ``bar.arrive``
   / ``bar.sync`` (no warpgroup barrier before an arrive: the barrier orders the shared-memory writes).
6. Registers: FlashMLA 216 / 216 / 72 (consumers / producer) of 384 threads at launch bounds 1 block/SM.
   FlashMLA needs top-k a multiple of 128 (no tail masks); ours takes any count.
7. Neither is persistent: one CTA per tile (64 heads x 1 token) and one CTA per SM (230 KB shared), so each
   tile's Q load and first key gathers, and its epilogue, are exposed (a tile is ~36 us at h 128; Q and O alone
   move 72 + 64 KB per tile). Variant ``gluon_ws_persist`` keeps one program per SM looping over tiles
   (barrier parities run on across tiles; a "Q free" barrier, arrived by both consumers once their last
   score wgmmas of a tile are waited for, lets the producer load the next Q, then its keys, while the consumers
   finish the last pair and normalise and store).
8. Order of a pair (EARLY, ours only): FlashMLA's warpgroups publish their row max after their exponentials, row
   rescale and sums, and warpgroup 1 signals "P1 ready" after waiting for P0. EARLY publishes each max as soon
   as it is reduced (the other consumer's softmax runs beside these ~34 exponentials per thread), reading it
   back from shared memory so that ptxas cannot hoist the exponentials above the signal (no data dependence),
   and consumer 1 signals P1 right after storing it.
9. Index loads (LATE_IDX, ours only; FlashMLA's consumers load no indices, see 3.): each ``fence.proxy.async``
   (after a "ready" wait, before the wgmmas read the cp.async data) is a MEMBAR.ALL.CTA that waits for every
   load of the thread in flight, including the block's 64 indices loaded just before it. LATE_IDX issues those
   loads under the score wgmmas, after the fences (consumer 0 under AHEAD: unchanged, at the loop head).
10. P0 under consumer 0's first value wgmma (OVERLAP, ours only): FlashMLA's warpgroup 0 waits for its
   ``rO += rS0 @ sV0l`` before it takes the common max and scales and shares P0, which consumer 1 needs for
   its second value wgmma. OVERLAP takes the max, scales, stores and signals P0 while that wgmma runs, and
   waits for it (then frees A0 and rescales O) after.
11. P1 before consumer 1's first value wgmma (P1_FIRST, ours only): FlashMLA's warpgroup 1 rescales O, issues
   ``rO1 += rS1 @ sV1R``, then stores P1. P1_FIRST stores and signals P1 first (consumer 0's second value
   wgmma waits for it), then rescales O (reading the common max back, so that ptxas keeps the rescale after
   the signal) and issues its own.
12. Barrier allocations (SPLIT_BARS): FlashMLA's mbarriers are plain shared-memory words. Ours were one [15, 1]
   allocation, which Triton's shared-memory analysis treats as one buffer: a wait after any arrive or wait on
   another barrier got a warpgroup barrier (bar.sync of 128 threads) in front, 10-16 of 26-34 waits. SPLIT_BARS
   allocates each separately (4 left). The kernels pass the barriers as a tuple either way (the others: views
   of the one allocation; same instructions as before, some 100-200 B more shared memory for the captures).

A 128-head CTA sharing one gather does not fit: its fp32 output is 128 x 512 x 4 B = 256 KB of registers (the
whole register file) and Q alone 144 KB of the 227 KB shared memory.

Variants (:data:`VARIANTS`, selectable by name: ``launch(..., variant=)``, ``Config(impl=name)``, ``cpkv bench
attention --variants all``): ``gluon_ws_persist`` (7., the default), ``gluon_ws``, ``gluon_ws_l2`` (1.),
``gluon_ws_ahead`` (2.), ``gluon_ws_l2_ahead`` (1. + 2.), ``gluon_ws_l2_persist`` (1. + 7.), and on top of 7.
variants named by their switches: ``_nb`` (5.), ``_ahead`` (2.), ``_early`` (8.), ``_li`` (9.), ``_ov`` (10.),
``_p1f`` (11.), ``_sb`` (12.), ``gluon_ws_l2_...`` (1.); e.g. ``gluon_ws_persist_ahead_nb_early_li_ov_p1f_sb`` has
all of them but 1. All: 168 registers at launch, no spills, 230,952-231,488 B shared (of 232,448) (sm_90a, offline:
tests/attention/test_sparse_mla_variants.py). AHEAD with PERSIST spilled 800 B until the peeled first block's
shared-memory views were indexed by an opaque zero too (in the tile loop constant views are loop-invariant: their 36
wgmma descriptors were hoisted and spilled).

Speed against the bf16 GEMM: BENCHMARKS.md (``cpkv bench attention --sweep``). Triton is imported lazily
by :func:`load`.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import torch

from cpkv.kernels.grid import sparse_mla_grid

LOG2E = 1.4426950408889634
MAX_REGS = 168  # launch-wide cap: 12 warps x 168 = 64512 of the 65536 registers; partitions re-split them


def _flags(l2: bool = False, ahead: bool = False, persist: bool = False, named: bool = False,
           early: bool = False, late_idx: bool = False, overlap: bool = False,
           p1_first: bool = False, split_bars: bool = False) -> dict[str, Any]:
    """A variant's constexpr switches (module docstring: L2_HINT 1., AHEAD 2., NAMED 5., PERSIST 7., EARLY 8.,
    LATE_IDX 9., OVERLAP 10., P1_FIRST 11., SPLIT_BARS 12.);
    AHEAD's consumer 0 needs 240 registers, so consumer 1 gets 208 (else 224 each)."""
    return {"L2_HINT": l2, "AHEAD": ahead, "C1_REGS": 208 if ahead else 224, "PERSIST": persist, "NAMED": named,
            "EARLY": early, "LATE_IDX": late_idx, "OVERLAP": overlap, "P1_FIRST": p1_first,
            "SPLIT_BARS": split_bars}


# kernel variants by name -> their constexpr switches (module docstring); the first, "gluon_ws_persist", is the default
VARIANTS: dict[str, dict[str, Any]] = {
    "gluon_ws_persist": _flags(persist=True),
    "gluon_ws": _flags(),
    "gluon_ws_l2": _flags(l2=True),
    "gluon_ws_ahead": _flags(ahead=True),
    "gluon_ws_l2_ahead": _flags(l2=True, ahead=True),
    "gluon_ws_l2_persist": _flags(l2=True, persist=True),
    "gluon_ws_persist_nb": _flags(persist=True, named=True),
    "gluon_ws_persist_ahead": _flags(persist=True, ahead=True),
    "gluon_ws_persist_ahead_nb": _flags(persist=True, ahead=True, named=True),
    "gluon_ws_persist_nb_early": _flags(persist=True, named=True, early=True),
    "gluon_ws_persist_ahead_nb_early": _flags(persist=True, ahead=True, named=True, early=True),
    "gluon_ws_l2_persist_ahead_nb_early": _flags(l2=True, persist=True, ahead=True, named=True, early=True),
    "gluon_ws_persist_nb_early_li": _flags(persist=True, named=True, early=True, late_idx=True),
    "gluon_ws_persist_ahead_nb_early_li": _flags(persist=True, ahead=True, named=True, early=True, late_idx=True),
    "gluon_ws_persist_nb_early_li_ov": _flags(persist=True, named=True, early=True, late_idx=True, overlap=True),
    "gluon_ws_persist_ahead_nb_early_li_ov": _flags(persist=True, ahead=True, named=True, early=True, late_idx=True,
                                                    overlap=True),
    "gluon_ws_persist_nb_early_li_ov_p1f": _flags(persist=True, named=True, early=True, late_idx=True, overlap=True,
                                                  p1_first=True),
    "gluon_ws_persist_ahead_nb_early_li_ov_p1f": _flags(persist=True, ahead=True, named=True, early=True,
                                                        late_idx=True, overlap=True, p1_first=True),
    "gluon_ws_persist_nb_early_li_ov_p1f_sb": _flags(persist=True, named=True, early=True, late_idx=True,
                                                     overlap=True, p1_first=True, split_bars=True),
    "gluon_ws_persist_ahead_nb_early_li_ov_p1f_sb": _flags(persist=True, ahead=True, named=True, early=True,
                                                           late_idx=True, overlap=True, p1_first=True,
                                                           split_bars=True),
    "gluon_ws_l2_persist_ahead_nb_early_li_ov_p1f": _flags(l2=True, persist=True, ahead=True, named=True, early=True,
                                                           late_idx=True, overlap=True, p1_first=True),
}
DEFAULT_VARIANT = "gluon_ws_persist"  # 2026-12-01, one H200: 1.05-1.06x gluon_ws, 0.886-0.926 of FlashMLA (BENCHMARKS.md)
L2_MARK = "cpkv-sparse-mla-l2-v1"  # the comment _l2_mark puts in an L2_HINT kernel's PTX (a new rewrite: bump it)
L2_POLICY = "%cpkv_l2_policy"
_CP_ASYNC_CG = re.compile(r"cp\.async\.cg\.shared\.global (\[[^\]]*\]), (\[[^\]]*\]), (0x10|16), (%r\d+);")


def l2_hint_ptx(ptx: str) -> str:
    """PTX of a kernel marked with ``L2_MARK``: every 16-byte ``cp.async.cg`` after the mark (the key gathers; Q's
    copies come before it) gets FlashMLA's L2 hints: ``.L2::cache_hint`` with an ``evict_last`` policy made once
    at entry, and a ``.L2::256B`` prefetch. Unmarked PTX is returned unchanged. Gluon's ``async_copy`` cannot
    emit these (it drops its eviction_policy argument)."""
    mark = ptx.find(L2_MARK)
    if mark < 0:
        return ptx
    tail, n = _CP_ASYNC_CG.subn(
        lambda m: f"cp.async.cg.shared.global.L2::cache_hint.L2::256B {m[1]}, {m[2]}, 16, {m[4]}, {L2_POLICY};",
        ptx[mark:])
    entry = re.search(r"\.entry [^{]*\{\n", ptx)
    if n == 0 or entry is None or entry.end() > mark:
        raise RuntimeError(f"l2_hint_ptx: expected a kernel entry before the mark and 16-byte cp.async.cg copies "
                           f"after it, got {n} copies")
    decls = re.compile(r"[ \t]*(\.reg|\.shared|\.local)[^\n]*\n").match
    pos = entry.end()
    while (m := decls(ptx, pos)) is not None:
        pos = m.end()
    init = f"\t.reg .b64 \t{L2_POLICY};\n\tcreatepolicy.fractional.L2::evict_last.b64 \t{L2_POLICY}, 1.0;\n"
    return ptx[:pos] + init + ptx[pos:mark] + tail


def install_ptx_hook() -> None:
    """Route every Triton compile's PTX through :func:`l2_hint_ptx` (chained after any hook already set; a no-op
    for unmarked kernels). Installed by :func:`load` before the kernel can compile."""
    from triton import knobs

    prev = knobs.runtime.add_stages_inspection_hook
    if getattr(prev, "cpkv_l2_hint", False):
        return

    def hook(backend: Any, stages: dict, options: Any, language: Any, capability: Any) -> None:
        if prev is not None:
            prev(backend, stages, options, language, capability)
        make_ptx = stages.get("ptx")
        if make_ptx is not None:
            stages["ptx"] = lambda src, metadata: l2_hint_ptx(make_ptx(src, metadata))

    hook.cpkv_l2_hint = True  # type: ignore[attr-defined]
    knobs.runtime.add_stages_inspection_hook = hook


@lru_cache(maxsize=1)
def load() -> Any:
    """Compile-on-demand kernel (imports Gluon lazily); its constexprs L2_HINT / AHEAD pick the variant."""
    install_ptx_hook()
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    @gluon.jit
    def _program(H, tile):
        """(head block, query token as int64) of a tile of the flat grid (cpkv.kernels.grid): its program id, or
        in a PERSIST kernel the tile the program is on."""
        n_hb = (H + 63) // 64
        return tile % n_hb, (tile // n_hb).to(gl.int64)

    @gluon.jit
    def _key_range(IDX, KS, KE, TOPK, stride_it, t, DENSE: gl.constexpr):
        """Query token t's keys: (first key row (dense), number of keys, its index row)."""
        if DENSE:
            ks_t = gl.load(KS + t)
            n_keys = gl.maximum(gl.load(KE + t) - ks_t, 0)
        else:
            ks_t = 0
            n_keys = TOPK
        return ks_t, n_keys, IDX + t * stride_it

    @gluon.jit
    def _consumer_start(IDX, KS, KE, H, TOPK, stride_it, tile, DENSE: gl.constexpr, s_l: gl.constexpr,
                        o_l: gl.constexpr):
        """A consumer's token, key range and empty softmax state (row max, row sum, O half, a zero S)."""
        _, t = _program(H, tile)
        ks_t, n_keys, idx_row = _key_range(IDX, KS, KE, TOPK, stride_it, t, DENSE)
        m_run = gl.full([64], -1.0e30, gl.float32, gl.SliceLayout(1, s_l))
        l_run = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_l))
        o = gl.zeros([64, 256], gl.float32, o_l)  # consumer 1: waited at the end of every pair
        s0 = gl.zeros([64, 64], gl.float32, s_l)
        return t, ks_t, n_keys, idx_row, m_run, l_run, o, s0

    @gluon.jit
    def _rows(idx_row, ks_t, k0, n_keys, S, layout: gl.constexpr, DENSE: gl.constexpr):
        """(row, valid) for keys k0 .. k0 + 63 of this query, in ``layout`` (1-D)."""
        offs = k0 + gl.arange(0, 64, layout)
        if DENSE:
            idx = ks_t + offs
            valid = (offs < n_keys) & (idx >= 0) & (idx < S)
        else:
            idx = gl.load(idx_row + offs, mask=offs < n_keys, other=-1)
            valid = (idx >= 0) & (idx < S)
        return gl.where(valid, idx, 0), valid

    @gluon.jit
    def _gather(KV, stride_kv, rows, valid, col0, buf, lg: gl.constexpr, N: gl.constexpr):
        """cp.async rows x [col0, col0 + N) of KV into ``buf`` (zero-filled where not valid)."""
        c = col0 + gl.arange(0, N, gl.SliceLayout(0, lg))
        ptr = KV + (rows.to(gl.int64) * stride_kv)[:, None] + c[None, :]
        async_copy.async_copy_global_to_shared(buf, ptr, mask=valid[:, None], cache_modifier=".cg")

    @gluon.jit
    def _l2_mark(x):
        """Marks the kernel's PTX for :func:`l2_hint_ptx` (a comment; the mov is dead)."""
        return gl.inline_asm_elementwise("// cpkv-sparse-mla-l2-v1\n\tmov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                                         is_pure=False, pack=1)

    @gluon.jit
    def _producer(Q, KV, IDX, KS, KE, S, H, TOPK, stride_qt, stride_qh, stride_kv, stride_it, N_TILES,
                  q_a, q_b, q_r, k_a, k_b, k_r, bars, DENSE: gl.constexpr, L2_HINT: gl.constexpr,
                  PERSIST: gl.constexpr):
        if PERSIST:
            g = 0  # key-block pairs done (barrier parities run on across tiles)
            j = 0  # tiles done
            for tile in range(gl.program_id(0), N_TILES, gl.num_programs(0)):
                mbarrier.wait(bars[14], (j & 1) ^ 1)  # Q free: both consumers done with the last tile's scores
                g += _producer_tile(Q, KV, IDX, KS, KE, S, H, TOPK, stride_qt, stride_qh, stride_kv, stride_it,
                                    q_a, q_b, q_r, k_a, k_b, k_r, bars, tile, g, DENSE, L2_HINT)
                j += 1
        else:
            _producer_tile(Q, KV, IDX, KS, KE, S, H, TOPK, stride_qt, stride_qh, stride_kv, stride_it,
                           q_a, q_b, q_r, k_a, k_b, k_r, bars, gl.program_id(0), 0, DENSE, L2_HINT)

    @gluon.jit
    def _producer_tile(Q, KV, IDX, KS, KE, S, H, TOPK, stride_qt, stride_qh, stride_kv, stride_it,
                       q_a, q_b, q_r, k_a, k_b, k_r, bars, tile, g0, DENSE: gl.constexpr, L2_HINT: gl.constexpr):
        """Q and the key blocks of one tile (``g0`` pairs done before it) -> its number of pairs."""
        lg: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rl: gl.constexpr = gl.SliceLayout(1, lg)
        pid_h, t = _program(H, tile)
        bar_q = bars[0]
        # Q rows (heads >= H zero-filled)
        hq = pid_h * 64 + gl.arange(0, 64, rl)
        qv = hq < H
        qb = Q + t * stride_qt
        _gather(qb, stride_qh, hq, qv, 0, q_a.index(0), lg, 256)
        _gather(qb, stride_qh, hq, qv, 256, q_b.index(0), lg, 256)
        _gather(qb, stride_qh, hq, qv, 512, q_r.index(0), lg, 64)
        async_copy.mbarrier_arrive(bar_q, increment_count=False)
        if L2_HINT:
            _l2_mark(pid_h)  # the key copies after this get L2 hints (Q read once: none for it)

        ks_t, n_keys, idx_row = _key_range(IDX, KS, KE, TOPK, stride_it, t, DENSE)
        n_pairs = gl.cdiv(n_keys, 128)
        for i in range(n_pairs):
            ph = ((g0 + i) & 1) ^ 1  # a fresh barrier passes a wait on parity 1
            r0, v0 = _rows(idx_row, ks_t, 128 * i, n_keys, S, rl, DENSE)
            r1, v1 = _rows(idx_row, ks_t, 128 * i + 64, n_keys, S, rl, DENSE)
            # order of need: A0 (consumer 0 starts its scores there), BR1, BR0, A1
            mbarrier.wait(bars[5], ph)  # free A0
            _gather(KV, stride_kv, r0, v0, 0, k_a.index(0), lg, 256)
            async_copy.mbarrier_arrive(bars[1], increment_count=False)
            mbarrier.wait(bars[8], ph)  # free BR1
            _gather(KV, stride_kv, r1, v1, 256, k_b.index(1), lg, 256)
            _gather(KV, stride_kv, r1, v1, 512, k_r.index(1), lg, 64)
            async_copy.mbarrier_arrive(bars[4], increment_count=False)
            mbarrier.wait(bars[6], ph)  # free BR0
            _gather(KV, stride_kv, r0, v0, 256, k_b.index(0), lg, 256)
            _gather(KV, stride_kv, r0, v0, 512, k_r.index(0), lg, 64)
            async_copy.mbarrier_arrive(bars[2], increment_count=False)
            mbarrier.wait(bars[7], ph)  # free A1
            _gather(KV, stride_kv, r1, v1, 0, k_a.index(1), lg, 256)
            async_copy.mbarrier_arrive(bars[3], increment_count=False)
        return n_pairs

    @gluon.jit
    def _opaque_zero(x):
        """0 from inline asm the compiler cannot hoist: shared-memory views indexed by it get their
        wgmma descriptors rebuilt inside the loop (cheap adds) instead of being hoisted out of it, where
        72 loop-invariant 64-bit descriptors would spill."""
        return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _asm(x, ASM: gl.constexpr):
        """``ASM`` (a barrier instruction) executed by every thread of the calling warpgroup."""
        return gl.inline_asm_elementwise(ASM + "\n\tmov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False,
                                         pack=1)

    @gluon.jit
    def _signal(bars, k: gl.constexpr, x, NAMED: gl.constexpr):
        """Consumer-to-consumer signal ``k`` (9 max0, 10 max1, 11 P0, 12 P1; module docstring) after this
        warpgroup's shared-memory writes: NAMED: ``bar.arrive`` on hardware barrier k - 1 (256 threads: this
        warpgroup arrives, the other syncs), else a warpgroup barrier and an arrive on mbarrier k."""
        if NAMED:
            if k == 9:
                _asm(x, "bar.arrive 8, 256;")
            elif k == 10:
                _asm(x, "bar.arrive 9, 256;")
            elif k == 11:
                _asm(x, "bar.arrive 10, 256;")
            else:
                _asm(x, "bar.arrive 11, 256;")
        else:
            gl.thread_barrier()
            mbarrier.arrive(bars[k])

    @gluon.jit
    def _await(bars, k: gl.constexpr, ph, x, NAMED: gl.constexpr):
        """Waits for the other consumer's signal ``k`` (of parity ``ph`` when on mbarriers; :func:`_signal`)."""
        gl.static_assert((k >= 9) & (k <= 12))
        if NAMED:
            if k == 9:
                _asm(x, "bar.sync 8, 256;")
            elif k == 10:
                _asm(x, "bar.sync 9, 256;")
            elif k == 11:
                _asm(x, "bar.sync 10, 256;")
            else:
                _asm(x, "bar.sync 11, 256;")
        else:
            mbarrier.wait(bars[k], ph)

    @gluon.jit
    def _sums_exchanged(bars, j, NAMED: gl.constexpr):
        """Both consumers' row sums of tile ``j`` are in shared memory (called by both after their store)."""
        if NAMED:
            _asm(j, "bar.sync 12, 256;")
        else:
            gl.thread_barrier()
            mbarrier.arrive(bars[13])
            mbarrier.wait(bars[13], j & 1)

    @gluon.jit
    def _q_free(bars):
        """PERSIST: this consumer's score wgmmas of the tile are done (waited), so Q may be reloaded."""
        gl.thread_barrier()
        mbarrier.arrive(bars[14])

    @gluon.jit
    def _softmax_in(s, valid, m_ref, scale_log2):
        """Masked scores -> (row max of the scaled scores, max with m_ref)."""
        s = gl.where(valid[None, :], s, float("-inf"))
        mx = gl.max(s, 1) * scale_log2
        return s, gl.maximum(m_ref, mx)

    @gluon.jit
    def _scores0(qa, qb, qr, ka, kb, kr, s0, bars, ph):
        """Consumer 0's scores of buffer 0 (waits for A0 and BR0 of parity ``ph``), waited for."""
        return warpgroup_mma_wait(0, deps=[_scores0_issue(qa, qb, qr, ka, kb, kr, s0, bars, ph)])

    @gluon.jit
    def _scores0_issue(qa, qb, qr, ka, kb, kr, s0, bars, ph):
        """Consumer 0's score wgmmas of buffer 0 issued (waits for A0 and BR0 of parity ``ph``), in flight."""
        mbarrier.wait(bars[1], ph)  # A0 ready
        fence_async_shared()
        s = warpgroup_mma(qa, ka.permute((1, 0)), s0, use_acc=False, is_async=True)
        mbarrier.wait(bars[2], ph)  # BR0 ready
        fence_async_shared()
        s = warpgroup_mma(qb, kb.permute((1, 0)), s, is_async=True)
        return warpgroup_mma(qr, kr.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _consumer0(IDX, KS, KE, S, H, TOPK, scale_log2, stride_it, q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, bars,
                   tile, g0, j, DENSE: gl.constexpr, AHEAD: gl.constexpr, PERSIST: gl.constexpr,
                   NAMED: gl.constexpr, EARLY: gl.constexpr, LATE_IDX: gl.constexpr,
                   OVERLAP: gl.constexpr):
        """Even key block of each pair (buffer 0) -> (O[:, 0:256] unnormalised, row sums, row max).

        AHEAD: the next pair's score wgmmas are issued before the wait for this pair's last value wgmma
        (FlashMLA's warpgroup 0 order), so the tensor cores are not idle between pairs; the scores are
        waited for inside the iteration (nothing in flight across the back edge)."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)
        t, ks_t, n_keys, idx_row, m_run, l_run, o, s0 = _consumer_start(IDX, KS, KE, H, TOPK, stride_it, tile, DENSE,
                                                                         s_l, o_l)
        mbarrier.wait(bars[0], j & 1)  # Q
        n_pairs = gl.cdiv(n_keys, 128)
        s_next = s0
        if AHEAD:
            if n_pairs > 0:
                # views by an opaque 0 here too: in a PERSIST kernel constant views are invariant in the tile
                # loop, and their 36 hoisted descriptors spilled (800 B)
                z = _opaque_zero(j)
                s_next = _scores0(q_a.index(z), q_b.index(z), q_r.index(z), k_a.index(z), k_b.index(z), k_r.index(z),
                                  s0, bars, g0 & 1)
        for i in range(n_pairs):
            ph = (g0 + i) & 1
            z = _opaque_zero(i)
            qa, qb, qr = q_a.index(z), q_b.index(z), q_r.index(z)
            ka, kb, kr, ka1 = k_a.index(z), k_b.index(z), k_r.index(z), k_a.index(z + 1)
            if AHEAD:
                _, valid = _rows(idx_row, ks_t, 128 * i, n_keys, S, gl.SliceLayout(0, s_l), DENSE)
                s = s_next
            elif LATE_IDX:
                s = _scores0_issue(qa, qb, qr, ka, kb, kr, s0, bars, ph)
                # the block's indices loaded under the score wgmmas, after the fences (each waits for every
                # load of the thread in flight)
                _, valid = _rows(idx_row, ks_t, 128 * i, n_keys, S, gl.SliceLayout(0, s_l), DENSE)
                s = warpgroup_mma_wait(0, deps=[s])
            else:
                _, valid = _rows(idx_row, ks_t, 128 * i, n_keys, S, gl.SliceLayout(0, s_l), DENSE)
                s = _scores0(qa, qb, qr, ka, kb, kr, s0, bars, ph)
            if PERSIST:
                if i == n_pairs - 1:
                    _q_free(bars)  # the tile's last scores are in: the next Q loads under the rest
            s, m_new = _softmax_in(s, valid, m_run, scale_log2)
            if EARLY:
                sm.index(0).store(m_new)
                _signal(bars, 9, i, NAMED)  # my max published (consumer 1's softmax runs beside my exponentials)
                # read back: ptxas would otherwise hoist the exponentials above the signal (no data dependence)
                m_new = sm.index(0).load(row_l)
            alpha = gl.exp2(m_run - m_new)
            p = gl.exp2(s * scale_log2 - m_new[:, None])
            l_run = l_run * alpha + gl.sum(p, 1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            if not EARLY:
                sm.index(0).store(m_new)
                _signal(bars, 9, i, NAMED)  # my max published
            o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_op), ka, o, is_async=True)
            if not OVERLAP:
                o = warpgroup_mma_wait(0, deps=[o])
                gl.thread_barrier()
                mbarrier.arrive(bars[5])  # A0 free
            _await(bars, 10, ph, i, NAMED)  # common max from consumer 1
            m1 = sm.index(1).load(row_l)
            f = gl.exp2(m_new - m1)
            kr.store((p * f[:, None]).to(gl.bfloat16))  # P0 over the rope part of buffer 0
            fence_async_shared()
            _signal(bars, 11, i, NAMED)  # P0 ready
            if OVERLAP:  # P0 was scaled and shared while the value wgmma ran
                o = warpgroup_mma_wait(0, deps=[o])
                gl.thread_barrier()
                mbarrier.arrive(bars[5])  # A0 free
            o = o * gl.convert_layout(f, gl.SliceLayout(1, o_l))[:, None]
            l_run = l_run * f
            m_run = m1
            _await(bars, 12, ph, i, NAMED)  # P1 ready
            fence_async_shared()
            if AHEAD:
                if i + 1 < n_pairs:
                    o = warpgroup_mma(p1, ka1, o, is_async=True)
                    # the next pair's scores: its A0 part issued while this value wgmma runs
                    mbarrier.wait(bars[1], ph ^ 1)  # A0 ready (next pair)
                    fence_async_shared()
                    sn = warpgroup_mma(qa, ka.permute((1, 0)), s0, use_acc=False, is_async=True)
                    o = warpgroup_mma_wait(1, deps=[o])
                    gl.thread_barrier()
                    mbarrier.arrive(bars[7])  # A1 and P1 free
                    mbarrier.wait(bars[2], ph ^ 1)  # BR0 ready (next pair)
                    fence_async_shared()
                    sn = warpgroup_mma(qb, kb.permute((1, 0)), sn, is_async=True)
                    sn = warpgroup_mma(qr, kr.permute((1, 0)), sn, is_async=True)
                    s_next = warpgroup_mma_wait(0, deps=[sn])
                else:
                    o = warpgroup_mma(p1, ka1, o, is_async=True)
                    o = warpgroup_mma_wait(0, deps=[o])
                    gl.thread_barrier()
                    mbarrier.arrive(bars[7])  # A1 and P1 free
            else:
                o = warpgroup_mma(p1, ka1, o, is_async=True)
                # waited here, not after the next pair's first score wgmma: ptxas cannot follow an
                # accumulator in flight across the loop's back edge and would serialise every wgmma
                o = warpgroup_mma_wait(0, deps=[o])
                gl.thread_barrier()
                mbarrier.arrive(bars[7])  # A1 and P1 free
        return o, l_run, m_run, n_pairs

    @gluon.jit
    def _consumer1(IDX, KS, KE, OUT, LSE, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, stride_lt, N_TILES,
                   q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, DENSE: gl.constexpr, PERSIST: gl.constexpr,
                   NAMED: gl.constexpr, EARLY: gl.constexpr, LATE_IDX: gl.constexpr, P1_FIRST: gl.constexpr):
        if PERSIST:
            g = 0
            j = 0
            for tile in range(gl.program_id(0), N_TILES, gl.num_programs(0)):
                g += _consumer1_tile(IDX, KS, KE, OUT, LSE, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh,
                                     stride_lt, q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, tile, g, j, DENSE,
                                     PERSIST, NAMED, EARLY, LATE_IDX, P1_FIRST)
                j += 1
        else:
            _consumer1_tile(IDX, KS, KE, OUT, LSE, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, stride_lt,
                            q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, gl.program_id(0), 0, 0, DENSE, PERSIST,
                            NAMED, EARLY, LATE_IDX, P1_FIRST)

    @gluon.jit
    def _consumer1_tile(IDX, KS, KE, OUT, LSE, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, stride_lt,
                        q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, tile, g0, j, DENSE: gl.constexpr,
                        PERSIST: gl.constexpr, NAMED: gl.constexpr, EARLY: gl.constexpr, LATE_IDX: gl.constexpr,
                        P1_FIRST: gl.constexpr):
        """Odd key block of each pair (buffer 1); output columns 256..511 and the lse -> the tile's pairs."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)
        t, ks_t, n_keys, idx_row, m_run, l_run, o, s0 = _consumer_start(IDX, KS, KE, H, TOPK, stride_it, tile, DENSE,
                                                                         s_l, o_l)
        mbarrier.wait(bars[0], j & 1)  # Q
        n_pairs = gl.cdiv(n_keys, 128)
        for i in range(n_pairs):
            ph = (g0 + i) & 1
            z = _opaque_zero(i)
            qa, qb, qr = q_a.index(z), q_b.index(z), q_r.index(z)
            ka, kb, kr = k_a.index(z + 1), k_b.index(z + 1), k_r.index(z + 1)
            if not LATE_IDX:
                _, valid = _rows(idx_row, ks_t, 128 * i + 64, n_keys, S, gl.SliceLayout(0, s_l), DENSE)
            mbarrier.wait(bars[4], ph)  # BR1 ready
            fence_async_shared()
            s = warpgroup_mma(qb, kb.permute((1, 0)), s0, use_acc=False, is_async=True)
            s = warpgroup_mma(qr, kr.permute((1, 0)), s, is_async=True)
            mbarrier.wait(bars[3], ph)  # A1 ready
            fence_async_shared()
            s = warpgroup_mma(qa, ka.permute((1, 0)), s, is_async=True)
            if LATE_IDX:  # under the score wgmmas, after the fences
                _, valid = _rows(idx_row, ks_t, 128 * i + 64, n_keys, S, gl.SliceLayout(0, s_l), DENSE)
            s = warpgroup_mma_wait(0, deps=[s])
            if PERSIST:
                if i == n_pairs - 1:
                    _q_free(bars)
            _await(bars, 9, ph, i, NAMED)  # max of consumer 0
            m0 = sm.index(0).load(row_l)
            s, m_new = _softmax_in(s, valid, m0, scale_log2)
            if EARLY:
                sm.index(1).store(m_new)
                _signal(bars, 10, i, NAMED)  # common max published (consumer 0 scales P0 beside my exponentials)
                # read back: ptxas would otherwise hoist the exponentials above the signal (no data dependence)
                m_new = sm.index(1).load(row_l)
            if P1_FIRST:
                if not EARLY:
                    sm.index(1).store(m_new)
                    _signal(bars, 10, i, NAMED)  # common max published
                p = gl.exp2(s * scale_log2 - m_new[:, None])
                pb = p.to(gl.bfloat16)
                p1.store(pb)
                fence_async_shared()
                _signal(bars, 12, i, NAMED)  # P1 ready, before my O rescale and value wgmma
                # the common max read again: O's rescale stays after the signal (ptxas would hoist it)
                alpha = gl.exp2(m_run - sm.index(1).load(row_l))
                l_run = l_run * alpha + gl.sum(p, 1)
                o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
                o = warpgroup_mma(gl.convert_layout(pb, p_op), kb, o, is_async=True)
            else:
                alpha = gl.exp2(m_run - m_new)
                p = gl.exp2(s * scale_log2 - m_new[:, None])
                l_run = l_run * alpha + gl.sum(p, 1)
                o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
                if not EARLY:
                    sm.index(1).store(m_new)
                    _signal(bars, 10, i, NAMED)  # common max published
                pb = p.to(gl.bfloat16)
                o = warpgroup_mma(gl.convert_layout(pb, p_op), kb, o, is_async=True)
                p1.store(pb)
                fence_async_shared()
                if EARLY:
                    _signal(bars, 12, i, NAMED)  # P1 ready, before waiting for P0
            _await(bars, 11, ph, i, NAMED)  # P0 ready
            fence_async_shared()
            o = warpgroup_mma(k_r.index(z), k_b.index(z), o, is_async=True)
            if not EARLY:
                if not P1_FIRST:
                    _signal(bars, 12, i, NAMED)  # P1 ready
            o = warpgroup_mma_wait(1, deps=[o])
            gl.thread_barrier()
            mbarrier.arrive(bars[8])  # BR1 free
            o = warpgroup_mma_wait(0, deps=[o])
            gl.thread_barrier()
            mbarrier.arrive(bars[6])  # BR0 free (its values and P0 read)
            m_run = m_new
        o = warpgroup_mma_wait(0, deps=[o])
        if PERSIST:
            if n_pairs == 0:
                _q_free(bars)
        # combine the row sums of both consumers, write columns 256..511 and the lse
        sb = (j & 1) * 2  # PERSIST: a tile's row sums in the half of sl of its parity
        sl.index(sb + 1).store(l_run)
        _sums_exchanged(bars, j, NAMED)
        l_tot = l_run + sl.index(sb).load(row_l)
        empty = l_tot == 0.0
        l_o = gl.convert_layout(gl.where(empty, 1.0, l_tot), gl.SliceLayout(1, o_l))
        pid_h, _ = _program(H, tile)
        ho = pid_h * 64 + gl.arange(0, 64, gl.SliceLayout(1, o_l))
        co = 256 + gl.arange(0, 256, gl.SliceLayout(0, o_l))
        gl.store(OUT + t * stride_ot + (ho * stride_oh)[:, None] + co[None, :], (o / l_o[:, None]).to(gl.bfloat16),
                 mask=(ho < H)[:, None])
        lse = gl.where(empty, float("inf"), (m_run + gl.log2(gl.where(empty, 1.0, l_tot))) / 1.4426950408889634)
        hl = pid_h * 64 + gl.arange(0, 64, row_l)
        gl.store(LSE + t * stride_lt + hl, lse, mask=hl < H)
        return n_pairs

    @gluon.jit
    def _default(IDX, KS, KE, OUT, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, N_TILES,
                 q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, DENSE: gl.constexpr, AHEAD: gl.constexpr,
                 PERSIST: gl.constexpr, NAMED: gl.constexpr, EARLY: gl.constexpr, LATE_IDX: gl.constexpr,
                   OVERLAP: gl.constexpr):
        if PERSIST:
            g = 0
            j = 0
            for tile in range(gl.program_id(0), N_TILES, gl.num_programs(0)):
                g += _default_tile(IDX, KS, KE, OUT, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh,
                                   q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, tile, g, j, DENSE, AHEAD, PERSIST,
                                   NAMED, EARLY, LATE_IDX, OVERLAP)
                j += 1
        else:
            _default_tile(IDX, KS, KE, OUT, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh,
                          q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, gl.program_id(0), 0, 0, DENSE, AHEAD, PERSIST,
                          NAMED, EARLY, LATE_IDX, OVERLAP)

    @gluon.jit
    def _default_tile(IDX, KS, KE, OUT, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh,
                      q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, tile, g0, j, DENSE: gl.constexpr,
                      AHEAD: gl.constexpr, PERSIST: gl.constexpr, NAMED: gl.constexpr, EARLY: gl.constexpr,
                      LATE_IDX: gl.constexpr, OVERLAP: gl.constexpr):
        """Consumer 0 on one tile and its output columns 0..255 -> the tile's pairs."""
        o, l_run, _, n_pairs = _consumer0(IDX, KS, KE, S, H, TOPK, scale_log2, stride_it, q_a, q_b, q_r, k_a, k_b, k_r,
                                          p1, sm, bars, tile, g0, j, DENSE, AHEAD, PERSIST, NAMED, EARLY, LATE_IDX,
                                          OVERLAP)
        if PERSIST:
            if n_pairs == 0:
                _q_free(bars)
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)
        sb = (j & 1) * 2
        sl.index(sb).store(l_run)
        _sums_exchanged(bars, j, NAMED)
        l_tot = l_run + sl.index(sb + 1).load(row_l)
        empty = l_tot == 0.0
        l_o = gl.convert_layout(gl.where(empty, 1.0, l_tot), gl.SliceLayout(1, o_l))
        pid_h, t = _program(H, tile)
        ho = pid_h * 64 + gl.arange(0, 64, gl.SliceLayout(1, o_l))
        co = gl.arange(0, 256, gl.SliceLayout(0, o_l))
        gl.store(OUT + t * stride_ot + (ho * stride_oh)[:, None] + co[None, :], (o / l_o[:, None]).to(gl.bfloat16),
                 mask=(ho < H)[:, None])
        return n_pairs

    @gluon.jit
    def _barriers15():
        """SPLIT_BARS: the 15 mbarriers as separate shared allocations. Triton's shared-memory barrier analysis
        sees one [15, 1] allocation as one buffer, so every wait after an arrive or another wait on any of them
        got a warpgroup barrier (bar.sync) in front; FlashMLA's waits have none."""
        lay: gl.constexpr = mbarrier.MBarrierLayout()
        return (gl.allocate_shared_memory(gl.int64, [1], lay), gl.allocate_shared_memory(gl.int64, [1], lay),
                gl.allocate_shared_memory(gl.int64, [1], lay), gl.allocate_shared_memory(gl.int64, [1], lay),
                gl.allocate_shared_memory(gl.int64, [1], lay), gl.allocate_shared_memory(gl.int64, [1], lay),
                gl.allocate_shared_memory(gl.int64, [1], lay), gl.allocate_shared_memory(gl.int64, [1], lay),
                gl.allocate_shared_memory(gl.int64, [1], lay), gl.allocate_shared_memory(gl.int64, [1], lay),
                gl.allocate_shared_memory(gl.int64, [1], lay), gl.allocate_shared_memory(gl.int64, [1], lay),
                gl.allocate_shared_memory(gl.int64, [1], lay), gl.allocate_shared_memory(gl.int64, [1], lay),
                gl.allocate_shared_memory(gl.int64, [1], lay))

    @gluon.jit(do_not_specialize=["N_TILES"])  # PERSIST's tile count: one compile for any T
    def _sparse_mla_ws(
        Q, KV, IDX, KS, KE, OUT, LSE,
        S, H, TOPK, scale_log2,
        stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_lt, N_TILES,
        DENSE: gl.constexpr, L2_HINT: gl.constexpr = False, AHEAD: gl.constexpr = False,
        C1_REGS: gl.constexpr = 224, PERSIST: gl.constexpr = False, NAMED: gl.constexpr = False,
        EARLY: gl.constexpr = False, LATE_IDX: gl.constexpr = False, OVERLAP: gl.constexpr = False,
        P1_FIRST: gl.constexpr = False, SPLIT_BARS: gl.constexpr = False,
    ):
        sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_a = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 256], sh)
        q_b = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 256], sh)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], sh)
        k_a = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], sh)
        k_b = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 256], sh)
        k_r = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], sh)
        p1 = gl.allocate_shared_memory(gl.bfloat16, [64, 64], sh)
        # row maxima / row sums exchanged between the consumers: [consumer, head]
        sm = gl.allocate_shared_memory(gl.float32, [2, 64], flat)
        # 0 Q ready | 1 A0, 2 BR0, 3 A1, 4 BR1 ready | 5 A0, 6 BR0, 7 A1, 8 BR1 free |
        # 9 max0, 10 max1, 11 P0, 12 P1 ready | 13 row sums exchanged | PERSIST: 14 Q free
        if PERSIST:
            sl = gl.allocate_shared_memory(gl.float32, [4, 64], flat)  # by tile parity: [parity * 2 + consumer]
            if SPLIT_BARS:
                bars = _barriers15()
            else:
                ab = gl.allocate_shared_memory(gl.int64, [15, 1], mbarrier.MBarrierLayout())
                bars = (ab.index(0), ab.index(1), ab.index(2), ab.index(3), ab.index(4), ab.index(5), ab.index(6),
                        ab.index(7), ab.index(8), ab.index(9), ab.index(10), ab.index(11), ab.index(12),
                        ab.index(13), ab.index(14))
            mbarrier.init(bars[14], count=2)
        else:
            sl = gl.allocate_shared_memory(gl.float32, [2, 64], flat)
            ab = gl.allocate_shared_memory(gl.int64, [14, 1], mbarrier.MBarrierLayout())
            bars = (ab.index(0), ab.index(1), ab.index(2), ab.index(3), ab.index(4), ab.index(5), ab.index(6),
                    ab.index(7), ab.index(8), ab.index(9), ab.index(10), ab.index(11), ab.index(12), ab.index(13))
        for j in gl.static_range(5):
            mbarrier.init(bars[j], count=128)  # one cp.async arrive per producer thread
        for j in gl.static_range(5, 13):
            mbarrier.init(bars[j], count=1)
        mbarrier.init(bars[13], count=2)
        gl.warp_specialize([
            (_default, (IDX, KS, KE, OUT, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, N_TILES,
                        q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, DENSE, AHEAD, PERSIST, NAMED, EARLY,
                        LATE_IDX, OVERLAP)),
            (_consumer1, (IDX, KS, KE, OUT, LSE, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, stride_lt,
                          N_TILES, q_a, q_b, q_r, k_a, k_b, k_r, p1, sm, sl, bars, DENSE, PERSIST, NAMED, EARLY,
                          LATE_IDX, P1_FIRST)),
            (_producer, (Q, KV, IDX, KS, KE, S, H, TOPK, stride_qt, stride_qh, stride_kv, stride_it, N_TILES,
                         q_a, q_b, q_r, k_a, k_b, k_r, bars, DENSE, L2_HINT, PERSIST)),
        ], [4, 4], [C1_REGS, 56])  # registers: consumer 1, producer (consumer 0 gets the rest: 504 - both)

    return _sparse_mla_ws


def launch(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor | None, ks: torch.Tensor | None,
           ke: torch.Tensor | None, sm_scale: float, out: torch.Tensor, lse: torch.Tensor,
           variant: str = DEFAULT_VARIANT) -> Any:
    """Run ``variant`` (a key of VARIANTS) on ``q`` [T, H, 576], ``kv`` [S, 576] (last dims contiguous), filling
    ``out`` and ``lse``."""
    flags = variant_flags(variant)
    t, h, _ = q.shape
    dense = indices is None
    idx = ks if dense else indices
    grid = sparse_mla_grid(t, h, 64)
    if flags["PERSIST"]:
        grid = (min(grid[0], _sm_count(q.device)),)
    return load()[grid](
        q, kv, idx, ks if dense else idx, ke if dense else idx, out, lse,
        kv.shape[0], h, 0 if dense else indices.shape[1], sm_scale * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), 0 if dense else indices.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), sparse_mla_grid(t, h, 64)[0] if flags["PERSIST"] else 0,
        DENSE=dense, **flags, num_warps=4, maxnreg=MAX_REGS,
    )


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def variant_flags(variant: str) -> dict[str, Any]:
    """The constexpr switches of a variant name (AttentionError naming the known ones if unknown)."""
    if variant not in VARIANTS:
        from cpkv.errors import AttentionError

        raise AttentionError(f"sparse MLA Gluon variant: expected one of {', '.join(VARIANTS)}, got {variant!r}")
    return VARIANTS[variant]
