"""ComposePlan: every layer-invariant compose descriptor of one batch on one rank, built once.

A plan is built from a ``BatchLayout`` (numpy/python), its index tensors are moved to the device once,
and it is cached in ``layout.memo["compose"]``: never looked up by tensor address. Every layer and both
kinds reuse it. Per slot of the dense buffer::

    slot s  : prefix page  -> source = owner o       (pool of rank o),    page = pool page id
              current page -> source = cp + writer w (staging of rank w), page = its staging page

Staging pages: writer w's j-th own current page (compact order restricted to w) is staging page j + 1
(page 0 is reserved), so a rank's current rows form one contiguous block ``[P, (1 + n_own) * P)`` of
its staging half; ``query_rows[t]`` is the row of that block holding this rank's t-th query token (its
query tokens in ``layout.rank_query_ranges[rank]`` order), ``tail_rows`` the rows past a partial page's
end (zeroed before the writer writes).

Gather entry sets (``Entries``: dest page, source index, source page; -1 source = zero fill):

    all       every slot, global table (2·cp sources)        symm
    prefix    prefix slots from pools, current slots -1      v2, prefetch (ahead of time)
    current   current slots from stagings                    prefetch (after the barrier)
    own       every slot: own prefix pages from the local pool (source 0), own current pages from the
              local staging (source 1), others -1              fused (legacy: one set per request span)
    compact   compact current pages: own from local staging (source 1), others -1      v2
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from cpkv.compose.staging import align
from cpkv.config import KINDS
from cpkv.errors import ComposeError
from cpkv.layout import BatchLayout

MEMO_KEY = "compose"


class Packer:
    """Collects int64 index arrays and moves them to the device in one copy (views come back)."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    def add(self, a: np.ndarray) -> int:
        self.arrays.append(np.ascontiguousarray(a, dtype=np.int64))
        return len(self.arrays) - 1

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        sizes = [a.size for a in self.arrays]
        flat = np.concatenate(self.arrays) if self.arrays else np.zeros(0, np.int64)
        return list(torch.from_numpy(flat).to(device).split(sizes))


class Entries:
    """One gather's descriptors: dest page, source index (-1 = zero fill), source page; int64 [n] on the
    device, uploaded with the rest of the plan in one copy. ``groups()`` splits them per source for the
    torch path (built on first use)."""

    def __init__(self, dest: np.ndarray, src: np.ndarray, page: np.ndarray, pack: Packer) -> None:
        self.np = (dest, src, page)
        self.n = int(dest.size)
        self._ids = [pack.add(a) for a in self.np]
        self.dest = self.src = self.page = torch.empty(0, dtype=torch.int64)
        self._groups: tuple[list, torch.Tensor] | None = None

    def bind(self, views: list[torch.Tensor]) -> None:
        self.dest, self.src, self.page = (views[i] for i in self._ids)

    def slice(self, start: int, end: int) -> Entries:
        """Entries [start, end) as views (dest pages unchanged)."""
        out = Entries.__new__(Entries)
        out.np = tuple(a[start:end] for a in self.np)
        out.n, out._ids, out._groups = end - start, [], None
        out.dest, out.src, out.page = self.dest[start:end], self.src[start:end], self.page[start:end]
        return out

    def groups(self) -> tuple[list[tuple[int, torch.Tensor, torch.Tensor]], torch.Tensor]:
        """([(source, dest int64, page int64)], dest int64 of the -1 entries) on the entries' device."""
        if self._groups is None:
            dest, src, page = self.np
            dev = self.dest.device
            per = [(int(s), torch.from_numpy(dest[src == s]).to(dev), torch.from_numpy(page[src == s]).to(dev))
                   for s in np.unique(src) if s >= 0]
            self._groups = (per, torch.from_numpy(dest[src < 0]).to(dev))
        return self._groups


@dataclass
class Span:
    """A request's slots [start, end) and the ``own`` entries of those slots (legacy mode; dest is the slot)."""

    start: int
    end: int
    own: Entries


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of [starts[i], starts[i] + lengths[i]) for every i (int64)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return first + np.arange(total, dtype=np.int64)


