"""Top-k of the lightning indexer, pure torch (docs/design.md §5). The contract shared with the kernel:

    row i, valid keys j in [ks[i], ke[i]), n = ke[i] - ks[i] (0 when negative)
    n <= k : out[i] = [0, 1, ..., n-1, -1, ..., -1]         (all keys, whatever their logits)
    n >  k : out[i] = the k relative indices j - ks[i] of the k largest logits, equal logits broken
             toward the lower index, listed in ascending index order (so the result is unique)
"""
from __future__ import annotations

import torch


def topk_ref(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, k: int = 2048) -> torch.Tensor:
    """logits: [T, N] float32, ks/ke: [T] int32 columns of each row's valid range -> int32 [T, k]
    relative indices (see the module docstring: ties toward the lower index, ascending order, -1 pad)."""
    T = logits.shape[0]
    n = (ke.long() - ks.long()).clamp(min=0)
    width = int(n.max()) if T else 0
    rel = torch.arange(max(width, 1), device=logits.device)
    valid = rel[None, :] < n[:, None]
    cols = (ks.long()[:, None] + rel[None, :]).clamp(0, max(logits.shape[1] - 1, 0))
    vals = logits.gather(1, cols) if logits.shape[1] else torch.zeros_like(cols, dtype=logits.dtype)
    vals = vals.float().masked_fill(~valid, float("-inf")) + 0.0  # +0.0 folds -0.0 into +0.0
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices[:, :k]
    picked = torch.sort(order, dim=1).values.to(torch.int32)
    short = torch.where(valid[:, :k], rel[None, :k], -1).to(torch.int32)
    out = torch.full((T, k), -1, dtype=torch.int32, device=logits.device)
    m = min(k, picked.shape[1])
    out[:, :m] = torch.where((n > k)[:, None], picked[:, :m], short[:, :m])
    return out


def short_rows_topk(n: torch.Tensor, k: int) -> torch.Tensor:
    """n: [T] int valid-key counts, each <= k -> int32 [T, k]: [0, ..., n-1, -1, ...] per row."""
    rel = torch.arange(k, device=n.device, dtype=torch.int32)
    return torch.where(rel[None, :] < n[:, None], rel[None, :], -1).to(torch.int32)


def merge_topk_ref(positions: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:
    """Candidates of R parts of each row's keys -> the row's top-k under the contract above (docs/design.md §11, the
    split decode: each rank picks the top-k of the keys it holds, the owner merges them).

    positions: int [R, T, k] each part's picked key positions (-1: none), logits: float [R, T, k] their logits ->
    int32 [T, k]: the k positions of the largest logits over the union, equal logits toward the lower position,
    ascending, -1 padding (all valid positions, ascending, when the union holds no more than k). Equal to
    ``topk_ref`` over the whole row when each part's candidates are its own top-k under the same contract: the
    row's top-k lies in the union."""
    r, t, w = positions.shape
    pos = positions.permute(1, 0, 2).reshape(t, r * w).long()
    val = logits.permute(1, 0, 2).reshape(t, r * w).float() + 0.0  # +0.0 folds -0.0 into +0.0
    valid = pos >= 0
    val = val.masked_fill(~valid, float("-inf"))
    big = torch.iinfo(torch.int64).max
    order = torch.sort(torch.where(valid, pos, big), dim=1, stable=True).indices  # by position first ...
    pos, val, valid = pos.gather(1, order), val.gather(1, order), valid.gather(1, order)
    best = torch.sort(val, dim=1, descending=True, stable=True).indices[:, :k]  # ... then by logit, ties kept
    picked = torch.where(valid.gather(1, best), pos.gather(1, best), big)
    picked = torch.sort(picked, dim=1).values
    out = torch.full((t, k), -1, dtype=torch.int32, device=positions.device)
    m = min(k, picked.shape[1])
    out[:, :m] = torch.where(picked[:, :m] == big, -1, picked[:, :m]).to(torch.int32)
    return out
