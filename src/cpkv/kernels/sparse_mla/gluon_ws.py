"""Warp-specialised Gluon sparse MLA prefill kernel for Hopper (512 + 64 dims, blocks of 64 heads).

Same contract as :mod:`cpkv.kernels.sparse_mla` (a tile = one query token x 64 heads; sparse indices or the
dense causal range ``ks[t] .. ke[t]-1``), different schedule. Persistent: one program per SM loops over the
tiles of the flat grid (cpkv.kernels.grid), barrier parities running on across tiles. Three warpgroups:

* producer (4 warps, few registers): loads a tile's Q, then gathers key blocks of 64 rows with 16-byte
  ``cp.async`` into two shared buffers; each buffer is split into a part A (dims 0..255) and a part
  BR (dims 256..511 plus the 64 rope dims) with its own "ready" / "free" mbarrier, so a part is
  refilled as soon as its last reader is done. Completion is tracked per thread by
  ``cp.async.mbarrier.arrive.noinc`` (no wait_group in the consumers). With each block's first part it stages
  the block's 64 indices in shared memory (a 4-byte ``cp.async`` completing with the same barrier), from which
  the consumers mask: they issue no global load in their loop. A "Q free" barrier, arrived by both
  consumers once their last score wgmmas of a tile are waited for, lets it load the next Q, then its keys,
  while the consumers finish the last pair and normalise and store.
* consumer 0 (default partition) computes the scores of the even key block of each pair (buffer 0),
  consumer 1 those of the odd block (buffer 1): full [64 heads, 64 keys] tiles with m64n64 wgmma,
  so Q is read from shared memory once per key block. While one consumer does its softmax, the other's score
  wgmma runs ("seesaw", the schedule FlashMLA's sm90 kernels use). Consumer 0 computes the first block's
  scores before its loop and issues the next pair's score wgmmas right after its last value wgmma, waiting
  for that one only to free the buffer (FlashMLA's warpgroup 0 order), so its tensor-core work runs back to
  back; the scores are waited for inside the iteration.
* each consumer owns half of the output (d_v 0..255 / 256..511): it multiplies its own P from
  registers (RS wgmma) with its half of its block's values, and the other consumer's P from shared
  memory with its half of the other block's values. Row maxima go through shared memory: consumer
  0 publishes its max, consumer 1 takes the max over both and publishes it back, consumer 0
  rescales its P (before sharing it) and its accumulator to the common max. P of block 0 is
  written over the rope part of key buffer 0 (no longer needed once its scores are done), and published
  while consumer 0's first value wgmma runs (it reads P from registers), so consumer 1 gets it a wgmma earlier.
* the epilogue: each consumer divides its half by the row sums and stores it as bf16 in 16-byte stores; two
  warp-shuffle layout conversions (no shared memory) first give each lane 8 adjacent columns.

Shared memory: Q 72 KB + two key buffers 2 x 72 KB + P of block 1 8 KB + row maxima and sums + staged indices
(512 B) + 15 barriers = 231,544 B, plus Triton's partition captures (of 232,448). Registers: launch cap 168 x 12
warps, re-split 240 / 208 / 56 (consumer 0 / 1 / producer), no spills. Three things ptxas needs (else it serialises every
wgmma or spills): no wgmma accumulator in flight across the loop's back edge, shared-memory views rebuilt per
iteration (``_opaque_zero``), and the peeled first block's views indexed by an opaque zero too (in the tile
loop constant views are loop-invariant: their 36 wgmma descriptors were hoisted and spilled 800 B).
Checked offline for sm_90a: tests/attention/test_sparse_mla_gluon_ws.py.

Against FlashMLA's sm90 sparse prefill (``csrc/sm90/prefill/sparse/phase1.cuh``, read at 9241ae3), same:
64 heads x one query token per CTA (h 128 is two tiles, each gathering the same keys: FlashMLA does not share a
gather across 128 heads either), 64-key blocks in two 72 KB buffers split into dims 0..255 / 256..575 with
their own ready / free barriers and the same fill order (A0, BR1, BR0, A1), 16-byte ``cp.async`` from 128
producer threads completing by ``cp.async.mbarrier.arrive.noinc``, the two-consumer seesaw with each consumer
owning half of d_v, P of block 0 over block 0's rope dims, consumer 0's look-ahead. Different:

1. L2 hints: FlashMLA's key gathers carry ``.L2::cache_hint`` (``evict_last``) and ``.L2::256B``; ours none
   (Gluon's ``async_copy`` drops ``eviction_policy``; by a PTX rewrite they gave nothing: BENCHMARKS.md).
2. Masking: FlashMLA's producer writes the 64 validity bits of each block to shared memory behind a barrier of
   their own; ours stages the 64 indices with the block's data (the consumers compare them).
3. Q arrives by TMA (evict_first) and O leaves through shared memory by TMA stores (lse by a bulk copy);
   ours: Q by the producer's ``cp.async``, O by 16-byte register stores, lse by register stores.
4. Syncs between the consumers: named barriers (bar.arrive / bar.sync over 256 threads) in FlashMLA; ours
   are mbarriers, each arrive after a warpgroup barrier (named barriers are slower here: BENCHMARKS.md).
5. Consumer 0 publishes P0 before its first value wgmma is done; FlashMLA's warpgroup 0 after.
6. Registers: FlashMLA 216 / 216 / 72 (consumers / producer) of 384 threads at launch bounds 1 block/SM.
   FlashMLA needs top-k a multiple of 128 (no tail masks); ours takes any count.
7. FlashMLA is not persistent (one CTA per tile: each tile's Q load, first key gathers and epilogue exposed);
   ours is.

The indices staged with each block and the 16-byte output stores keep the consumers' loads and stores from
queueing behind the producer's gathers; other schedules (non-persistent, L2 hints, named barriers, other signal,
free and fill orders, more producers, per-barrier allocations) were slower or level (BENCHMARKS.md). A 128-head CTA
sharing one gather does not fit: its fp32 output is 128 x 512 x 4 B = 256 KB of registers (the whole register
file) and Q alone 144 KB of the 227 KB shared memory.

Speed against the bf16 GEMM: BENCHMARKS.md (``cpkv bench attention``; against FlashMLA: ``--peer flashmla``).
Triton is imported lazily by :func:`load`.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from cpkv.kernels.grid import sparse_mla_grid

LOG2E = 1.4426950408889634
MAX_REGS = 168  # launch-wide cap: 12 warps x 168 = 64512 of the 65536 registers; partitions re-split them


@lru_cache(maxsize=1)
def load() -> Any:
    """Compile-on-demand kernel (imports Gluon lazily)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    @gluon.jit
    def _program(H, tile):
        """(head block, query token as int64) of a tile of the flat grid (cpkv.kernels.grid)."""
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
        ks_t, n_keys, _ = _key_range(IDX, KS, KE, TOPK, stride_it, t, DENSE)
        m_run = gl.full([64], -1.0e30, gl.float32, gl.SliceLayout(1, s_l))
        l_run = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_l))
        o = gl.zeros([64, 256], gl.float32, o_l)  # consumer 1: waited at the end of every pair
        s0 = gl.zeros([64, 64], gl.float32, s_l)
        return t, ks_t, n_keys, m_run, l_run, o, s0

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
    def _valid(ixb, ks_t, k0, n_keys, S, layout: gl.constexpr, DENSE: gl.constexpr):
        """Validity of keys k0 .. k0 + 63 of this query in ``layout`` (1-D), for a consumer: from the range
        (dense), or from the block's indices the producer staged in shared memory (``ixb``; read once the
        block's ready barrier is passed)."""
        offs = k0 + gl.arange(0, 64, layout)
        if DENSE:
            idx = ks_t + offs
        else:
            idx = ixb.load(layout)
        return (offs < n_keys) & (idx >= 0) & (idx < S)

    @gluon.jit
    def _stage_indices(idx_row, k0, n_keys, ixb, DENSE: gl.constexpr):
        """cp.async the 64 indices of keys k0 .. k0 + 63 into ``ixb`` (sparse only; zero past ``n_keys``): they
        complete with the block's first ready barrier, so the consumers mask from shared memory and issue no
        global loads in their loop."""
        if not DENSE:
            il: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            offs = k0 + gl.arange(0, 64, il)
            async_copy.async_copy_global_to_shared(ixb, idx_row + offs, mask=offs < n_keys)

    @gluon.jit
    def _gather(KV, stride_kv, rows, valid, col0, buf, lg: gl.constexpr, N: gl.constexpr):
        """cp.async rows x [col0, col0 + N) of KV into ``buf`` (zero-filled where not valid)."""
        c = col0 + gl.arange(0, N, gl.SliceLayout(0, lg))
        ptr = KV + (rows.to(gl.int64) * stride_kv)[:, None] + c[None, :]
        async_copy.async_copy_global_to_shared(buf, ptr, mask=valid[:, None], cache_modifier=".cg")

    @gluon.jit
    def _producer(Q, KV, IDX, KS, KE, S, H, TOPK, stride_qt, stride_qh, stride_kv, stride_it, N_TILES,
                  q_a, q_b, q_r, k_a, k_b, k_r, ix, bars, DENSE: gl.constexpr):
        g = 0  # key-block pairs done (barrier parities run on across tiles)
        j = 0  # tiles done
        for tile in range(gl.program_id(0), N_TILES, gl.num_programs(0)):
            mbarrier.wait(bars[14], (j & 1) ^ 1)  # Q free: both consumers done with the last tile's scores
            g += _producer_tile(Q, KV, IDX, KS, KE, S, H, TOPK, stride_qt, stride_qh, stride_kv, stride_it,
                                q_a, q_b, q_r, k_a, k_b, k_r, ix, bars, tile, g, DENSE)
            j += 1

    @gluon.jit
    def _producer_tile(Q, KV, IDX, KS, KE, S, H, TOPK, stride_qt, stride_qh, stride_kv, stride_it,
                       q_a, q_b, q_r, k_a, k_b, k_r, ix, bars, tile, g0, DENSE: gl.constexpr):
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

        ks_t, n_keys, idx_row = _key_range(IDX, KS, KE, TOPK, stride_it, t, DENSE)
        n_pairs = gl.cdiv(n_keys, 128)
        for i in range(n_pairs):
            ph = ((g0 + i) & 1) ^ 1  # a fresh barrier passes a wait on parity 1
            r0, v0 = _rows(idx_row, ks_t, 128 * i, n_keys, S, rl, DENSE)
            r1, v1 = _rows(idx_row, ks_t, 128 * i + 64, n_keys, S, rl, DENSE)
            # order of need: A0 (consumer 0 starts its scores there), BR1, BR0, A1
            mbarrier.wait(bars[5], ph)  # free A0 (and block 0's staged indices)
            _stage_indices(idx_row, 128 * i, n_keys, ix.index(0), DENSE)
            _gather(KV, stride_kv, r0, v0, 0, k_a.index(0), lg, 256)
            async_copy.mbarrier_arrive(bars[1], increment_count=False)
            mbarrier.wait(bars[8], ph)  # free BR1 (and block 1's staged indices)
            _stage_indices(idx_row, 128 * i + 64, n_keys, ix.index(1), DENSE)
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
    def _signal(bars, k: gl.constexpr):
        """Consumer-to-consumer signal ``k`` (9 max0, 10 max1, 11 P0, 12 P1 ready) after this warpgroup's
        shared-memory writes: a warpgroup barrier, then an arrive on mbarrier k."""
        gl.thread_barrier()
        mbarrier.arrive(bars[k])

    @gluon.jit
    def _sums_exchanged(bars, j):
        """Both consumers' row sums of tile ``j`` are in shared memory (called by both after their store)."""
        gl.thread_barrier()
        mbarrier.arrive(bars[13])
        mbarrier.wait(bars[13], j & 1)

    @gluon.jit
    def _q_free(bars):
        """This consumer's score wgmmas of the tile are done (waited), so Q may be reloaded."""
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
        mbarrier.wait(bars[1], ph)  # A0 ready
        fence_async_shared()
        s = warpgroup_mma(qa, ka.permute((1, 0)), s0, use_acc=False, is_async=True)
        mbarrier.wait(bars[2], ph)  # BR0 ready
        fence_async_shared()
        s = warpgroup_mma(qb, kb.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(qr, kr.permute((1, 0)), s, is_async=True)
        return warpgroup_mma_wait(0, deps=[s])

    @gluon.jit
    def _consumer0(IDX, KS, KE, S, H, TOPK, scale_log2, stride_it, q_a, q_b, q_r, k_a, k_b, k_r, p1, ix, sm, bars,
                   tile, g0, j, DENSE: gl.constexpr):
        """Even key block of each pair (buffer 0) -> (O[:, 0:256] unnormalised, row sums, row max, pairs).

        The next pair's score wgmmas are issued before the wait for this pair's last value wgmma (FlashMLA's
        warpgroup 0 order), so the tensor cores are not idle between pairs; the scores are waited for inside
        the iteration (nothing in flight across the back edge)."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)
        t, ks_t, n_keys, m_run, l_run, o, s0 = _consumer_start(IDX, KS, KE, H, TOPK, stride_it, tile, DENSE, s_l,
                                                                o_l)
        mbarrier.wait(bars[0], j & 1)  # Q
        n_pairs = gl.cdiv(n_keys, 128)
        s_next = s0
        if n_pairs > 0:
            # views by an opaque 0 here too: constant views are invariant in the tile loop, and their 36 hoisted
            # descriptors spilled (800 B)
            z = _opaque_zero(j)
            s_next = _scores0(q_a.index(z), q_b.index(z), q_r.index(z), k_a.index(z), k_b.index(z), k_r.index(z),
                              s0, bars, g0 & 1)
        for i in range(n_pairs):
            ph = (g0 + i) & 1
            z = _opaque_zero(i)
            qa, qb, qr = q_a.index(z), q_b.index(z), q_r.index(z)
            ka, kb, kr, ka1 = k_a.index(z), k_b.index(z), k_r.index(z), k_a.index(z + 1)
            valid = _valid(ix.index(z), ks_t, 128 * i, n_keys, S, gl.SliceLayout(0, s_l), DENSE)  # A0 passed
            s = s_next
            if i == n_pairs - 1:
                _q_free(bars)  # the tile's last scores are in: the next Q loads under the rest
            s, m_new = _softmax_in(s, valid, m_run, scale_log2)
            alpha = gl.exp2(m_run - m_new)
            p = gl.exp2(s * scale_log2 - m_new[:, None])
            l_run = l_run * alpha + gl.sum(p, 1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            sm.index(0).store(m_new)
            _signal(bars, 9)  # my max published
            o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_op), ka, o, is_async=True)
            # P0 is published while that value wgmma runs (it reads P from registers and the values from A0; P0
            # goes over the rope part, whose scores are done): consumer 1 gets it one wgmma earlier
            mbarrier.wait(bars[10], ph)  # common max from consumer 1
            m1 = sm.index(1).load(row_l)
            f = gl.exp2(m_new - m1)
            kr.store((p * f[:, None]).to(gl.bfloat16))  # P0 over the rope part of buffer 0
            fence_async_shared()
            _signal(bars, 11)  # P0 ready
            o = warpgroup_mma_wait(0, deps=[o])
            gl.thread_barrier()
            mbarrier.arrive(bars[5])  # A0 free
            o = o * gl.convert_layout(f, gl.SliceLayout(1, o_l))[:, None]
            l_run = l_run * f
            m_run = m1
            mbarrier.wait(bars[12], ph)  # P1 ready
            fence_async_shared()
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
        return o, l_run, m_run, n_pairs

    @gluon.jit
    def _consumer1(IDX, KS, KE, OUT, LSE, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, stride_lt, N_TILES,
                   q_a, q_b, q_r, k_a, k_b, k_r, p1, ix, sm, sl, bars, DENSE: gl.constexpr):
        g = 0
        j = 0
        for tile in range(gl.program_id(0), N_TILES, gl.num_programs(0)):
            g += _consumer1_tile(IDX, KS, KE, OUT, LSE, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh,
                                 stride_lt, q_a, q_b, q_r, k_a, k_b, k_r, p1, ix, sm, sl, bars, tile, g, j, DENSE)
            j += 1

    @gluon.jit
    def _consumer1_tile(IDX, KS, KE, OUT, LSE, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, stride_lt,
                        q_a, q_b, q_r, k_a, k_b, k_r, p1, ix, sm, sl, bars, tile, g0, j, DENSE: gl.constexpr):
        """Odd key block of each pair (buffer 1); output columns 256..511 and the lse -> the tile's pairs."""
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)
        t, ks_t, n_keys, m_run, l_run, o, s0 = _consumer_start(IDX, KS, KE, H, TOPK, stride_it, tile, DENSE, s_l,
                                                                o_l)
        mbarrier.wait(bars[0], j & 1)  # Q
        n_pairs = gl.cdiv(n_keys, 128)
        for i in range(n_pairs):
            ph = (g0 + i) & 1
            z = _opaque_zero(i)
            qa, qb, qr = q_a.index(z), q_b.index(z), q_r.index(z)
            ka, kb, kr = k_a.index(z + 1), k_b.index(z + 1), k_r.index(z + 1)
            mbarrier.wait(bars[4], ph)  # BR1 ready (and block 1's indices)
            valid = _valid(ix.index(z + 1), ks_t, 128 * i + 64, n_keys, S, gl.SliceLayout(0, s_l), DENSE)
            fence_async_shared()
            s = warpgroup_mma(qb, kb.permute((1, 0)), s0, use_acc=False, is_async=True)
            s = warpgroup_mma(qr, kr.permute((1, 0)), s, is_async=True)
            mbarrier.wait(bars[3], ph)  # A1 ready
            fence_async_shared()
            s = warpgroup_mma(qa, ka.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            if i == n_pairs - 1:
                _q_free(bars)
            mbarrier.wait(bars[9], ph)  # max of consumer 0
            m0 = sm.index(0).load(row_l)
            s, m_new = _softmax_in(s, valid, m0, scale_log2)
            alpha = gl.exp2(m_run - m_new)
            p = gl.exp2(s * scale_log2 - m_new[:, None])
            l_run = l_run * alpha + gl.sum(p, 1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            sm.index(1).store(m_new)
            _signal(bars, 10)  # common max published
            pb = p.to(gl.bfloat16)
            o = warpgroup_mma(gl.convert_layout(pb, p_op), kb, o, is_async=True)
            p1.store(pb)
            fence_async_shared()
            mbarrier.wait(bars[11], ph)  # P0 ready
            fence_async_shared()
            o = warpgroup_mma(k_r.index(z), k_b.index(z), o, is_async=True)
            _signal(bars, 12)  # P1 ready (after the P0 wait: signalled before it, the kernel is slower)
            o = warpgroup_mma_wait(1, deps=[o])
            gl.thread_barrier()
            mbarrier.arrive(bars[8])  # BR1 free
            o = warpgroup_mma_wait(0, deps=[o])
            gl.thread_barrier()
            mbarrier.arrive(bars[6])  # BR0 free (its values and P0 read)
            m_run = m_new
        o = warpgroup_mma_wait(0, deps=[o])
        if n_pairs == 0:
            _q_free(bars)
        # combine the row sums of both consumers, write columns 256..511 and the lse
        sb = (j & 1) * 2  # a tile's row sums in the half of sl of its parity
        sl.index(sb + 1).store(l_run)
        _sums_exchanged(bars, j)
        l_tot = l_run + sl.index(sb).load(row_l)
        empty = l_tot == 0.0
        pid_h, _ = _program(H, tile)
        _store_half(OUT, o, l_tot, t, pid_h, H, stride_ot, stride_oh, 256, o_l)
        lse = gl.where(empty, float("inf"), (m_run + gl.log2(gl.where(empty, 1.0, l_tot))) / 1.4426950408889634)
        hl = pid_h * 64 + gl.arange(0, 64, row_l)
        gl.store(LSE + t * stride_lt + hl, lse, mask=hl < H)
        return n_pairs

    @gluon.jit
    def _store_half(OUT, o, l_tot, t, pid_h, H, stride_ot, stride_oh, C0: gl.constexpr, o_l: gl.constexpr):
        """O[t, heads of block pid_h, C0 .. C0 + 255] = o / l_tot (0 where no key was valid), bf16, in 16-byte
        stores: the wgmma layout (2 adjacent columns a lane) is rearranged within each quad of lanes (shuffles, no
        shared memory: the warps keep their rows) so that a lane holds 8 adjacent columns. A warp's store then
        writes 8 rows x 64 B instead of 8 rows x 8 B (the LSU queue is shared with the producer's gathers).
        Two conversions, each swapping one register bit with one lane bit: Triton converts by shuffles only up to
        one such swap, and through 3.6 KB of shared scratch otherwise (which does not fit)."""
        mid_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [8, 0], [0, 2], [0, 16], [0, 32], [0, 64], [0, 128]],
            lane_bases=[[0, 8], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[64, 256])
        st_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0], [0, 32], [0, 64], [0, 128]],
            lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[64, 256])
        l_o = gl.convert_layout(gl.where(l_tot == 0.0, 1.0, l_tot), gl.SliceLayout(1, o_l))
        ob = gl.convert_layout(gl.convert_layout((o / l_o[:, None]).to(gl.bfloat16), mid_l), st_l)
        ho = pid_h * 64 + gl.arange(0, 64, gl.SliceLayout(1, st_l))
        co = C0 + gl.arange(0, 256, gl.SliceLayout(0, st_l))
        gl.store(OUT + t * stride_ot + (ho * stride_oh)[:, None] + co[None, :], ob, mask=(ho < H)[:, None])

    @gluon.jit
    def _default(IDX, KS, KE, OUT, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, N_TILES,
                 q_a, q_b, q_r, k_a, k_b, k_r, p1, ix, sm, sl, bars, DENSE: gl.constexpr):
        g = 0
        j = 0
        for tile in range(gl.program_id(0), N_TILES, gl.num_programs(0)):
            g += _default_tile(IDX, KS, KE, OUT, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh,
                               q_a, q_b, q_r, k_a, k_b, k_r, p1, ix, sm, sl, bars, tile, g, j, DENSE)
            j += 1

    @gluon.jit
    def _default_tile(IDX, KS, KE, OUT, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh,
                      q_a, q_b, q_r, k_a, k_b, k_r, p1, ix, sm, sl, bars, tile, g0, j, DENSE: gl.constexpr):
        """Consumer 0 on one tile and its output columns 0..255 -> the tile's pairs."""
        o, l_run, _, n_pairs = _consumer0(IDX, KS, KE, S, H, TOPK, scale_log2, stride_it, q_a, q_b, q_r, k_a, k_b, k_r,
                                          p1, ix, sm, bars, tile, g0, j, DENSE)
        if n_pairs == 0:
            _q_free(bars)
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, s_l)
        sb = (j & 1) * 2
        sl.index(sb).store(l_run)
        _sums_exchanged(bars, j)
        l_tot = l_run + sl.index(sb + 1).load(row_l)
        pid_h, t = _program(H, tile)
        _store_half(OUT, o, l_tot, t, pid_h, H, stride_ot, stride_oh, 0, o_l)
        return n_pairs

    @gluon.jit(do_not_specialize=["N_TILES"])  # the tile count: one compile for any T
    def _sparse_mla_ws(
        Q, KV, IDX, KS, KE, OUT, LSE,
        S, H, TOPK, scale_log2,
        stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_lt, N_TILES,
        DENSE: gl.constexpr,
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
        ix = gl.allocate_shared_memory(gl.int32, [2, 64], flat)  # the indices of each key buffer's block (sparse)
        # row maxima / row sums exchanged between the consumers: [consumer, head]; sums by tile parity:
        # [parity * 2 + consumer]
        sm = gl.allocate_shared_memory(gl.float32, [2, 64], flat)
        sl = gl.allocate_shared_memory(gl.float32, [4, 64], flat)
        # 0 Q ready | 1 A0, 2 BR0, 3 A1, 4 BR1 ready | 5 A0, 6 BR0, 7 A1, 8 BR1 free |
        # 9 max0, 10 max1, 11 P0, 12 P1 ready | 13 row sums exchanged | 14 Q free
        ab = gl.allocate_shared_memory(gl.int64, [15, 1], mbarrier.MBarrierLayout())
        bars = (ab.index(0), ab.index(1), ab.index(2), ab.index(3), ab.index(4), ab.index(5), ab.index(6),
                ab.index(7), ab.index(8), ab.index(9), ab.index(10), ab.index(11), ab.index(12),
                ab.index(13), ab.index(14))
        mbarrier.init(bars[14], count=2)
        for j in gl.static_range(5):
            mbarrier.init(bars[j], count=128)  # one cp.async arrive per producer thread
        for j in gl.static_range(5, 13):
            mbarrier.init(bars[j], count=1)
        mbarrier.init(bars[13], count=2)
        gl.warp_specialize([
            (_default, (IDX, KS, KE, OUT, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, N_TILES,
                        q_a, q_b, q_r, k_a, k_b, k_r, p1, ix, sm, sl, bars, DENSE)),
            (_consumer1, (IDX, KS, KE, OUT, LSE, S, H, TOPK, scale_log2, stride_it, stride_ot, stride_oh, stride_lt,
                          N_TILES, q_a, q_b, q_r, k_a, k_b, k_r, p1, ix, sm, sl, bars, DENSE)),
            (_producer, (Q, KV, IDX, KS, KE, S, H, TOPK, stride_qt, stride_qh, stride_kv, stride_it, N_TILES,
                         q_a, q_b, q_r, k_a, k_b, k_r, ix, bars, DENSE)),
        ], [4, 4], [208, 56])  # registers: consumer 1, producer; consumer 0 gets the rest, 504 - both = 240 (its
        # look-ahead needs them: at 224 / 224 it spilled 96 B)

    return _sparse_mla_ws


def launch(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor | None, ks: torch.Tensor | None,
           ke: torch.Tensor | None, sm_scale: float, out: torch.Tensor, lse: torch.Tensor) -> Any:
    """Run the kernel on ``q`` [T, H, 576], ``kv`` [S, 576] (last dims contiguous), filling ``out`` and ``lse``;
    one program per SM (at most one per tile)."""
    t, h, _ = q.shape
    dense = indices is None
    idx = ks if dense else indices
    n_tiles = sparse_mla_grid(t, h, 64)[0]
    return load()[(min(n_tiles, _sm_count(q.device)),)](
        q, kv, idx, ks if dense else idx, ke if dense else idx, out, lse,
        kv.shape[0], h, 0 if dense else indices.shape[1], sm_scale * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), 0 if dense else indices.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), n_tiles,
        DENSE=dense, num_warps=4, maxnreg=MAX_REGS,
    )


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