class ComposePlan:
    """Compose descriptors of one batch for one rank (see module docstring)."""

    def __init__(self, layout: BatchLayout, rank: int, capacity: int, page_bytes: dict[str, int],
                 device: torch.device, current_page_ids: Sequence[int] | None) -> None:
        self._layout = weakref.ref(layout)
        self.rank, self.cp, self.page_size = rank, layout.cp, layout.page_size
        self.capacity, self.device = capacity, device
        self.num_slots, self.num_current = layout.num_slots, layout.num_current
        self.num_requests = len(layout.requests)
        self.signature = (layout.cp, layout.page_size, capacity, tuple(page_bytes.items()))
        self.views: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # runtime's arena views
        pack = Packer()
        self._arrays(layout)
        self._entries(pack)
        self._rows(layout, pack)
        self._persist(current_page_ids, pack)
        self._upload(pack, layout)
        self._arena(page_bytes)

    # numpy descriptors ----------------------------------------------------------------------------

    def _arrays(self, layout: BatchLayout) -> None:
        lp = layout.logical_pages
        self.slot_rank = np.fromiter((p.rank for p in lp), np.int64, len(lp))
        self.slot_page = np.fromiter((p.page_id for p in lp), np.int64, len(lp))  # -1: current page
        self.is_current = self.slot_page < 0
        self.current_slots = np.flatnonzero(self.is_current)  # slot of compact page i (merged-span order)
        assert self.current_slots.size == self.num_current
        writers = self.slot_rank[self.current_slots]
        local = np.zeros(self.num_current, np.int64)  # j: index among its writer's pages
        for w in range(self.cp):
            mine = writers == w
            local[mine] = np.arange(int(mine.sum()))
        self.staging_page = local + 1  # by compact index
        self.own_compact = np.asarray(layout.rank_current[self.rank], np.int64)
        self.num_own = int(self.own_compact.size)
        self.current_tokens = np.fromiter((c.end - c.start for c in layout.current_pages), np.int64,
                                          self.num_current)

    def _entries(self, pack: Packer) -> None:
        S, cp = self.num_slots, self.cp
        slots = np.arange(S, dtype=np.int64)
        cur = self.is_current
        stage = np.zeros(S, np.int64)
        stage[self.current_slots] = self.staging_page
        src_all = np.where(cur, cp + self.slot_rank, self.slot_rank)
        page_all = np.where(cur, stage, self.slot_page)
        self.all = Entries(slots, src_all, page_all, pack)
        self.prefix = Entries(slots, np.where(cur, -1, self.slot_rank), np.where(cur, 0, self.slot_page), pack)
        cs = self.current_slots
        self.current = Entries(cs, src_all[cs], page_all[cs], pack)
        mine = self.slot_rank == self.rank
        self.own = Entries(slots, np.where(mine, np.where(cur, 1, 0), -1), np.where(mine, page_all, 0), pack)
        ncur = np.arange(self.num_current, dtype=np.int64)
        own_c = np.zeros(self.num_current, bool)
        own_c[self.own_compact] = True
        self.compact = Entries(ncur, np.where(own_c, 1, -1), np.where(own_c, self.staging_page, 0), pack)
        self._cs_id = pack.add(cs)

    def _rows(self, layout: BatchLayout, pack: Packer) -> None:
        """query rows j * P + [0, n_j) and tail rows j * P + [n_j, P) of the rank's own pages j."""
        P = self.page_size
        counts = self.current_tokens[self.own_compact]
        starts = np.arange(self.num_own, dtype=np.int64) * P
        self._q_id = pack.add(_ranges(starts, counts))
        self._t_id = pack.add(_ranges(starts + counts, P - counts))
        self.num_query_tokens = int(counts.sum())
        assert self.num_query_tokens == layout.query_tokens(self.rank)

    def _persist(self, current_page_ids: Sequence[int] | None, pack: Packer) -> None:
        self.current_page_ids = None if current_page_ids is None else np.asarray(current_page_ids, np.int64)
        self._pp_id = None
        if self.current_page_ids is None:
            return
        if self.current_page_ids.shape != (self.num_current,):
            raise ComposeError(f"current_page_ids: expected one writer-side page id per current page "
                               f"({self.num_current}, compact order), got shape {list(self.current_page_ids.shape)}")
        mine = self.current_page_ids[self.own_compact]
        if mine.size and (mine.min() < 1 or np.unique(mine).size != mine.size):
            raise ComposeError(f"rank {self.rank}: current page ids must be distinct pool pages >= 1 (page 0 is "
                               f"reserved), got {mine.tolist()}")
        self.max_own_pool_page = int(mine.max()) if mine.size else 0
        self._pp_id = pack.add(mine)

    def _upload(self, pack: Packer, layout: BatchLayout) -> None:
        """One host-to-device copy of every index array, then views."""
        views = pack.upload(self.device)
        for e in (self.all, self.prefix, self.current, self.own, self.compact):
            e.bind(views)
        self.current_slots_t = views[self._cs_id]
        self.query_rows, self.tail_rows = views[self._q_id], views[self._t_id]
        self.own_pool_pages: torch.Tensor | None = None if self._pp_id is None else views[self._pp_id]
        self.spans = [Span(r.slot_start, r.slot_end, self.own.slice(r.slot_start, r.slot_end))
                      for r in layout.requests]

    def _arena(self, page_bytes: dict[str, int]) -> None:
        """Deterministic offsets inside an arena half: per kind the dense buffer, then v2's compact scratch."""
        off = 0
        self.dense_offset: dict[str, int] = {}
        self.compact_offset: dict[str, int] = {}
        for k in KINDS:
            self.dense_offset[k] = off
            off += align(self.num_slots * page_bytes[k])
            self.compact_offset[k] = off
            off += align(max(self.num_current, 1) * page_bytes[k])
        self.arena_bytes = off

    # checks ---------------------------------------------------------------------------------------

    def check(self, layout: BatchLayout, rank: int, signature: tuple) -> None:
        """Raise ComposeError unless this plan was built for ``layout`` on ``rank`` with this runtime's setup."""
        if self._layout() is not layout:
            raise ComposeError(f"compose plan was built for another batch ({self.num_slots} slots, "
                               f"{self.num_requests} requests); got a batch of {layout.num_slots} slots, "
                               f"{len(layout.requests)} requests: build a plan per batch")
        if rank != self.rank or signature != self.signature:
            raise ComposeError(f"compose plan was built for rank {self.rank} with (cp, page_size, staging, "
                               f"page_bytes) = {self.signature}; this runtime is rank {rank} with {signature}")

    @property
    def persists(self) -> bool:
        return self.own_pool_pages is not None
