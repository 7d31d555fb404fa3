"""Host ms of the prefix cache's per-request work on a long prompt (CPU only): the page keys of a prompt (a match on an
empty cache: the keys and one lookup), a cold prompt's insert, a cached turn's admission match, and a cold prompt's
per-chunk commits (each chunk inserts and matches every full page of the prompt so far). Public names only.

    PYTHONPATH=src python3 benchmarks/prefix_cache_host.py [--json]
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from cpkv.kvcache import KVCacheManager, PageAllocator, PrefixCache

PAGE = 64
CHUNK = 32768
REPEATS = 5


def _best(fn) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def case(tokens: int) -> dict:
    rng = np.random.default_rng(tokens)
    toks = rng.integers(0, 150_000, size=tokens, dtype=np.int64)  # the engine keeps each request's ids as int64
    out = {"tokens": tokens, "pages": tokens // PAGE}

    def fresh() -> tuple[PrefixCache, list]:
        allocs = [PageAllocator(tokens // PAGE + 16, f"r{r}") for r in range(8)]
        cache = PrefixCache(PAGE, allocs)
        pages = [(i % 8, allocs[i % 8].allocate(1)[0]) for i in range(tokens // PAGE)]
        return cache, pages

    cache, pages = fresh()
    out["keys_ms"] = _best(lambda: cache.match(toks))  # on an empty cache: the prompt's page keys and one lookup
    best = float("inf")
    for _ in range(REPEATS):  # a cold prompt's pages into an empty cache, at once
        c, p = fresh()
        t0 = time.perf_counter()
        c.insert(toks, p)
        best = min(best, time.perf_counter() - t0)
    out["insert_ms"] = round(best * 1e3, 3)
    cache.insert(toks, pages)
    out["match_ms"] = _best(lambda: cache.match(toks))  # a cached turn's admission

    def commits():  # a cold prompt in chunks, as the scheduler commits it: each chunk keys the prompt so far
        allocs = [PageAllocator(tokens // PAGE + 16, f"r{r}") for r in range(8)]
        kv = KVCacheManager(PAGE, allocs)
        prefix = kv.match(toks[:0])
        for end in range(CHUNK, tokens + CHUNK, CHUNK):
            end = min(end, tokens)
            new = kv.allocate([i % 8 for i in range(len(prefix), end // PAGE)])
            prefix = kv.commit(toks[:end], prefix, new, hold=end < tokens)
    out["chunked_commits_ms"] = _best(commits)
    return out


if __name__ == "__main__":
    rows = [case(n) for n in (32768, 131072, 200_000)]
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(r)
