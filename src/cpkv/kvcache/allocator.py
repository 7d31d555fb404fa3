"""Refcounted page allocator of one rank's pool. No torch import.

Page 0 is reserved (the dummy page). Free pages are handed out lowest id first, so the same sequence of
calls gives the same page ids on every rank that mirrors this allocator.
"""
from __future__ import annotations

import heapq
from typing import Iterable

from cpkv.errors import PageError, PoolExhausted


class PageAllocator:
    """Pages 1..num_pages-1 of one pool, with a reference count each."""

    def __init__(self, num_pages: int, name: str = "pool") -> None:
        if num_pages < 2:
            raise PageError(f"{name}: a pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.name = name
        self._free = list(range(1, num_pages))  # already a heap
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh pages with refcount 1. Raises PoolExhausted (state unchanged) when fewer are free."""
        if n < 0:
            raise PageError(f"{self.name}: cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise PoolExhausted(f"{self.name}: asked for {n} pages, {len(self._free)} free of {self.num_pages - 1}")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def ref(self, pages: Iterable[int]) -> None:
        """Take one more reference on pages already held."""
        pages = list(pages)
        for p in pages:
            self._check_held(p)
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference each; returns the pages that became free."""
        pages = list(pages)
        for p in pages:
            self._check_held(p)
        if len(set(pages)) != len(pages) and any(self._refs[p] < pages.count(p) for p in set(pages)):
            raise PageError(f"{self.name}: release of {pages} drops more references than are held")
        freed = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)
                freed.append(p)
        return freed

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def _check_held(self, p: int) -> None:
        if not (1 <= p < self.num_pages):
            raise PageError(f"{self.name}: page id must be in [1, {self.num_pages}), got {p}")
        if self._refs[p] == 0:
            raise PageError(f"{self.name}: page {p} is not allocated")
