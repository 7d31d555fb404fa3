"""Work items of the logits kernel for one chunk (docs/design.md §5): which programs to launch and in which order.
Built on the host from the plan's host bounds, once per batch and kernel shape, and reused by every layer.

A program computes the logits of one token group (``rows`` consecutive query rows of the chunk) against up
to ``span`` key tiles of ``tile`` columns. The plain grid launches every (span, token group) pair of the
chunk's logits block, empty or not; in a ragged batch most pairs are empty (four requests of a warm batch:
three quarters of the grid). The item list holds only the non-empty ones:

    item = (first row, first column, tiles, 0)      rows [first row, + rows), columns [first column, + tiles x tile)

- Spans sit on one grid of ``span`` tiles from column 0, as in the plain grid, so token groups that see the
  same keys get items over the same columns.
- Items run span by span (all groups of span 0, then span 1, ...): the programs in flight together read a
  few key spans, which stay in L2, instead of every span of a few groups (the keys of a long row do not fit
  in L2 beside the logits being written). A program's own query block is the small re-read.
- The last ``slots x span`` tiles, about the last wave of programs, are cut into items of ``span // split``
  tiles, so the device drains on short programs instead of waiting on a few long ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class WorkShape:
    """rows: query rows per program; tile: key columns per tile; span: tiles per full item; slots:
    programs the device runs at once; split: the last wave's items are cut into span // split tiles."""

    rows: int
    tile: int
    span: int
    slots: int
    split: int = 4

    def __post_init__(self) -> None:
        for name in ("rows", "tile", "span", "slots", "split"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkShape.{name} must be >= 1, got {getattr(self, name)}")


def logits_work_items(ks: Sequence[int], ke: Sequence[int], key_start: int, n_cols: int,
                      shape: WorkShape) -> torch.Tensor:
    """ks, ke: absolute key bounds of the chunk's rows (host); columns are keys key_start ... key_start +
    n_cols - 1. -> int32 [n, 4] items on the CPU in launch order (module docstring). Row i's columns
    [ks - key_start, ke - key_start) clipped to the block are covered by the items of its group.
    Numpy on whole arrays: a batch's plan builds them before its first kernel (IndexerPlan.prepare_items)."""
    if len(ks) != len(ke):
        raise ValueError(f"ks and ke must have the same length, got {len(ks)} and {len(ke)}")
    if not len(ks) or n_cols <= 0:
        return torch.zeros(0, 4, dtype=torch.int32)
    r, tile, span = shape.rows, shape.tile, shape.span
    n = len(ks)
    big = n_cols + tile * span
    groups = -(-n // r)
    # rows clipped to the block, empty ones neutral, padded to whole groups: written in place (no temporaries)
    glo = np.full(groups * r, big, np.int64)
    ghi = np.full(groups * r, -1, np.int64)
    lo, hi = glo[:n], ghi[:n]
    np.subtract(np.asarray(ks, dtype=np.int64).reshape(-1), key_start, out=lo)
    np.subtract(np.asarray(ke, dtype=np.int64).reshape(-1), key_start, out=hi)
    np.maximum(lo, 0, out=lo)
    np.minimum(hi, n_cols, out=hi)
    empty = hi <= lo
    lo[empty], hi[empty] = big, -1
    glo, ghi = _group_reduce(glo, groups, r, np.minimum), _group_reduce(ghi, groups, r, np.maximum)
    t_lo, t_hi = glo // tile, (ghi + tile - 1) // tile
    s_lo = t_lo // span
    count = np.where(ghi > glo, (t_hi - 1) // span + 1 - s_lo, 0)
    # one item per (group, span it touches), group after group; int32 from here (tiles and rows < 2^31)
    g = np.repeat(np.arange(groups, dtype=np.int32), count)
    s = np.arange(g.size, dtype=np.int32) - np.repeat((np.cumsum(count) - count - s_lo).astype(np.int32), count)
    a = np.maximum(s * span, np.repeat(t_lo.astype(np.int32), count))
    b = np.minimum((s + 1) * span, np.repeat(t_hi.astype(np.int32), count))
    # span-major order, groups ascending within a span: g is already ascending, so a stable sort on the span
    # alone gives it (a radix sort when the span index fits 16 bits)
    order = np.argsort(s.astype(np.uint16) if s.size and s.max() < 1 << 16 else s, kind="stable")
    g, a, n = g[order], a[order], (b - a)[order]
    g, a, n = _split_tail(g, a, n, shape)
    out = np.empty((g.size, 4), np.int32)
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = g * r, a * tile, n, 0
    return torch.from_numpy(out)


def _group_reduce(v: np.ndarray, groups: int, r: int, op: np.ufunc) -> np.ndarray:
    """``op`` over each group of ``r`` consecutive values: column by column for the small ``r`` of the kernels
    (numpy's reduction along a short last axis is several times slower)."""
    m = v.reshape(groups, r)
    if r > 16:
        return op.reduce(m, axis=1)
    out = m[:, 0].copy()
    for j in range(1, r):
        op(out, m[:, j], out=out)
    return out


def _split_tail(g: np.ndarray, a: np.ndarray, n: np.ndarray, shape: WorkShape):
    """Cut the items that lie entirely within the last slots x span tiles into pieces of span // split (only
    that tail is rebuilt: the items before it stay as they are)."""
    piece = max(shape.span // shape.split, 1)
    if piece >= shape.span or not n.size:
        return g, a, n
    suffix = np.cumsum(n[::-1])[::-1]  # non-increasing: the cut items are a tail
    start = int(np.searchsorted(-suffix, -shape.slots * shape.span))  # first item with suffix <= slots x span
    tg, ta, tn = g[start:], a[start:], n[start:]
    parts = (tn + piece - 1) // piece
    idx = np.repeat(np.arange(tn.size, dtype=np.int64), parts)
    k = np.arange(idx.size, dtype=tn.dtype) - np.repeat((np.cumsum(parts) - parts).astype(tn.dtype), parts)
    a2 = ta[idx] + k * piece
    n2 = np.minimum(piece, ta[idx] + tn[idx] - a2)
    return (np.concatenate((g[:start], tg[idx])), np.concatenate((a[:start], a2)),
            np.concatenate((n[:start], n2)))
