"""Triton kernel for the indexer's decode logits over paged index rows (docs/design.md §11); reference:
cpkv.kernels.mqa_logits.ref.paged_mqa_logits_ref.

    out[b, s] = scale(s) * sum_h w[b, h] * relu(q[b, h, :] . k(s))   for s < ctx[b]
              = -inf                                                 for ctx[b] <= s < L

    q        fp8 e4m3 [B, H, D] (head rows contiguous)      one query row per generation
    w        float32 [B, H]                                 the folded head weights
    bases    int64 [cp] on the device                       byte address of row 0 of each rank's index-row pool
    owner_tab, page_tab   int64 [slots, max_pages]          owner rank and page id of each page of each slot
    slot, ctx             int64 [B] on the device           generation b's table row and context length
    out      float32 [B, L]                                 L fixed by the caller (a bucket), L >= max(ctx)

The caller keeps ctx[b] <= min(L, max_pages * P) (positions past L are not computed; table entries past
ctx[b] are never read, so a slot's row may hold anything there).

Key s of generation b is row ``page_tab[slot[b], s // P] * P + s % P`` of rank ``owner_tab[slot[b], s // P]``'s
pool: D + 4 bytes at ``bases[owner] + row * (D + 4)``, D fp8 values then one float32 scale (the 132-byte index
rows of GLM-5 / DeepSeek-V3.2), read in place (peers' pools are mapped into this process).

Graph-capturable: the grid depends on B and L only and nothing reads ctx on the host, so one capture replays with
any ctx. A program owns generation b's positions [j * SPAN * BLOCK_S, (j + 1) * SPAN * BLOCK_S): its tiles that
start before ctx[b] are computed (one [BLOCK_S, D] x [D, H] dot each, relu, weights, head sum, scale), the rest
written -inf. Addresses are taken relative to the q (fp8 values) and w (scales) arguments, as page_gather's are
relative to its output, so the kernels also run under TRITON_INTERPRET on CPU tensors; rows are 4-byte aligned
(D + 4 bytes), so keys load as 4-byte vectors. Two kernels (PagedLogitsConfig.variant):

    runs (default)   grid (tiles, B), B in launches of at most 65535. A tile is BLOCK_S / PK runs of
                     PK = min(P, BLOCK_S) keys, each inside one page: the table and the bases are read once per run
                     and a run is read whole under one predicate, a thread's loads at constant offsets from one
                     address (the rows of a live page past ctx[b] are read too, in bounds, and their logits
                     discarded). ctx, slot, q and w load together at the start, so a program waits on three
                     dependent loads before its keys; one 128-key tile per program (span 1, no software pipeline)
                     has all its keys in flight at once, and the programs resident on an SM (eight at 4 warps and
                     64 registers) overlap one another's waits.
    keys             grid (B, tiles). Each key's page-table entry and base are loaded per key, by every thread
                     that holds a part of its row, and its row read under its own predicate.

Triton is imported here: import this module only where the backends run Triton (cpkv.indexer.paged does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpkv.kernels.mqa_logits.config import PagedLogitsConfig
from cpkv.kernels.platform import capability


DEFAULT_CONFIG = PagedLogitsConfig()
MAX_GRID_Y = 65535
KEYS_CONFIG = PagedLogitsConfig(block_s=64, span=4, num_warps=4, num_stages=2, variant="keys", maxnreg=None)


@triton.jit
def _tile(q_ptr, w_ptr, owner_row, page_row, bases_ptr, q_addr, w_addr, q_t, w, s, n,
          D: tl.constexpr, P: tl.constexpr, CAST_BF16: tl.constexpr):
    """Logits [BLOCK_S] of positions s (int64) of one generation with context n; -inf at s >= n."""
    live = s < n
    col = s // P
    owner = tl.load(owner_row + col, mask=live, other=0)
    page = tl.load(page_row + col, mask=live, other=0)
    addr = tl.load(bases_ptr + owner, mask=live, other=0) + (page * P + s % P) * (D + 4)
    # word offsets from q's / w's address, times 4 so the compiler sees 4-byte aligned, D-contiguous rows
    kw = (addr - q_addr) // 4
    k = tl.load(q_ptr + (kw * 4)[:, None] + tl.arange(0, D)[None, :], mask=live[:, None], other=0.0)
    scale = tl.load(w_ptr + (addr + D - w_addr) // 4, mask=live, other=0.0)
    if CAST_BF16:
        k = k.to(tl.bfloat16)
    dots = tl.dot(k, q_t)                                          # [BLOCK_S, HP] float32
    val = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1) * scale
    return tl.where(live, val, float("-inf"))


@triton.jit(do_not_specialize=["q_addr", "w_addr"])
def paged_logits_kernel(
    q_ptr, w_ptr, bases_ptr, owner_ptr, page_ptr, slot_ptr, ctx_ptr, out_ptr,
    q_addr, w_addr, L, stride_qb, stride_wb, stride_tab, stride_out,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    BLOCK_S: tl.constexpr, SPAN: tl.constexpr, CAST_BF16: tl.constexpr,
):
    b = tl.program_id(0)
    s_lo = tl.program_id(1) * (SPAN * BLOCK_S)
    n = tl.load(ctx_ptr + b)
    out_row = out_ptr + b.to(tl.int64) * stride_out
    offs = tl.arange(0, BLOCK_S)
    # tiles [0, n_tiles) of the span start before ctx: computed; the rest (all of a program past ctx) -inf
    n_tiles = tl.minimum(tl.maximum(n - s_lo + BLOCK_S - 1, 0) // BLOCK_S, SPAN).to(tl.int32)
    if n_tiles > 0:
        heads = tl.arange(0, HP)
        q_blk = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * D + tl.arange(0, D)[None, :],
                        mask=(heads < H)[:, None], other=0.0)
        if CAST_BF16:
            q_blk = q_blk.to(tl.bfloat16)
        q_t = tl.trans(q_blk)
        w = tl.load(w_ptr + b.to(tl.int64) * stride_wb + heads, mask=heads < H, other=0.0)
        sl = tl.load(slot_ptr + b)
        owner_row = owner_ptr + sl * stride_tab
        page_row = page_ptr + sl * stride_tab
        for t in range(0, n_tiles):
            s = s_lo + t * BLOCK_S + offs.to(tl.int64)
            val = _tile(q_ptr, w_ptr, owner_row, page_row, bases_ptr, q_addr, w_addr, q_t, w, s, n, D, P, CAST_BF16)
            tl.store(out_row + s, val, mask=s < L)
    for t in range(n_tiles, SPAN):
        s = s_lo + t * BLOCK_S + offs
        tl.store(out_row + s, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=s < L)


@triton.jit
def _run_tile(q_ptr, w_ptr, owner_row, page_row, bases_ptr, q_addr, w_addr, q_t, w, s0, n,
              D: tl.constexpr, P: tl.constexpr, PK: tl.constexpr, NPG: tl.constexpr, CAST_BF16: tl.constexpr):
    """Logits [NPG * PK] of positions s0 + [0, NPG * PK) of one generation with context n (int32, s0 a multiple of
    PK); -inf at s >= n. The positions are NPG runs of PK keys, each run inside one page: the table and the bases
    are read once per run, and a run is read whole under one predicate (its rows past n too, inside their page:
    a pool holds whole pages), so a thread's key loads sit at constant offsets from one address."""
    RW: tl.constexpr = (D + 4) // 4                                  # row size in 4-byte words
    s_g = s0 + tl.arange(0, NPG) * PK                                # [NPG] first position of each run
    live_g = s_g < n
    col = s_g // P
    owner = tl.load(owner_row + col, mask=live_g, other=0)
    page = tl.load(page_row + col, mask=live_g, other=0)
    base = tl.load(bases_ptr + owner, mask=live_g, other=q_addr)
    run_w = (base - q_addr) // 4 + (page * P + s_g % P) * RW        # [NPG] words from q to the run's first row
    i = tl.arange(0, PK)
    run_k = q_ptr + run_w * 4                                        # *4: 4-byte aligned rows for the compiler
    k = tl.load(run_k[:, None, None] + (i * (RW * 4))[None, :, None] + tl.arange(0, D)[None, None, :],
                mask=live_g[:, None, None], other=0.0)
    run_s = w_ptr + (run_w + (q_addr - w_addr) // 4 + D // 4)
    scale = tl.load(run_s[:, None] + (i * RW)[None, :], mask=live_g[:, None], other=0.0)
    k = tl.reshape(k, [NPG * PK, D])
    if CAST_BF16:
        k = k.to(tl.bfloat16)
    dots = tl.dot(k, q_t)                                            # [NPG * PK, HP] float32
    val = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1) * tl.reshape(scale, [NPG * PK])
    return tl.where(s0 + tl.arange(0, NPG * PK) < n, val, float("-inf"))


