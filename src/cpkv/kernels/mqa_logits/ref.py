"""MQA logits of the lightning indexer, pure torch (docs/design.md §5): they run on any device and define the
edge cases the kernels must match.

    logits[i, j] = k_scale[j] * sum_h weights[i, h] * relu(q[i, h, :] . k[j, :])   for ks[i] <= j < ke[i]
                 = -inf                                                           elsewhere

``paged_mqa_logits_ref`` is the decode form (docs/design.md §11): one query row per generation, its keys the
132-byte index rows of its context read where they lie through a page table, each generation's row of logits
defined by ``mqa_logits_ref`` over those keys with ks = 0, ke = its context.
"""
from __future__ import annotations

from typing import Sequence

import torch

from cpkv.kernels.paged_rows.ref import paged_rows_ref

REF_BLOCK_BYTES = 1 << 27  # bounds the reference's float64 [rows, H, keys] temporary


def mqa_logits_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    clean: bool = True,
    dtype: torch.dtype = torch.float32,
    col_offset: int = 0,
    num_cols: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D] fp8/bf16/float, k: [S, D] fp8/bf16/float, k_scale: [S] float32, weights: [T, H]
    float32, ks/ke: [T] int32 -> logits [T, num_cols] in ``dtype`` (float32 by default; float64 for tests).

    Column c holds key ``col_offset + c`` (default: all S keys). ``clean=False`` leaves positions outside
    [ks, ke) unspecified (here: their unmasked values)."""
    num_cols = k.shape[0] - col_offset if num_cols is None else num_cols
    kf = k[col_offset:col_offset + num_cols].double()
    scale = k_scale[col_offset:col_offset + num_cols].to(dtype)
    out = torch.empty(q.shape[0], num_cols, dtype=dtype, device=q.device)
    step = max(1, REF_BLOCK_BYTES // max(1, 8 * q.shape[1] * num_cols))
    for r0 in range(0, q.shape[0], step):
        out[r0:r0 + step] = _head_sum(q[r0:r0 + step], kf, weights[r0:r0 + step], dtype) * scale[None, :]
    if clean:
        out.masked_fill_(~_valid_mask(ks, ke, col_offset, num_cols), float("-inf"))
    return out


def _head_sum(q: torch.Tensor, kf: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [t, H, D], kf float64 [s, D], weights [t, H] -> [t, s] in dtype: sum_h w * relu(q_h . k).

    The dots run in float64 (exact for fp8 inputs) and the head sum is a fixed sequence of
    elementwise ops, so an entry does not depend on which other rows or keys are computed with it."""
    dots = torch.einsum("thd,sd->ths", q.double(), kf).to(dtype).relu_()
    w = weights.to(dtype)
    acc = dots[:, 0] * w[:, 0:1]
    for h in range(1, q.shape[1]):
        acc += dots[:, h] * w[:, h:h + 1]
    return acc


def _valid_mask(ks: torch.Tensor, ke: torch.Tensor, col_offset: int, num_cols: int) -> torch.Tensor:
    """[T, num_cols] bool: key col_offset + c is inside [ks[i], ke[i])."""
    j = torch.arange(num_cols, device=ks.device, dtype=torch.int64)[None, :] + col_offset
    return (j >= ks.long()[:, None]) & (j < ke.long()[:, None])


def paged_mqa_logits_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    pools: Sequence[torch.Tensor],
    owner_tab: torch.Tensor,
    page_tab: torch.Tensor,
    slot: torch.Tensor,
    ctx: torch.Tensor,
    page_size: int,
    num_cols: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q: fp8 e4m3 [B, H, D], weights: float32 [B, H], pools: per rank uint8 [pages * page_size, D + 4] (D fp8
    values then one float32 scale per row), owner_tab / page_tab: int64 [slots, max_pages], slot / ctx: int64 [B]
    -> logits [B, num_cols] in ``dtype``.

    Generation b's key s (s < ctx[b]) is row ``page_tab[slot[b], s // P] * P + s % P`` of pool
    ``owner_tab[slot[b], s // P]``; out[b] = mqa_logits_ref(q[b:b+1], keys, scales, weights[b:b+1], ks=0,
    ke=ctx[b]): -inf at s >= ctx[b] (all of a row whose ctx is 0). No host synchronisation: every position's row
    is read (zeros past ctx), so the reference reads B * num_cols rows from each pool (a test oracle)."""
    B, _, D = q.shape
    pos = torch.arange(num_cols, dtype=torch.int64, device=q.device)
    live = pos[None, :] < ctx[:, None]                                    # [B, num_cols]
    col = (pos // page_size).clamp(max=owner_tab.shape[1] - 1)[None, :].expand(B, -1)
    owner = torch.where(live, owner_tab[slot[:, None], col], 0)
    row = torch.where(live, page_tab[slot[:, None], col] * page_size + pos % page_size, -1)
    rows = paged_rows_ref(pools, owner.reshape(-1), row.reshape(-1))      # [B * num_cols, D + 4]
    k, k_scale = rows[:, :D].view(torch.float8_e4m3fn), rows[:, D:].view(torch.float32)[:, 0]
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    out = torch.empty(B, num_cols, dtype=dtype, device=q.device)
    for b in range(B):
        keys = slice(b * num_cols, (b + 1) * num_cols)
        out[b] = mqa_logits_ref(q[b:b + 1], k[keys], k_scale[keys], weights[b:b + 1], zero,
                                ctx[b:b + 1].to(torch.int32), dtype=dtype)[0]
    return out
