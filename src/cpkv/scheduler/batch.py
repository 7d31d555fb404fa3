"""What admission hands the engine: a batch of entries, one chunk of one request each. No torch import."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cpkv.kvcache.manager import Prefix
from cpkv.layout import BatchLayout, build_layout, cdiv
from cpkv.scheduler.request import Request


@dataclass(frozen=True, eq=False)
class Entry:
    """One chunk of one request in a batch.

    ``prefix_len``: the true carried prefix (cache hit + earlier chunks), tokens already in KV.
    ``extend_len``: tokens computed now. ``prefix_pages``: (owner, page id) of the cdiv(prefix_len, P)
    prefix pages (the last one partial only for an unaligned prefix, which runs alone). ``pages``:
    (owner, page id) of the cdiv(extend_len, P) new pages the scheduler allocated; ``writers``: the
    rank that computes each of them (the layout split; owner == writer unless the KV is replicated).
    ``prefix``: the carried prefix's cached pages (an opaque handle the KV-cache manager holds).
    """

    request: Request
    prefix_len: int
    extend_len: int
    chunked: bool
    last_chunk: bool
    prefix: Prefix
    pages: tuple[tuple[int, int], ...]
    writers: tuple[int, ...]

    @property
    def prefix_pages(self) -> tuple[tuple[int, int], ...]:
        return self.prefix.pages

    @property
    def rid(self) -> Any:
        return self.request.rid

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.extend_len

    def to_dict(self) -> dict[str, Any]:
        """The ``--log-batches`` form of an entry."""
        return {"id": self.rid, "prefix_len": self.prefix_len, "extend_len": self.extend_len,
                "chunked": self.chunked, "last_chunk": self.last_chunk}


@dataclass(eq=False)
class Batch:
    """Entries in batch order (the layout's request order). ``index``: batch number from 0."""

    index: int
    entries: tuple[Entry, ...]
    page_size: int
    cp: int
    strategy: str
    _layout: BatchLayout | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def extend_tokens(self) -> int:
        return sum(e.extend_len for e in self.entries)

    @property
    def prefix_tokens(self) -> int:
        return sum(e.prefix_len for e in self.entries)

    @property
    def num_slots(self) -> int:
        P = self.page_size
        return sum(cdiv(e.prefix_len, P) + cdiv(e.extend_len, P) for e in self.entries)

    def layout(self, max_context: int | None = None) -> BatchLayout:
        """The batch's page layout (built once, cached on the batch): same writers as ``Entry.writers``."""
        if self._layout is None:
            self._layout = build_layout(
                [(e.prefix_len, e.extend_len) for e in self.entries], page_size=self.page_size, cp=self.cp,
                strategy=self.strategy, prefix_pages=[e.prefix_pages for e in self.entries],
                max_context=max_context)
        return self._layout
