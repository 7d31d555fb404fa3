"""The gather benchmark's page order of a pool in use (``cpkv.bench.compose.allocator_order``), taken from the
engine's own allocator: distinct pages of the pool, ascending within each allocation chunk, a later chunk restarting
lower only where pages were freed meanwhile, the same list for the same seed, bad sizes refused."""
from __future__ import annotations

import numpy as np
import pytest

from cpkv.bench.compose import allocator_order


def test_allocator_order_is_the_allocators_lowest_first_in_chunks() -> None:
    pool, n, chunk = 4096, 2048, 256
    pages = allocator_order(pool, n, chunk=chunk, seed=3)
    a = np.asarray(pages)
    assert len(a) == n and len(set(pages)) == n and a.min() >= 0 and a.max() < pool
    runs = a.reshape(-1, chunk)
    assert (np.diff(runs, axis=1) > 0).all()  # each chunk ascends (lowest free ids first)
    restarts = [i for i in range(1, len(runs)) if runs[i, 0] < runs[i - 1, -1]]
    assert restarts  # pages freed between chunks are handed out again: not one sorted list
    assert not (np.diff(a) == 1).all()  # not contiguous either: the pool is fragmented
    assert allocator_order(pool, n, chunk=chunk, seed=3) == pages
    assert allocator_order(pool, n, chunk=chunk, seed=4) != pages


def test_allocator_order_refuses_more_than_half_the_pool() -> None:
    with pytest.raises(ValueError, match=r"n must be in \[0, 50\]"):
        allocator_order(100, 51)
    assert allocator_order(100, 0) == []


def test_pair_bench_wants_two_kinds() -> None:
    from cpkv.bench.compose import pair_bench
    with pytest.raises(ValueError, match="two kinds"):
        pair_bench(None, {"token": (64, 4)})
