"""The prefix cache's heap eviction against the scan it replaced, on random operation sequences (hypothesis).

``ScanPrefixCache`` keeps the former victim choice: every eviction scans all unlocked device leaves (and
every host-tier eviction sorts all host leaves) by (last use, creation order). Both caches get the same
operations; after each one their trees, allocators, host tiers, spill logs and counters must be identical.
"""
from __future__ import annotations

import heapq

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cpkv.kvcache import PageAllocator, PrefixCache
from cpkv.kvcache.prefix_cache import Node, SpillHook

P = 2


class ScanPrefixCache(PrefixCache):
    """The reference: eviction by a full scan of the leaves (the code before the heaps)."""

    def evict(self, num_pages: int, owner: int | None = None, on_spill: SpillHook | None = None) -> int:
        heap = [(n.last_use, n.nid, n) for n in self._device_leaves if n.lock == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if node not in self._device_leaves or node.lock:
                continue
            counts = owner is None or node.owner == owner
            parent = self._evict_device(node, on_spill)
            freed += int(counts)
            if parent is not None and parent in self._device_leaves and parent.lock == 0:
                heapq.heappush(heap, (parent.last_use, parent.nid, parent))
        return freed

    def _host_slot(self) -> int:
        assert self.host is not None
        if self.host.num_free == 0:
            victims = [n for n in sorted(self._host_leaves, key=lambda n: (n.last_use, n.nid)) if n.lock == 0]
            if not victims:
                return -1
            self._drop_host(victims[0])
        return self.host.allocate(1)[0]


class Side:
    """One cache with its allocators, its spill log and the chains it holds locked."""

    def __init__(self, cls: type[PrefixCache], cp: int, pages: int, host: int, spill: bool = True) -> None:
        self.spill = spill  # one hook for every eviction, as KVCacheManager passes it
        self.allocs = [PageAllocator(pages, f"rank{r}") for r in range(cp)]
        self.cache = cls(P, self.allocs, host_pages=host)
        self.spills: list[tuple[int, int, int]] = []
        self.held: list[list[Node]] = []

    def hook(self, owner: int, page: int, slot: int) -> None:
        self.spills.append((owner, page, slot))

    def apply(self, op: tuple) -> object:
        kind, c = op[0], self.cache
        if kind == "insert":
            _, tokens, owner = op
            n = len(tokens) // P
            if self.allocs[owner].num_free < n:
                c.evict(n - self.allocs[owner].num_free, owner=owner, on_spill=self.hook if self.spill else None)
            if self.allocs[owner].num_free < n:
                return "short"
            pages = [(owner, p) for p in self.allocs[owner].allocate(n)]
            rejected = c.insert(tokens, pages)
            for o, p in rejected:
                self.allocs[o].release([p])
            return rejected
        if kind == "match":
            return c.match(op[1]).pages
        if kind == "lock":
            nodes = list(c.match(op[1]).nodes)
            if nodes:
                c.lock(nodes)
                self.held.append(nodes)
            return len(nodes)
        if kind == "unlock":
            if not self.held:
                return None
            nodes = self.held.pop(op[1] % len(self.held))
            c.unlock(nodes)
            return len(nodes)
        if kind == "evict":
            _, n, owner = op
            return c.evict(n, owner=owner, on_spill=self.hook if self.spill else None)
        if kind == "reload":
            done = []
            for node in c.match(op[1]).host_nodes:
                if node.on_device or node.host_slot < 1 or self.allocs[node.owner].num_free == 0:
                    continue
                page = self.allocs[node.owner].allocate(1)[0]
                done.append((node.owner, c.reload(node, page), page))
            return done
        raise AssertionError(kind)

    def state(self) -> tuple:
        out, stack = [], [(b"", self.cache.root)]
        while stack:
            path, node = stack.pop()
            for key, child in sorted(node.children.items()):
                out.append((path + key, child.owner, child.page_id, child.host_slot, child.last_use, child.lock,
                            child.nid))
                stack.append((path + key, child))
        host = self.cache.host
        return (sorted(out), [(a._free[:], a._refs[:]) for a in self.allocs],
                (host._free[:], host._refs[:]) if host else None, self.spills[:], dict(self.cache.stats),
                self.cache.num_device_pages, self.cache.evictable_pages())


tokens = st.lists(st.integers(0, 1), min_size=2, max_size=8)  # few distinct pages: chains share prefixes
op = st.one_of(
    st.tuples(st.just("insert"), tokens, st.integers(0, 1)),
    st.tuples(st.just("match"), tokens),
    st.tuples(st.just("lock"), tokens),
    st.tuples(st.just("unlock"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(1, 6), st.one_of(st.none(), st.integers(0, 1))),
    st.tuples(st.just("reload"), tokens),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pages=st.integers(2, 10), host=st.integers(0, 3), spill=st.booleans(),
       ops=st.lists(op, min_size=1, max_size=60))
@example(spill=False, pages=8, host=0, ops=[("insert", [0, 0], 0), ("insert", [1, 1], 0), ("match", [0, 0]),
                               ("evict", 1, None)])  # a re-stamped leaf goes last
@example(spill=False, pages=8, host=0, ops=[("insert", [0, 0], 0), ("insert", [1, 1], 0), ("lock", [0, 0]),
                               ("evict", 2, None), ("unlock", 0), ("evict", 1, None)])  # unlocked: back
@example(spill=True, pages=3, host=1, ops=[("insert", [0, 0, 0, 0], 0), ("insert", [1, 1], 1), ("match", [0, 0]),
                               ("evict", 3, None), ("insert", [1, 1], 0), ("evict", 2, None)])
def test_heap_eviction_matches_the_scan(pages, host, spill, ops):
    new, ref = Side(PrefixCache, 2, pages, host, spill), Side(ScanPrefixCache, 2, pages, host, spill)
    for o in ops:
        got, want = _outcome(new, o), _outcome(ref, o)
        assert got == want, o
        if want is AssertionError:
            break  # both refused the same operation (an assertion of the tree); their states may differ now
        assert new.state() == ref.state(), o


def _outcome(side: Side, o: tuple) -> object:
    try:
        return side.apply(o)
    except AssertionError as exc:
        return type(exc)


def test_stale_entries_do_not_grow_the_heap_without_bound():
    """Many hold/drop cycles and re-stamps of the same leaves keep the heap within twice the leaves + 64."""
    side = Side(PrefixCache, 1, 64, 0, spill=False)
    for t in range(20):
        side.apply(("insert", [t, t], 0))
    for i in range(5000):
        side.apply(("lock", [i % 20, i % 20]))
        side.apply(("unlock", 0))
        side.apply(("match", [(i * 7) % 20, (i * 7) % 20]))
    heap = side.cache._device_heap
    assert len(heap._heap) <= 2 * len(heap.members) + 64
    assert side.cache.evict(20) == 20  # every leaf still reachable through the heap
