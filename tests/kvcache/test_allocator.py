from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.errors import PageError, PoolExhausted
from cpkv.kvcache import PageAllocator


def test_lowest_first_and_reserved_page():
    a = PageAllocator(6)
    assert a.allocate(3) == [1, 2, 3]
    a.release([2])
    assert a.allocate(2) == [2, 4]
    assert a.num_free == 1


def test_exhaustion_leaves_state_intact():
    a = PageAllocator(5)
    got = a.allocate(2)
    before = (a.num_free, [a.refcount(p) for p in range(5)])
    with pytest.raises(PoolExhausted, match="asked for 3 pages, 2 free of 4"):
        a.allocate(3)
    assert (a.num_free, [a.refcount(p) for p in range(5)]) == before
    assert a.allocate(2) == [3, 4] and got == [1, 2]


def test_refcounts_and_double_free():
    a = PageAllocator(4)
    (p,) = a.allocate(1)
    a.ref([p])
    assert a.release([p]) == []
    assert a.release([p]) == [p]
    with pytest.raises(PageError, match="not allocated"):
        a.release([p])
    with pytest.raises(PageError, match=r"in \[1, 4\)"):
        a.release([0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_no_page_handed_out_twice(ops):
    a = PageAllocator(16)
    held: list[int] = []
    for alloc, n in ops:
        if alloc:
            if a.can_allocate(n):
                new = a.allocate(n)
                assert not set(new) & set(held) and 0 not in new
                held += new
            else:
                with pytest.raises(PoolExhausted):
                    a.allocate(n)
        elif held:
            a.release(held[:n])
            held = held[n:]
        assert a.num_free + len(held) == 15
