from __future__ import annotations

import pytest

from cpkv.errors import PageError
from cpkv.kvcache import PageAllocator, PrefixCache

P = 4


def make(cp=2, pages=16, host=0):
    allocs = [PageAllocator(pages, f"rank{r}") for r in range(cp)]
    return PrefixCache(P, allocs, host_pages=host), allocs


def put(cache, allocs, tokens, owners):
    pages = [(o, allocs[o].allocate(1)[0]) for o in owners]
    return pages, cache.insert(tokens, pages)


def test_exact_hit_lengths():
    cache, allocs = make()
    toks = list(range(14))  # 3 full pages + 2 tokens
    pages, rejected = put(cache, allocs, toks, [0, 1, 0])
    assert rejected == []
    assert cache.match(toks).num_tokens == 12
    assert cache.match(toks[:11]).num_tokens == 8
    assert cache.match(toks[:8] + [99] * 6).num_tokens == 8
    assert cache.match([99] + toks).num_tokens == 0
    assert cache.match(toks).pages == pages


def test_duplicate_insert_returns_callers_pages():
    cache, allocs = make()
    put(cache, allocs, list(range(8)), [0, 1])
    dup = [(1, allocs[1].allocate(1)[0]), (0, allocs[0].allocate(1)[0]), (1, allocs[1].allocate(1)[0])]
    rejected = cache.insert(list(range(12)), dup)
    assert rejected == dup[:2]
    assert cache.match(list(range(12))).pages[2] == dup[2]


def test_lru_eviction_order_and_owner_pages_returned():
    cache, allocs = make()
    a, _ = put(cache, allocs, [1] * 8, [0, 1])       # chain A: two pages
    b, _ = put(cache, allocs, [2] * 4, [1])          # chain B
    c, _ = put(cache, allocs, [3] * 4, [0])          # chain C
    cache.match([1] * 8)                             # A is now most recent
    free_before = [x.num_free for x in allocs]
    assert cache.evict(1) == 1                       # B: least recently used leaf
    assert cache.match([2] * 4).num_tokens == 0
    assert allocs[1].num_free == free_before[1] + 1
    assert cache.evict(1) == 1                       # then C
    assert cache.match([3] * 4).num_tokens == 0
    assert cache.evict(1) == 1                       # then A's leaf, not its root page
    assert cache.match([1] * 8).num_tokens == 4
    assert [x.num_free for x in allocs] == [free_before[0] + 1, free_before[1] + 2]


def test_evict_for_owner_and_locks():
    cache, allocs = make()
    put(cache, allocs, [1] * 8, [0, 1])
    m = cache.match([1] * 8)
    cache.lock(m.nodes)
    assert cache.evict(5) == 0 and cache.evictable_pages() == 0
    cache.unlock(m.nodes)
    assert cache.evictable_pages(owner=0) == 1
    assert cache.evict(1, owner=0) == 1              # must go through rank 1's leaf first
    assert cache.num_device_pages == 0
    with pytest.raises(PageError):
        cache.unlock(m.nodes)


def test_host_tier_spill_and_reload():
    cache, allocs = make(host=1)
    put(cache, allocs, [5] * 4, [1])
    put(cache, allocs, [6] * 4, [0])
    spilled = []
    cache.evict(2, on_spill=lambda o, p, s: spilled.append((o, p, s)))
    # host holds one page: the second victim takes the slot, dropping the older spilled page (host LRU)
    assert spilled == [(1, 1, 1), (0, 1, 1)]
    assert cache.match([5] * 4).num_tokens == 0
    m = cache.match([6] * 4)
    assert m.num_tokens == 4 and m.pages == [(0, -1)] and len(m.host_nodes) == 1
    page = allocs[0].allocate(1)[0]
    assert cache.reload(m.host_nodes[0], page) == 1
    assert cache.match([6] * 4).pages == [(0, page)]
    assert cache.stats == {"spilled": 2, "reloaded": 1, "evicted": 2}
    assert cache.host.num_free == 1


def test_rank_uniform_decisions():
    def scenario():
        cache, allocs = make(cp=3)
        for i in range(6):
            put(cache, allocs, [i] * 8, [i % 3, (i + 1) % 3])
            cache.match([(i * 7) % 6] * 8)
        cache.evict(5)
        return [cache.match([i] * 8).pages for i in range(6)], [a.num_free for a in allocs]
    assert scenario() == scenario()


def test_evict_without_hook_drops_instead_of_spilling():
    cache, allocs = make(host=2)
    put(cache, allocs, [5] * 4, [1])
    assert cache.evict(1) == 1
    assert cache.match([5] * 4).num_tokens == 0 and cache.host.num_free == 2


def test_insert_over_spilled_page_adopts_the_fresh_copy():
    cache, allocs = make(host=2)
    put(cache, allocs, [5] * 8, [1, 0])
    cache.evict(2, on_spill=lambda o, p, s: None)
    assert cache.match([5] * 8).pages == [(1, -1), (0, -1)]
    fresh = [(0, allocs[0].allocate(1)[0]), (1, allocs[1].allocate(1)[0])]
    assert cache.insert([5] * 8, fresh) == []
    assert cache.match([5] * 8).pages == fresh
    assert cache.host.num_free == 2 and cache.num_device_pages == 2


def test_keys_are_the_same_for_every_integer_sequence_type():
    """A page's key depends on its ids only: lists, tuples and numpy arrays of any integer dtype (the engine keeps
    int64 arrays, tests and replays pass lists) find each other's pages; the partial last page is not keyed."""
    import numpy as np

    cache, allocs = make()
    toks = [7, 3, 150_000, 2**40, 0, 1, 2, 3, 9]
    pages, _ = put(cache, allocs, np.asarray(toks, dtype=np.int64), [0, 1])
    for seq in (toks, tuple(toks), np.asarray(toks, dtype=np.int64), np.asarray(toks[:8] + [5], dtype=np.uint64)):
        got = cache.match(seq)
        assert got.num_tokens == 8 and got.pages == pages
    small, _ = put(cache, allocs, [11, 12, 13, 14, 15], [1])
    assert cache.match(np.asarray([11, 12, 13, 14], dtype=np.int32)).pages == small  # int32 ids, as int64 keys
    assert cache.match([7, 3, 150_000, 2**40 + 1] + toks[4:]).num_tokens == 0  # one id differs: another page
    assert [len(k) for k in cache._keys(toks)] == [8 * P, 8 * P]
    assert cache._keys(toks[:3]) == [] and cache._keys(np.zeros(0, dtype=np.int64)) == []


def test_keys_out_of_int64_are_a_one_line_error():
    cache, allocs = make()
    with pytest.raises(PageError, match="within int64"):
        cache.match([2**64, 1, 2, 3])
    with pytest.raises(PageError, match="within int64"):
        cache.match(["a", "b", "c", "d"])
