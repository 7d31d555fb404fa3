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


@dataclass
class Entries:
    """One gather's descriptors on the device. ``groups``: per source (index, dest int64, page int64) and
    ``zero`` (dest int64 of -1 entries), for the torch path."""

    dest: torch.Tensor
    src: torch.Tensor
    page: torch.Tensor
    groups: list[tuple[int, torch.Tensor, torch.Tensor]]
    zero: torch.Tensor
    n: int

    @classmethod
    def build(cls, dest: np.ndarray, src: np.ndarray, page: np.ndarray, device: torch.device) -> Entries:
        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
        groups = [(int(s), dev(dest[src == s], torch.int64), dev(page[src == s], torch.int64))
                  for s in np.unique(src) if s >= 0]
        return cls(dev(dest, torch.int32), dev(src, torch.int32), dev(page, torch.int64), groups,
                   dev(dest[src < 0], torch.int64), int(dest.size))


@dataclass
class Span:
    """A request's slots [start, end) and the ``own`` entries restricted to them (legacy mode)."""

    start: int
    end: int
    own: Entries


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
        self._arrays(layout)
        self._entries()
        self._rows(layout)
        self._persist(current_page_ids)
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

    def _entries(self) -> None:
        S, cp, dev = self.num_slots, self.cp, self.device
        slots = np.arange(S, dtype=np.int64)
        cur = self.is_current
        stage = np.zeros(S, np.int64)
        stage[self.current_slots] = self.staging_page
        src_all = np.where(cur, cp + self.slot_rank, self.slot_rank)
        page_all = np.where(cur, stage, self.slot_page)
        self.all = Entries.build(slots, src_all, page_all, dev)
        self.prefix = Entries.build(slots, np.where(cur, -1, self.slot_rank), np.where(cur, 0, self.slot_page), dev)
        cs = self.current_slots
        self.current = Entries.build(cs, src_all[cs], page_all[cs], dev)
        mine = self.slot_rank == self.rank
        self.own_src = np.where(mine, np.where(cur, 1, 0), -1)
        self.own_page = np.where(mine, page_all, 0)
        self.own = Entries.build(slots, self.own_src, self.own_page, dev)
        ncur = np.arange(self.num_current, dtype=np.int64)
        own_c = np.zeros(self.num_current, bool)
        own_c[self.own_compact] = True
        self.compact = Entries.build(ncur, np.where(own_c, 1, -1), np.where(own_c, self.staging_page, 0), dev)
        self.current_slots_t = torch.from_numpy(cs).to(dev)
        self._spans: list[Span] | None = None

    def spans(self, layout: BatchLayout) -> list[Span]:
        """Per-request spans with their own-page entries (legacy mode; built on first use)."""
        if self._spans is None:
            self._spans = []
            for r in layout.requests:
                s, e = r.slot_start, r.slot_end
                sl = np.arange(e - s, dtype=np.int64)
                self._spans.append(Span(s, e, Entries.build(sl, self.own_src[s:e], self.own_page[s:e], self.device)))
        return self._spans

    def _rows(self, layout: BatchLayout) -> None:
        P = self.page_size
        counts = self.current_tokens[self.own_compact]
        starts = np.arange(self.num_own, dtype=np.int64) * P
        q = [np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, counts)]
        t = [np.arange(s + n, s + P, dtype=np.int64) for s, n in zip(starts, counts) if n < P]
        self.query_rows = torch.from_numpy(np.concatenate(q) if q else np.zeros(0, np.int64)).to(self.device)
        self.tail_rows = torch.from_numpy(np.concatenate(t) if t else np.zeros(0, np.int64)).to(self.device)
        self.num_query_tokens = int(counts.sum())
        assert self.num_query_tokens == layout.query_tokens(self.rank)

    def _persist(self, current_page_ids: Sequence[int] | None) -> None:
        self.current_page_ids = None if current_page_ids is None else np.asarray(current_page_ids, np.int64)
        self.own_pool_pages: torch.Tensor | None = None
        if self.current_page_ids is None:
            return
        if self.current_page_ids.shape != (self.num_current,):
            raise ComposeError(f"current_page_ids: expected one writer-side page id per current page "
                               f"({self.num_current}, compact order), got shape {list(self.current_page_ids.shape)}")
        mine = self.current_page_ids[self.own_compact]
        if mine.size and (mine.min() < 1 or len(set(mine.tolist())) != mine.size):
            raise ComposeError(f"rank {self.rank}: current page ids must be distinct pool pages >= 1 (page 0 is "
                               f"reserved), got {mine.tolist()}")
        self.own_pool_pages = torch.from_numpy(mine).to(self.device)

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
