"""KVCacheManager: the verbs the scheduler and the engine use, with exact page ids and eviction order."""
from __future__ import annotations

import pytest

from cpkv.errors import AdmissionError
from cpkv.kvcache import EMPTY, KVCacheManager, PageAllocator

P = 4


def make(pages=5, cp=2, host=0, spills=None):
    allocs = [PageAllocator(pages, f"rank{r}") for r in range(cp)]
    hook = (lambda o, p, s: spills.append((o, p, s))) if spills is not None else None
    return KVCacheManager(P, allocs, host_pages=host, on_spill=hook), allocs


def keys(base, n):
    return list(range(base, base + n))


def test_allocate_commit_match_release_with_exact_pages():
    kv, allocs = make()
    assert kv.match(keys(0, 8)) is not None and len(kv.match(keys(0, 8))) == 0
    pages = kv.allocate([0, 1, 0])
    assert pages == ((0, 1), (1, 1), (0, 2))                 # lowest free id first, per owner
    held = kv.commit(keys(0, 8), EMPTY, pages[:2])            # two full pages enter the cache
    kv.release(pages[2:])
    assert held.pages == ((0, 1), (1, 1))
    assert kv.match(keys(0, 9)).pages == ((0, 1), (1, 1))
    assert kv.pages_used() == [1, 1]
    kv.drop(held)
    assert kv.tree.evictable_pages() == 2                    # nothing held any more


def test_a_commit_of_pages_cached_meanwhile_gives_them_back():
    kv, allocs = make()
    first = kv.allocate([0])
    kv.commit(keys(0, 4), EMPTY, first, hold=False)
    second = kv.allocate([1])
    assert kv.commit(keys(0, 4), EMPTY, second, hold=False) is EMPTY
    assert allocs[1].refcount(second[0][1]) == 0             # the duplicate went back to rank 1
    assert kv.match(keys(0, 4)).pages == first


def test_allocate_evicts_lru_leaves_of_the_short_owner_or_changes_nothing():
    kv, allocs = make(pages=3, cp=1)                          # 2 pages
    a = kv.allocate([0])
    kv.commit(keys(0, 4), EMPTY, a, hold=False)
    b = kv.allocate([0])
    kv.commit(keys(100, 4), EMPTY, b, hold=False)
    kv.match(keys(0, 4))                                      # page of keys 0.. is now the most recent
    assert kv.allocate([0]) == ((0, b[0][1]),)                # keys 100.. was the LRU leaf
    assert len(kv.match(keys(100, 4))) == 0 and kv.stats["evicted"] == 1
    held = kv.match(keys(0, 4))
    kv.hold(held)
    assert kv.allocate([0]) is None                           # the only cached page is held: nothing moves
    assert kv.match(keys(0, 4)).pages == a
    kv.drop(held)


def test_spill_and_reload_through_the_hooks():
    spills, loads = [], []
    kv, allocs = make(pages=3, cp=1, host=4, spills=spills)
    a = kv.allocate([0])
    kv.commit(keys(0, 4), EMPTY, a, hold=False)
    b = kv.allocate([0])
    kv.commit(keys(100, 4), EMPTY, b, hold=False)
    kv.allocate([0, 0])                                       # both cached pages spill to the host tier
    assert spills == [(0, 1, 1), (0, 2, 2)] and kv.stats["spilled"] == 2
    assert len(kv.match(keys(0, 4))) == 0                     # admission sees only the device run
    kv.release([(0, 1), (0, 2)])
    assert kv.reload(keys(0, 4), lambda o, s, p: loads.append((o, s, p)), may_evict=False) == 1
    assert loads == [(0, 1, 1)] and kv.match(keys(0, 4)).pages == ((0, 1),)


def test_a_host_tier_needs_a_spill_hook():
    with pytest.raises(AdmissionError, match="on_spill"):
        KVCacheManager(P, [PageAllocator(4)], host_pages=2)
