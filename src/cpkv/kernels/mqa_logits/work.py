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


_ITEMS_PER_SPAN_LOOP = 1024  # items per span from which _by_span beats _by_sort (numpy 2.4: between 512 and 1024)


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
    ks_a, ke_a = np.asarray(ks, dtype=np.int64).reshape(-1), np.asarray(ke, dtype=np.int64).reshape(-1)
    n = ks_a.size
    big = n_cols + tile * span
    groups = -(-n // r)
    # rows clipped to the block, empty ones neutral, padded to whole groups: written in place (no temporaries)
    glo = np.full(groups * r, big, np.int64)
    ghi = np.full(groups * r, -1, np.int64)
    lo, hi = glo[:n], ghi[:n]
    np.subtract(ks_a, key_start, out=lo)
    np.subtract(ke_a, key_start, out=hi)
    np.maximum(lo, 0, out=lo)
    np.minimum(hi, n_cols, out=hi)
    empty = hi <= lo
    lo[empty], hi[empty] = big, -1
    glo, ghi = _group_reduce(glo, groups, r, np.minimum), _group_reduce(ghi, groups, r, np.maximum)
    t_lo, t_hi = glo // tile, (ghi + tile - 1) // tile
    live = ghi > glo
    s_lo = np.where(live, t_lo // span, 0)
    s_last = np.where(live, (t_hi - 1) // span, -1)  # a group with no keys covers no span
    if not live.any():
        return torch.zeros(0, 4, dtype=torch.int32)
    # one item per (span, group that touches it), span-major, groups ascending within a span
    t_lo32, t_hi32 = t_lo.astype(np.int32), t_hi.astype(np.int32)
    first, last = int(s_lo[live].min()), int(s_last.max())
    count = s_last - s_lo + 1  # 0 for a group with no keys
    if int(count.sum()) >= _ITEMS_PER_SPAN_LOOP * (last - first + 1):
        parts_g, parts_a, parts_n = _by_span(s_lo, s_last, t_lo32, t_hi32, span, first, last)
    else:
        parts_g, parts_a, parts_n = _by_sort(count, s_lo, t_lo32, t_hi32, span)
    start = _tail_start(parts_n, shape)
    g, a, n = np.concatenate(parts_g), np.concatenate(parts_a), np.concatenate(parts_n)
    # the items within the last slots x span tiles, cut into pieces of span // split tiles
    piece = max(span // shape.split, 1)
    tg, ta, tn = g[start:], a[start:], n[start:]
    cuts = (tn + piece - 1) // piece
    idx = np.repeat(np.arange(tn.size, dtype=np.int64), cuts)
    k = np.arange(idx.size, dtype=np.int32) - np.repeat((np.cumsum(cuts) - cuts).astype(np.int32), cuts)
    a2 = ta[idx] + k * piece
    out = np.empty((start + idx.size, 4), np.int32)
    head, tail = out[:start], out[start:]
    head[:, 0], head[:, 1], head[:, 2] = g[:start] * r, a[:start] * tile, n[:start]
    tail[:, 0], tail[:, 1], tail[:, 2] = tg[idx] * r, a2 * tile, np.minimum(piece, ta[idx] + tn[idx] - a2)
    out[:, 3] = 0
    return torch.from_numpy(out)


def _by_span(s_lo: np.ndarray, s_last: np.ndarray, t_lo: np.ndarray, t_hi: np.ndarray, span: int, first: int,
             last: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The items span by span, each span's groups found by a pass over the groups: no sort of the items (a batch's
    few spans of thousands of groups each). Per span: (groups, first tiles, tile counts)."""
    parts_g, parts_a, parts_n = [], [], []
    for sp in range(first, last + 1):
        gs = np.flatnonzero((s_lo <= sp) & (s_last >= sp)).astype(np.int32)
        a = np.maximum(t_lo[gs], sp * span)
        parts_g.append(gs)
        parts_a.append(a)
        parts_n.append(np.minimum(t_hi[gs], (sp + 1) * span) - a)
    return parts_g, parts_a, parts_n


def _by_sort(count: np.ndarray, s_lo: np.ndarray, t_lo: np.ndarray, t_hi: np.ndarray, span: int
             ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The items group after group, then a stable sort on the span (few items over many spans, where a pass over
    the groups per span would cost more than the sort). As one part."""
    g = np.repeat(np.arange(count.size, dtype=np.int32), count)
    s = np.arange(g.size, dtype=np.int32) - np.repeat((np.cumsum(count) - count - s_lo).astype(np.int32), count)
    # g is already ascending, so a stable sort on the span alone gives span-major order (a radix sort on 16 bits)
    order = np.argsort(s.astype(np.uint16) if s.size and s.max() < 1 << 16 else s, kind="stable")
    g, s = g[order], s[order]
    a = np.maximum(s * span, t_lo[g])
    return [g], [a], [np.minimum((s + 1) * span, t_hi[g]) - a]


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


def _tail_start(parts_n: list[np.ndarray], shape: WorkShape) -> int:
    """Index of the first item (of the spans' items in order) whose suffix, the tiles from it to the end, is within
    slots x span: the tail the last wave drains. Found span by span from the end (a sum per span, prefix sums only
    in the span where the tail starts); no tail when pieces would not be shorter than items."""
    total = sum(x.size for x in parts_n)
    if max(shape.span // shape.split, 1) >= shape.span:
        return total
    limit, acc, off = shape.slots * shape.span, 0, total
    for p in range(len(parts_n) - 1, -1, -1):
        off -= parts_n[p].size
        tiles = int(parts_n[p].sum())
        if acc + tiles <= limit:
            acc += tiles
            continue
        # item i of this span: suffix = acc + tiles - (tiles before i) <= limit  <=>  tiles before i >= tiles - limit + acc
        prefix = np.cumsum(parts_n[p])
        return off + int(np.searchsorted(prefix - parts_n[p], tiles - limit + acc))
    return 0
