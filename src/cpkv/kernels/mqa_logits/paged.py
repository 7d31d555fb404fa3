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

Graph-capturable: the grid is (B, cdiv(L, SPAN * BLOCK_S)) and nothing reads ctx on the host, so one capture
replays with any ctx. Program (b, j) owns positions [j * SPAN * BLOCK_S, (j + 1) * SPAN * BLOCK_S): its tiles
that start before ctx[b] are computed (one [BLOCK_S, D] x [D, H] dot each, relu, weights, head sum, scale), the
rest written -inf. A tile maps to pages (BLOCK_S and P powers of two, either larger): each key's page-table
entry is loaded per key, so a tile may span pages or lie inside one. Addresses are taken relative to the q
(fp8 values) and w (scales) arguments, as page_gather's are relative to its output, so the kernel also runs
under TRITON_INTERPRET on CPU tensors; rows are 4-byte aligned (D + 4 bytes), so keys load as 4-byte vectors.

Triton is imported here: import this module only where the backends run Triton (cpkv.indexer.paged does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpkv.kernels.mqa_logits.config import PagedLogitsConfig
from cpkv.kernels.platform import capability


DEFAULT_CONFIG = PagedLogitsConfig()


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


def supported(q: torch.Tensor) -> bool:
    """The kernel's domain: fp8 q with contiguous head rows, D a power of two in [16, 256], 4-byte aligned."""
    B, H, D = q.shape
    return (q.dtype == torch.float8_e4m3fn and D in (16, 32, 64, 128, 256) and q.stride(2) == 1
            and q.stride(1) == D and q.data_ptr() % 4 == 0)


def paged_logits_triton(q: torch.Tensor, weights: torch.Tensor, bases: torch.Tensor, owner_tab: torch.Tensor,
                        page_tab: torch.Tensor, slot: torch.Tensor, ctx: torch.Tensor, page_size: int,
                        out: torch.Tensor, *, config: PagedLogitsConfig | None = None) -> torch.Tensor:
    """Fill out [B, L] float32 (module docstring); inputs validated by the caller (cpkv.indexer.paged), every base
    4-byte aligned. No host synchronisation: capturable in a CUDA graph, replayed with other slot / ctx values."""
    cfg = config or DEFAULT_CONFIG
    B, H, D = q.shape
    L = out.shape[1]
    if B == 0 or L == 0:
        return out
    grid = (B, triton.cdiv(L, cfg.span * cfg.block_s))
    cap = capability(q)
    paged_logits_kernel[grid](
        q, weights, bases, owner_tab, page_tab, slot, ctx, out,
        q.data_ptr(), weights.data_ptr(), L, q.stride(0), weights.stride(0), owner_tab.stride(0), out.stride(0),
        H=H, HP=max(16, triton.next_power_of_2(H)), D=D, P=page_size, BLOCK_S=cfg.block_s, SPAN=cfg.span,
        CAST_BF16=cap is not None and cap < (8, 9), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
