"""The KV-cache manager: the one owner of the CP-wide prefix cache, the page allocators (one per rank) and the
host tier's slots, with the policies that go with them (LRU eviction, spill to the host, reload). No torch import.

The scheduler and the engine reach the KV cache only through its verbs and get opaque handles back::

    kv = KVCacheManager(page_size, [PageAllocator(n, f"rank {r}") for r in range(cp)], host_pages=H, on_spill=hook)
    hit = kv.match(keys)                 # Prefix: the longest cached run of full pages (device part only)
    kv.hold(hit)                         # pin it while a request uses it   ... kv.drop(hit) when done
    pages = kv.allocate(owners)          # ((owner, page id), ...) fresh pages, LRU leaves evicted (spilled) as
                                         #   needed; None when an owner is short even then (nothing changes)
    hit = kv.commit(keys, hit, pages)    # the full pages after ``hit`` enter the cache (their writers own
                                         #   them); returns the longer Prefix, held in place of ``hit``
                                         #   (hold=False: the request is done, ``hit`` is dropped)
    kv.release(pages)                    # pages that never entered the cache go back to their allocators
    kv.reload(keys, load, may_evict)     # host-tier pages of a cached chain come back into device pages;
                                         #   ``load(owner, host_slot, page_id)`` copies the bytes (the owner's)

``Prefix.pages`` is the (owner, page id) of each page, the only thing a batch needs from the cache; the tree's
nodes never leave this module. ``on_spill(owner, page_id, host_slot)`` copies a victim's bytes to the host tier
before its device page is freed (the engine passes a hook that only the owner acts on). Every rank holds the
same manager and makes the same calls in the same order, so every rank takes the same decisions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from cpkv.errors import AdmissionError
from cpkv.kvcache.allocator import PageAllocator
from cpkv.kvcache.prefix_cache import Node, PrefixCache, SpillHook

Page = tuple[int, int]  # (owner rank, page id)
LoadHook = Callable[[int, int, int], None]  # (owner, host slot, page id): copy host bytes into the device page

_HELD = (-1, -1)  # stands for a page the tree already holds (never adopted: its node exists and is held)


@dataclass(frozen=True, eq=False)
class Prefix:
    """A run of cached full pages from the start of a prompt (opaque: only ``pages`` and its length are read)."""

    _nodes: tuple[Node, ...] = ()

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def pages(self) -> tuple[Page, ...]:
        """(owner, page id) of each page, in prompt order; page id -1 for a page on the host tier."""
        return tuple((n.owner, n.page_id) for n in self._nodes)

    def on_device(self) -> "Prefix":
        """The leading part of the run whose pages are on a device pool."""
        for i, n in enumerate(self._nodes):
            if not n.on_device:
                return Prefix(self._nodes[:i])
        return self

    def head(self, n: int) -> "Prefix":
        """The first ``n`` pages."""
        return Prefix(self._nodes[:n])

    def pages_from(self, start: int) -> tuple[Page, ...]:
        """``pages[start:]`` without building the others (a long decode's table changes only at its end)."""
        return tuple((n.owner, n.page_id) for n in self._nodes[start:])


EMPTY = Prefix()


class KVCacheManager:
    """Prefix cache + allocators + host tier of the CP group (see the module docstring)."""

    def __init__(self, page_size: int, allocators: Sequence[PageAllocator], host_pages: int = 0,
                 on_spill: SpillHook | None = None) -> None:
        if host_pages and on_spill is None:
            raise AdmissionError("the KV cache has a host tier: pass on_spill so that evicted pages are copied")
        self.tree = PrefixCache(page_size, allocators, host_pages)
        self.on_spill = on_spill

    # -- facts -------------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        """Tokens (keys) per page of the tree."""
        return self.tree.page_size

    @property
    def num_pools(self) -> int:
        return len(self.tree.allocators)

    @property
    def pool_pages(self) -> int:
        """Pages of every pool together (page 0 of each reserved)."""
        return sum(a.num_pages - 1 for a in self.tree.allocators)

    def pages_used(self) -> list[int]:
        return [a.num_used for a in self.tree.allocators]

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``spilled``, ``reloaded``, ``evicted`` pages."""
        return self.tree.stats

    # -- the verbs ---------------------------------------------------------------------------------
    def match(self, keys: Sequence[int]) -> Prefix:
        """The longest cached run of full pages of ``keys`` (its device part when a host tier exists; the
        engine reloads the rest first); refreshes its LRU stamp. Holds nothing."""
        return Prefix(self.tree.match(keys).nodes).on_device()

    def hold(self, prefix: Prefix) -> None:
        """Pin ``prefix`` against eviction while a request uses it (counted: one ``drop`` per ``hold``)."""
        self.tree.lock(prefix._nodes)

    def drop(self, prefix: Prefix) -> None:
        """Undo one ``hold``."""
        self.tree.unlock(prefix._nodes)

    def allocate(self, owners: Sequence[int]) -> tuple[Page, ...] | None:
        """One fresh page on each of ``owners`` (in that order), evicting LRU leaves of the owners that are
        short; None (no page allocated) when some owner is short even after eviction."""
        need: dict[int, int] = {}
        for o in owners:
            need[o] = need.get(o, 0) + 1
        allocs = self.tree.allocators
        for o in sorted(need):
            short = need[o] - allocs[o].num_free
            if short > 0:
                self.tree.evict(short, owner=o, on_spill=self.on_spill)
        if any(allocs[o].num_free < n for o, n in need.items()):
            return None
        got = {o: iter(allocs[o].allocate(n)) for o, n in sorted(need.items())}
        return tuple((o, next(got[o])) for o in owners)

    def commit(self, keys: Sequence[int], prefix: Prefix, pages: Sequence[Page], hold: bool = True) -> Prefix:
        """``pages`` hold the full pages of ``keys`` that follow ``prefix`` (held): the tree adopts them
        (a page whose keys another request cached meanwhile goes back to its allocator). ``prefix`` is
        dropped; with ``hold`` the Prefix of every full page of ``keys`` is returned held in its place (the
        next chunk of the request carries it), otherwise the empty Prefix."""
        if pages:
            dup = self.tree.insert(keys, [_HELD] * len(prefix) + list(pages))
            if dup.count(_HELD) != len(prefix):
                raise AdmissionError("commit: the held prefix is no longer in the prefix cache")
            self.release(dup[len(prefix):])
        if not hold:
            self.tree.unlock(prefix._nodes)
            return EMPTY
        longer = Prefix(self.tree.match(keys).nodes)
        if len(longer) * self.page_size < len(keys) - len(keys) % self.page_size:
            raise AdmissionError(f"commit: {len(keys) // self.page_size} full pages expected in the cache, "
                                 f"found {len(longer)}")
        self.tree.lock(longer._nodes)
        self.tree.unlock(prefix._nodes)
        return longer

    def release(self, pages: Iterable[Page]) -> None:
        """Give pages that are not in the cache back to their owners' allocators."""
        by_owner: dict[int, list[int]] = {}
        for owner, pid in pages:
            by_owner.setdefault(owner, []).append(pid)
        for owner, pids in sorted(by_owner.items()):
            self.tree.allocators[owner].release(pids)

    def flush(self) -> int:
        """Drop every unheld page of the prefix cache from the device pools (none is spilled); returns pages freed."""
        return self.tree.evict(self.pool_pages)

    def reload(self, keys: Sequence[int], load: LoadHook, may_evict: bool) -> int:
        """Bring the host-tier pages of ``keys``' cached chain back into their owners' pools, in order, while
        pages are free (``may_evict``: LRU leaves may be evicted to make room). Returns pages reloaded."""
        nodes = self.tree.match(keys).nodes
        first = next((i for i, n in enumerate(nodes) if not n.on_device), len(nodes))
        if first == len(nodes):
            return 0
        done = 0
        self.tree.lock(nodes)  # neither the chain's device part nor its host part may go meanwhile
        try:
            for node in nodes[first:]:
                if node.on_device:  # a page inserted later under a spilled parent
                    continue
                alloc = self.tree.allocators[node.owner]
                if alloc.num_free == 0 and may_evict:
                    self.tree.evict(1, owner=node.owner, on_spill=self.on_spill)
                if alloc.num_free == 0:
                    break
                page = alloc.allocate(1)[0]
                load(node.owner, node.host_slot, page)
                self.tree.reload(node, page)
                done += 1
        finally:
            self.tree.unlock(nodes)
        return done
