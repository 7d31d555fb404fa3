"""Single-process reference of a dense buffer, built straight from the layout and every rank's pools.

    pools[r]  : uint8 [num_pages, page_size * row_bytes]    rank r's pool pages of one (layer, kind)
    current   : uint8 [num_current, page_size * row_bytes]  every current page of the batch, compact order,
                                                            zeros past a partial page's end
    returns   : uint8 [num_slots * page_size, row_bytes]    slot s = logical page s (whole pages)

Slot s holds ``pools[owner][page_id]`` for a prefix page and ``current[compact]`` for a current page.
Every compose mode must reproduce this byte for byte.
"""
from __future__ import annotations

from typing import Sequence

import torch

from cpkv.errors import ComposeError
from cpkv.layout import BatchLayout


def reference_dense(layout: BatchLayout, pools: Sequence[torch.Tensor], current: torch.Tensor) -> torch.Tensor:
    """The dense buffer every rank must compose (see module docstring)."""
    if len(pools) != layout.cp:
        raise ComposeError(f"reference needs one pool per rank ({layout.cp}), got {len(pools)}")
    page_bytes = current.shape[-1] if current.numel() else pools[0].shape[-1]
    if current.shape[0] != layout.num_current:
        raise ComposeError(f"reference needs {layout.num_current} current pages, got {current.shape[0]}")
    out = torch.empty((layout.num_slots, page_bytes), dtype=torch.uint8)
    for p in layout.logical_pages:
        out[p.slot] = current[p.compact] if p.kind == "current" else pools[p.rank][p.page_id]
    return out.view(layout.num_slots * layout.page_size, page_bytes // layout.page_size)


def current_pages(layout: BatchLayout, rows: torch.Tensor) -> torch.Tensor:
    """Pad the batch's current rows into whole pages.

    rows: uint8 [extend_tokens, row_bytes], the new tokens of every request in batch order
    returns uint8 [num_current, page_size * row_bytes], zeros past each partial page's end
    """
    P, rb = layout.page_size, rows.shape[-1]
    out = torch.zeros((layout.num_current, P, rb), dtype=torch.uint8)
    t = 0
    for c in layout.current_pages:
        n = c.end - c.start
        out[c.compact, :n] = rows[t: t + n]
        t += n
    if t != rows.shape[0]:
        raise ComposeError(f"expected {t} current rows (the batch's new tokens), got {rows.shape[0]}")
    return out.view(layout.num_current, P * rb)
