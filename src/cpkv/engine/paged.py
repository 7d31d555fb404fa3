"""What a decode step reads, and where (docs/design.md §11): the page table of every running generation on the
device, every rank's pool rows as peer memory maps them, and rows wanted across the group read through them.

    DecodeTable  owner / page id of every page of every running generation, int64 [slots, max pages], the same on
                 every rank, written only where a step says it changed
    PagedViews   each rank's pool rows per (layer, kind), made once, and their base addresses for the kernels
    RowMap       rows wanted across the group, (owner, row), with the gather kernel's arguments made once
    paged_rows   those rows read (the page gather kernel, a row as its page; the reference elsewhere)
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cpkv.kernels.paged_rows.ref import paged_rows_ref
from cpkv.scheduler.decode import DecodeStep
from cpkv.upload import upload_arrays


class RowMap:
    """Rows wanted across the group: ``owner`` / ``row`` int64 [n] (row -1: none, read as zeros), with the gather
    kernel's arguments (destination, source, page) made on first use and kept: a step reads its context map on
    every full layer and a selection on every layer until the next full layer, each made once."""

    def __init__(self, owner: torch.Tensor, row: torch.Tensor) -> None:
        self.owner, self.row = owner, row
        self._gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def gather_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._gather is None:
            self._gather = (torch.arange(self.row.shape[0], device=self.row.device),
                            torch.where(self.row >= 0, self.owner, -1), self.row.clamp(min=0))
        return self._gather


def paged_rows(pools: list[torch.Tensor], rows: RowMap, bases: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [n, row_bytes]: row ``row[i]`` of rank ``owner[i]``'s pool (``kernels.paged_rows``); zeros where < 0.

    ``bases`` (int64 [cp] on the device: each pool's byte address, ``PagedViews.bases``): the rows are read in place
    by the page gather kernel (``kernels.page_gather``, a row taken as its page: one launch, each row read once);
    else by the reference (every pool read at every position)."""
    if bases is None:
        return paged_rows_ref(pools, rows.owner, rows.row)
    from cpkv.kernels.page_gather.triton import page_gather_triton

    out = torch.empty((rows.row.shape[0], pools[0].shape[-1]), dtype=torch.uint8, device=rows.row.device)
    page_gather_triton(out, bases, *rows.gather_args(), aligned16=all(p.data_ptr() % 16 == 0 for p in pools))
    return out


class DecodeTable:
    """Every running generation's page table on the device: ``owner`` / ``page`` int64 [slots, max pages] (rows
    grow by doubling as generations start; a slot's row is valid up to its generation's pages), and ``last`` int64
    [slots]: the token each slot's latest step picked greedily, on the device (a step whose input token is still
    pending on the host reads it there: ``engine.decode_graph``)."""

    def __init__(self, max_pages: int, device: torch.device, slots: int = 0) -> None:
        self.max_pages, self.device = max_pages, device
        self.version = 0  # bumped when the rows grow (new tensors: graphs captured over the old ones are stale)
        self.owner = torch.zeros((slots, max_pages), dtype=torch.int64, device=device)
        self.page = torch.zeros((slots, max_pages), dtype=torch.int64, device=device)
        self.last = torch.zeros((slots,), dtype=torch.int64, device=device)

    def apply(self, step: DecodeStep) -> None:
        """Write the step's changed entries (one upload, one scatter; nothing when none changed)."""
        at = [(e.slot, i, o, p) for e in step.entries for i, o, p in e.changes]
        if not at:
            return
        rows = max(a[0] for a in at) + 1
        if rows > self.owner.shape[0]:
            self._grow(rows)
        slot, idx, owner, page = upload_arrays([np.asarray(at, dtype=np.int64)], self.device)[0].unbind(1)
        self.owner[slot, idx] = owner
        self.page[slot, idx] = page

    def _grow(self, rows: int) -> None:
        n = max(rows, 2 * self.owner.shape[0], 8)
        self.version += 1
        for name in ("owner", "page", "last"):
            old = getattr(self, name)
            new = torch.zeros((n,) + tuple(old.shape[1:]), dtype=torch.int64, device=self.device)
            new[: old.shape[0]] = old
            setattr(self, name, new)


class PagedViews:
    """Every rank's pool rows per (layer, kind), as the compose runtime's peer memory maps them (views made once:
    the pools never move). ``own``: this rank's, where its tokens' rows are written."""

    def __init__(self, rt: Any, triton: bool = False) -> None:
        self.rt, self.triton, self.page_size = rt, triton, rt.page_size
        self._views: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._bases: dict[tuple[int, str], torch.Tensor] = {}

    def bases(self, layer: int, kind: str) -> torch.Tensor | None:
        """int64 [cp] on the device: the byte address of each rank's ``rows(layer, kind)`` (made once), for the
        gather kernel; None where the kernels do not run (the reference reads the views)."""
        if not self.triton:
            return None
        got = self._bases.get((layer, kind))
        if got is None:
            views = self.rows(layer, kind)
            got = self._bases[(layer, kind)] = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64,
                                                            device=views[0].device)
        return got

    def read(self, layer: int, kind: str, rows: RowMap) -> torch.Tensor:
        """``paged_rows`` of ``layer``'s ``kind`` rows across the group."""
        return paged_rows(self.rows(layer, kind), rows, self.bases(layer, kind))

    def rows(self, layer: int, kind: str) -> list[torch.Tensor]:
        """Per rank: uint8 [num_pages * page_size, row_bytes] of ``layer``'s ``kind`` rows."""
        got = self._views.get((layer, kind))
        if got is None:
            pool = self.rt.pool
            slot, shape = pool.slot(layer, kind), (pool.num_pages * pool.page_size, pool.row_bytes(kind))
            got = self._views[(layer, kind)] = [p[slot].view(shape) for p in self.rt.pools[kind]]
            if len(got) != self.rt.cp:
                raise ValueError(f"paged decode reads every rank's pool: peer memory maps {len(got)} of {self.rt.cp}")
        return got

    def own(self, layer: int, kind: str) -> torch.Tensor:
        return self.rt.pool.rows(layer, kind)