@triton.jit(do_not_specialize=["q_addr", "w_addr"])
def paged_logits_runs_kernel(
    q_ptr, w_ptr, bases_ptr, owner_ptr, page_ptr, slot_ptr, ctx_ptr, out_ptr,
    q_addr, w_addr, L, stride_qb, stride_wb, stride_tab, stride_out,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PK: tl.constexpr, NPG: tl.constexpr,
    SPAN: tl.constexpr, CAST_BF16: tl.constexpr,
):
    """As paged_logits_kernel, its tiles of BLOCK_S = NPG * PK keys read as NPG page runs (_run_tile); ctx, slot,
    q and w are loaded together, before the branch on ctx, so a program waits on three dependent loads (those,
    the table, the bases) before its keys."""
    BLOCK_S: tl.constexpr = NPG * PK
    b = tl.program_id(1)
    s_lo = tl.program_id(0) * (SPAN * BLOCK_S)
    heads = tl.arange(0, HP)
    n = tl.minimum(tl.load(ctx_ptr + b), L).to(tl.int32)
    sl = tl.load(slot_ptr + b)
    q_blk = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * D + tl.arange(0, D)[None, :],
                    mask=(heads < H)[:, None], other=0.0)
    w = tl.load(w_ptr + b.to(tl.int64) * stride_wb + heads, mask=heads < H, other=0.0)
    out_row = out_ptr + b.to(tl.int64) * stride_out
    offs = tl.arange(0, BLOCK_S)
    n_tiles = tl.minimum(tl.maximum(n - s_lo + BLOCK_S - 1, 0) // BLOCK_S, SPAN)
    if n_tiles > 0:
        if CAST_BF16:
            q_blk = q_blk.to(tl.bfloat16)
        q_t = tl.trans(q_blk)
        owner_row = owner_ptr + sl * stride_tab
        page_row = page_ptr + sl * stride_tab
        for t in range(0, n_tiles):
            s0 = s_lo + t * BLOCK_S
            val = _run_tile(q_ptr, w_ptr, owner_row, page_row, bases_ptr, q_addr, w_addr, q_t, w, s0, n,
                            D, P, PK, NPG, CAST_BF16)
            tl.store(out_row + s0 + offs, val, mask=s0 + offs < L)
    for t in range(n_tiles, SPAN):
        s = s_lo + t * BLOCK_S + offs
        tl.store(out_row + s, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=s < L)


def supported(q: torch.Tensor) -> bool:
    """The kernel's domain: fp8 q with contiguous head rows, D a power of two in [16, 256], 4-byte aligned."""
    B, H, D = q.shape
    return (q.dtype == torch.float8_e4m3fn and D in (16, 32, 64, 128, 256) and q.stride(2) == 1
            and q.stride(1) == D and q.data_ptr() % 4 == 0)


def paged_logits_triton(q: torch.Tensor, weights: torch.Tensor, bases: torch.Tensor, owner_tab: torch.Tensor,
                        page_tab: torch.Tensor, slot: torch.Tensor, ctx: torch.Tensor, page_size: int,
                        out: torch.Tensor, *, config: PagedLogitsConfig | None = None) -> torch.Tensor:
    """Fill out [B, L] float32 (module docstring); inputs validated by the caller (cpkv.indexer.paged), every base
    4-byte aligned. No host synchronisation: capturable in a CUDA graph, replayed with other slot / ctx values.
    ``config``: DEFAULT_CONFIG (the runs kernel) when None; KEYS_CONFIG selects the keys kernel as it was."""
    cfg = config or DEFAULT_CONFIG
    if q.shape[0] == 0 or out.shape[1] == 0:
        return out
    launch = _launch_keys if cfg.variant == "keys" else _launch_runs
    launch(cfg, q, weights, bases, owner_tab, page_tab, slot, ctx, page_size, out)
    return out


def _consts(cfg: PagedLogitsConfig, q: torch.Tensor, page_size: int) -> dict:
    """The constexprs and launch options both kernels take."""
    _, H, D = q.shape
    cap = capability(q)
    return dict(H=H, HP=max(16, triton.next_power_of_2(H)), D=D, P=page_size, SPAN=cfg.span,
                CAST_BF16=cap is not None and cap < (8, 9), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))


