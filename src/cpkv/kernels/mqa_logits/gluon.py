"""Gluon (explicit-layout Triton) kernel for the indexer's MQA logits on Hopper; reference: cpkv.kernels.mqa_logits.ref.

Same contract as cpkv.kernels.mqa_logits.triton (its module docstring): out[i, c] = k_scale[j] * sum_h w[i, h] *
relu(q[i, h] . k[j]), j = col_offset + c, -inf outside [ks[i], ke[i]) with ``clean``, key tiles outside
the union of a program's token ranges never computed. Covers fp8 q and k, H in {8, 16, 32} (N = 128
query rows = 128 // H tokens x H heads per program), D in {64, 128}, keys TMA-ready (16-byte rows);
other inputs take the Triton kernels.

Why a separate kernel: in the Triton kernels the wgmma of a key tile is waited on before that tile's
epilogue (relu, weights, head sum, k_scale, store) and programs sharing an SM fall into step. Here each
program has one accumulator, each tile's dot waited on before its epilogue; that needs few enough registers
that four single-warpgroup programs share each SM and overlap one another's dots and epilogues. Keys come in
TMA boxes of BOX = 2 tiles (one expect, one copy and one wait per box), STAGES box buffers, each refilled at
the top of the next box after a thread barrier.

Programs: every (span of SPAN tiles, token group) pair, empty ones returning at once, in one flat grid
dimension (cpkv.kernels.grid.logits_grid: any number of tokens, spans fastest);
or (ITEMS) one program per row of a host-built item list (first token, first column, tiles), only the
non-empty pairs, in the order the list gives (cpkv.kernels.mqa_logits.work: span by span, last wave cut short).

Per program: BQ = 128 // H tokens (N = 128 query rows, the wgmma N side, q in shared memory once, rows
permuted as in triton._column_token_head so a thread's accumulator columns are whole heads of one token and
the head sum is an in-thread FMNMX + FFMA chain), SPAN key tiles of BLOCK_S = 64 keys (the M side, K = D),
k_scale loaded one tile ahead. The layouts are written for WGS warpgroups per program; the launch uses one.
Speed against the fp8 GEMM: BENCHMARKS.md (``cpkv bench indexer``).

This module imports Triton's Gluon at import time: import it only where Triton is present
(cpkv.kernels.mqa_logits.triton does, on CUDA).
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cpkv.kernels.grid import logits_grid

BLOCK_S = 64  # keys per tile: one warpgroup's wgmma M


@gluon.constexpr_function
def _result_layout(block_s, bqw, wgs):
    """[BLOCK_S, WGS * BQW] per-token sums as the accumulator leaves them (no data movement): rows
    lane // 4 + 8 r + 16 (warp % 4), tokens BQW (warp // 4) + lane % 4 + 4 r' (r, r' register bits)."""
    tok_regs = [[0, 4 << b] for b in range((bqw // 4).bit_length() - 1)]
    wg_bases = [[0, bqw << b] for b in range(wgs.bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[8, 0]] + tok_regs, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]] + wg_bases, block_bases=[], shape=[block_s, bqw * wgs])


@gluon.jit
def _token_head(n, BQW):
    """Accumulator column n -> (token, head). Warpgroup g owns columns [128 g, 128 g + 128) = tokens
    [BQW g, BQW g + BQW); within them a thread holds columns 2 * (lane % 4) + e + 8 * i (e in 0..1,
    i in 0..15), so token = lane % 4 (+ 4 * ...) puts all of a thread's columns of one row on whole
    heads of its tokens (BQW = 128 / H >= 4)."""
    e = n % 2
    c = (n // 2) % 4
    i = (n % 128) // 8
    tok = (n // 128) * BQW + c + 4 * (i % (BQW // 4))
    head = e + 2 * (i // (BQW // 4))
    return tok, head


@gluon.jit
def _load_box(k_desc, k_bufs, bars, k0, i, n_boxes, BOX_S: gl.constexpr, STAGES: gl.constexpr):
    """Load box i + STAGES (BOX_S keys) into box i's buffer (every warp must be done with box i)."""
    nxt = i + STAGES
    st = i % STAGES
    mbarrier.expect(bars.index(st), k_desc.block_type.nbytes, pred=nxt < n_boxes)
    tma.async_copy_global_to_shared(k_desc, [k0 + nxt * BOX_S, 0], bars.index(st), k_bufs.index(st),
                                    pred=nxt < n_boxes)


@gluon.jit
def _scales(ksc_ptr, j, stride_ksc, S):
    return gl.load(ksc_ptr + j * stride_ksc, mask=j < S, other=0.0)


@gluon.jit
def _uniform(x):
    """x from lane 0 of the warp: provably warp-uniform for ptxas, so branches and loop bounds
    derived from it are not divergent (a divergent path around an in-flight wgmma serializes it)."""
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _epilogue(acc, w, ksc, rows, c0, col_off, tmask, ks_v, ke_v, out_rows, n_cols,
              BQW: gl.constexpr, WGS: gl.constexpr, H: gl.constexpr, BLOCK_S: gl.constexpr,
              CLEAN: gl.constexpr, res_l: gl.constexpr):
    """relu, weights, head sum, k_scale, mask and store of one [BLOCK_S, BQ * H] accumulator."""
    s = gl.maximum(acc, 0.0) * w[None, :]
    # columns n = 128 wg + 2c + e + 8 * (t' + (BQW / 4) * g): token BQW wg + c + 4 t', head e + 2 g
    x = gl.reshape(s, [BLOCK_S, WGS, H // 2, BQW // 4, 4, 2])
    x = gl.permute(x, [0, 1, 3, 4, 2, 5])
    x = gl.sum(gl.reshape(x, [BLOCK_S, WGS * BQW, H]), axis=2)
    val = gl.convert_layout(x, res_l) * ksc[:, None]
    oc = c0 + rows
    if CLEAN:
        j = oc + col_off
        valid = (j[:, None] >= ks_v[None, :]) & (j[:, None] < ke_v[None, :])
        val = gl.where(valid, val, float("-inf"))
    gl.store(out_rows[None, :] + oc[:, None], val,
             mask=tmask[None, :] & (oc < n_cols)[:, None])


@gluon.jit
def mqa_logits_gluon_kernel(
    q_ptr, k_desc, ksc_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, items_ptr,
    T, S, col_off, n_cols,
    stride_qt, stride_ksc, stride_wt, stride_out,
    H: gl.constexpr, D: gl.constexpr, WGS: gl.constexpr, BLOCK_S: gl.constexpr, SPAN: gl.constexpr,
    STAGES: gl.constexpr, CLEAN: gl.constexpr, BOX: gl.constexpr, ITEMS: gl.constexpr,
):
    BQW: gl.constexpr = 128 // H  # tokens per warpgroup
    BQ: gl.constexpr = BQW * WGS
    N: gl.constexpr = 128 * WGS
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WGS],
                                                    instr_shape=[16, 128, 32])
    res_l: gl.constexpr = _result_layout(BLOCK_S, BQW, WGS)
    q_ld: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (D // 16), D // 16], [4 * WGS, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, D], gl.float8e4nv)

    if ITEMS:  # one work item of the host-built list (cpkv.kernels.mqa_logits.work): first token, first column, tiles
        item = items_ptr + gl.program_id(0) * 4
        t0 = _uniform(gl.load(item))
        c_start = _uniform(gl.load(item + 1))
        n_tiles = _uniform(gl.load(item + 2))
    else:  # flat grid (cpkv.kernels.grid.logits_grid): spans fastest
        n_spans = gl.cdiv(n_cols, SPAN * BLOCK_S)
        pid_s = gl.program_id(0) % n_spans
        pid_t = gl.program_id(0) // n_spans
        t0 = pid_t * BQ
    offs_t = t0 + gl.arange(0, BQ, gl.SliceLayout(0, res_l))
    tmask = offs_t < T
    ks_v = gl.load(ks_ptr + offs_t, mask=tmask, other=2147483647)
    ke_v = gl.load(ke_ptr + offs_t, mask=tmask, other=0)
    out_rows = out_ptr + offs_t.to(gl.int64) * stride_out
    if not ITEMS:
        lo = gl.maximum(gl.min(ks_v, axis=0) - col_off, 0)
        hi = gl.minimum(gl.minimum(gl.max(ke_v, axis=0), S) - col_off, n_cols)
        span_lo = pid_s * (SPAN * BLOCK_S)
        span_hi = gl.minimum(span_lo + SPAN * BLOCK_S, n_cols)
        c_start = span_lo + (gl.maximum(lo - span_lo, 0) // BLOCK_S) * BLOCK_S
        c_end = gl.minimum(span_hi, hi)
        n_tiles = gl.maximum(c_end - c_start + BLOCK_S - 1, 0) // BLOCK_S
        c_start = _uniform(c_start)
        n_tiles = _uniform(n_tiles)
    rows = gl.arange(0, BLOCK_S, gl.SliceLayout(1, res_l))
    if CLEAN and not ITEMS:
        ninf = gl.full([BLOCK_S, BQ], float("-inf"), gl.float32, res_l)
        for c in range(span_lo, c_start, BLOCK_S):
            oc = c + rows
            gl.store(out_rows[None, :] + oc[:, None], ninf,
                     mask=tmask[None, :] & (oc < span_hi)[:, None])
        for c in range(c_start + n_tiles * BLOCK_S, span_hi, BLOCK_S):
            oc = c + rows
            gl.store(out_rows[None, :] + oc[:, None], ninf,
                     mask=tmask[None, :] & (oc < span_hi)[:, None])
    if n_tiles > 0:
        n_boxes = (n_tiles + BOX - 1) // BOX  # TMA boxes of BOX tiles
        k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BOX * BLOCK_S, D], k_desc.layout)
        q_s = gl.allocate_shared_memory(gl.float8e4nv, [N, D], q_sl)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        k0 = c_start + col_off
        for s in gl.static_range(STAGES):
            mbarrier.expect(bars.index(s), k_desc.block_type.nbytes, pred=s < n_boxes)
            tma.async_copy_global_to_shared(k_desc, [k0 + s * (BOX * BLOCK_S), 0], bars.index(s), k_bufs.index(s),
                                            pred=s < n_boxes)
        # q rows in accumulator-column order, weights per column, k_scale of tile 0
        qn = gl.arange(0, N, gl.SliceLayout(1, q_ld))
        q_tok, q_head = _token_head(qn, BQW)
        qd = gl.arange(0, D, gl.SliceLayout(0, q_ld))
        q_blk = gl.load(q_ptr + ((t0 + q_tok).to(gl.int64) * stride_qt + q_head * D)[:, None] + qd[None, :],
                        mask=((t0 + q_tok) < T)[:, None], other=0.0)
        q_s.store(q_blk)
        wn = gl.arange(0, N, gl.SliceLayout(0, mma_l))
        w_tok, w_head = _token_head(wn, BQW)
        w = gl.load(w_ptr + (t0 + w_tok) * stride_wt + w_head, mask=(t0 + w_tok) < T, other=0.0)
        j0 = k0 + rows
        ksc = gl.load(ksc_ptr + j0 * stride_ksc, mask=j0 < S, other=0.0)
        fence_async_shared()
        gl.thread_barrier()
        q_t = q_s.permute((1, 0))
        zero = gl.zeros([BLOCK_S, N], gl.float32, mma_l)

        # One accumulator: each tile's dot is waited on before its epilogue; the overlap of tensor
        # cores and ALUs comes from the other programs on the SM (fewer registers, more programs).
        # Keys arrive in boxes of BOX tiles (one TMA, one barrier wait per box). Box b - 1's buffer is
        # refilled at the top of box b, after a thread barrier (every warp has waited on box b - 1's
        # last dot). Placed there, it is also the barrier Gluon would put before the next wgmma reads
        # the ring, so a box costs three barriers (this one and two around the TMA issue) where a
        # refill between the box's dots cost four.
        for b in range(n_boxes):
            st = b % STAGES
            if b > 0:  # every warp is done with box b - 1: refill its buffer with box b - 1 + STAGES
                gl.thread_barrier()
                _load_box(k_desc, k_bufs, bars, k0, b - 1, n_boxes, BOX * BLOCK_S, STAGES)
            mbarrier.wait(bars.index(st), (b // STAGES) & 1)
            for h in gl.static_range(BOX):
                i = b * BOX + h
                if i < n_tiles:
                    tok = warpgroup_mma(k_bufs.index(st).slice(h * BLOCK_S, BLOCK_S), q_t, zero,
                                        use_acc=False, is_async=True)
                    ksc_n = _scales(ksc_ptr, k0 + (i + 1) * BLOCK_S + rows, stride_ksc, S)
                    acc = warpgroup_mma_wait(0, deps=[tok])
                    _epilogue(acc, w, ksc, rows, c_start + i * BLOCK_S, col_off, tmask, ks_v, ke_v,
                              out_rows, n_cols, BQW, WGS, H, BLOCK_S, CLEAN, res_l)
                    ksc = ksc_n


WARPGROUPS = 1       # warpgroups per program (each its own 128 // H tokens on every key tile)
BOX = 2              # 64-key tiles per TMA box
PROGRAMS_PER_SM = 4  # one accumulator, ~120 registers and 48 KB of shared memory per program


@functools.lru_cache(maxsize=None)
def key_layout(d: int, rows: int = BLOCK_S):
    """Shared layout of a [rows, d] fp8 key box (the TMA box; its 64-row slices are wgmma A operands); built once
    per shape (~10 µs of host time each)."""
    return gl.NVMMASharedLayout.get_default_for([rows, d], gl.float8e4nv)


def mqa_logits_gluon(q, k, k_scale, weights, ks, ke, out, *, col_offset: int = 0, clean: bool = True,
                     span: int = 64, stages: int = 2, items: torch.Tensor | None = None) -> torch.Tensor:
    """Fill out [T, n_cols] float32 (column c = key col_offset + c). Inputs validated, in this kernel's
    domain (cpkv.kernels.mqa_logits.triton._gluon_applies). span: 64-key tiles per program; stages: TMA
    ring depth (>= 2). items: int32 [n, 4] work items (cpkv.kernels.mqa_logits.work.logits_work_items:
    first token, first column, tiles, 0) in their launch order, one program each, instead of the grid; the
    columns outside every item are left unwritten, so it needs ``clean=False``."""
    T, H, D = q.shape
    n_cols = out.shape[1]
    if T == 0 or n_cols == 0:
        return out
    bq = 128 // H * WARPGROUPS
    k_desc = TensorDescriptor.from_tensor(k, [BLOCK_S * BOX, D], key_layout(D, BLOCK_S * BOX))
    if items is not None:
        if clean:
            raise ValueError("a work-item list leaves columns outside its items unwritten: it needs clean=False")
        if items.dtype != torch.int32 or items.dim() != 2 or items.shape[1] != 4 or not items.is_contiguous():
            raise ValueError(f"items must be contiguous int32 [n, 4], got {items.dtype} {tuple(items.shape)}")
        if items.shape[0] == 0:
            return out
        grid = (items.shape[0],)
    else:
        grid = logits_grid(n_cols, T, span * BLOCK_S, bq)
    mqa_logits_gluon_kernel[grid](
        q, k_desc, k_scale, weights, ks, ke, out, items if items is not None else ks,
        T, k.shape[0], col_offset, n_cols,
        q.stride(0), k_scale.stride(0), weights.stride(0), out.stride(0),
        H=H, D=D, WGS=WARPGROUPS, BLOCK_S=BLOCK_S, SPAN=span, STAGES=max(stages, 2), CLEAN=clean,
        BOX=BOX, ITEMS=items is not None, num_warps=4 * WARPGROUPS,
    )
    return out