def _launch_keys(cfg, q, weights, bases, owner_tab, page_tab, slot, ctx, page_size, out) -> None:
    L = out.shape[1]
    paged_logits_kernel[(q.shape[0], triton.cdiv(L, cfg.span * cfg.block_s))](
        q, weights, bases, owner_tab, page_tab, slot, ctx, out, q.data_ptr(), weights.data_ptr(), L, q.stride(0),
        weights.stride(0), owner_tab.stride(0), out.stride(0), BLOCK_S=cfg.block_s, **_consts(cfg, q, page_size))


def _launch_runs(cfg, q, weights, bases, owner_tab, page_tab, slot, ctx, page_size, out) -> None:
    L, run = out.shape[1], min(page_size, cfg.block_s)
    tiles = triton.cdiv(L, cfg.span * cfg.block_s)
    for b in range(0, q.shape[0], MAX_GRID_Y):  # generations on the grid's second axis: at most 65535 a launch
        g = slice(b, b + MAX_GRID_Y)
        qg, wg = q[g], weights[g]
        paged_logits_runs_kernel[(tiles, qg.shape[0])](
            qg, wg, bases, owner_tab, page_tab, slot[g], ctx[g], out[g], qg.data_ptr(), wg.data_ptr(), L,
            q.stride(0), weights.stride(0), owner_tab.stride(0), out.stride(0), PK=run, NPG=cfg.block_s // run,
            **_consts(cfg, q, page_size))
