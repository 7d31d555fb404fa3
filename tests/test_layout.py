from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.config import STRATEGIES
from cpkv.errors import ConfigError, LayoutError
from cpkv.layout import build_layout, causal_work, cdiv, check_invariants, split_writers


@st.composite
def batches(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16, 64]))
    cp = draw(st.integers(1, 9))
    n = draw(st.integers(1, 6))
    reqs = [(draw(st.integers(0, 12)) * page_size, draw(st.integers(1, 40 * page_size))) for _ in range(n)]
    return page_size, cp, reqs, draw(st.sampled_from(STRATEGIES))


@settings(max_examples=300, deadline=None)
@given(batches())
def test_invariants_hold_for_random_batches(case):
    page_size, cp, reqs, strategy = case
    L = build_layout(reqs, page_size=page_size, cp=cp, strategy=strategy)
    check_invariants(L)
    # every new token is covered exactly once, by exactly one writer
    for r, (prefix, extend) in zip(L.requests, reqs):
        covered = [t for c in r.current_pages for t in range(c.start, c.end)]
        assert covered == list(range(prefix, prefix + extend))
        assert len(r.prefix_pages) == cdiv(prefix, page_size)
    # per rank query ranges cover exactly its pages' tokens
    for rank in range(cp):
        mine = sorted((c.request, t) for c in L.current_pages if c.writer == rank for t in range(c.start, c.end))
        ranged = sorted((req, t) for req, s, e in L.rank_query_ranges[rank] for t in range(s, e))
        assert mine == ranged
        assert L.rank_work[rank] == sum(t + 1 for _, t in mine)
    # merged-span order: slots of each request are contiguous, prefix before current
    kinds = [(p.request, p.kind) for p in L.logical_pages]
    expected = [(i, k) for i, r in enumerate(L.requests) for k in
                ["prefix"] * len(r.prefix_pages) + ["current"] * len(r.current_pages)]
    assert kinds == expected
    # each slot (built on first use) is its page: owner / writer, pool id, compact index, tokens, slot number
    want = []
    for r in L.requests:
        for k, pp in enumerate(r.prefix_pages):
            want.append((r.slot_start + k, r.index, "prefix", pp.owner, pp.page_id, -1, k * page_size,
                         min((k + 1) * page_size, r.prefix_len)))
        for c in r.current_pages:
            want.append((r.current_slot_start + c.index, r.index, "current", c.writer, -1, c.compact, c.start, c.end))
    assert [tuple(p) for p in L.logical_pages] == want and L.num_slots == len(want)
    assert L.num_prefix_pages == sum(len(r.prefix_pages) for r in L.requests)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cp_larger_than_pages(strategy):
    L = build_layout([(0, 130)], page_size=64, cp=8, strategy=strategy)
    check_invariants(L)
    assert L.num_current == 3
    assert sum(len(x) for x in L.rank_current) == 3


def test_zigzag_balance_64k_cp8():
    L = build_layout([(0, 65536)], page_size=64, cp=8)
    assert L.balance() <= 1.1
    contiguous = build_layout([(0, 65536)], page_size=64, cp=8, strategy="contiguous")
    assert contiguous.balance() > 1.5  # the reason zigzag exists


def test_zigzag_runs_pair_ranks():
    assert split_writers(8, 2, "zigzag", 0) == [0, 0, 1, 1, 1, 1, 0, 0]
    assert split_writers(6, 3, "contiguous", 0) == [0, 0, 1, 1, 2, 2]
    assert split_writers(5, 3, "round-robin", 1) == [1, 2, 0, 1, 2]
    assert split_writers(3, 2, "zigzag", 0) == [0, 1, 0]      # extras go to runs 0, 1, 3 (ranks 0, 1, 0)
    assert split_writers(2, 2, "zigzag", 3) == [0, 1]         # then runs 2, 0 (ranks 1, 0), in page order


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_short_requests_spread_over_ranks(strategy):
    L = build_layout([(0, 10)] * 8, page_size=64, cp=4, strategy=strategy)
    assert [len(x) for x in L.rank_current] == [2, 2, 2, 2]


def test_exact_pages_and_slots():
    L = build_layout([(128, 100), (0, 5)], page_size=64, cp=2, prefix_pages=[[(1, 7), (0, 3)], []])
    r0, r1 = L.requests
    assert [(p.owner, p.page_id) for p in r0.prefix_pages] == [(1, 7), (0, 3)]
    assert [(c.start, c.end) for c in r0.current_pages] == [(128, 192), (192, 228)]
    assert (r0.slot_start, r0.slot_end, r1.slot_start, r1.slot_end) == (0, 4, 4, 5)
    assert [p.kind for p in L.logical_pages] == ["prefix", "prefix", "current", "current", "current"]
    assert causal_work(0, 3) == 6


def test_unaligned_prefix_only_alone():
    L = build_layout([(100, 50)], page_size=64, cp=2)
    check_invariants(L)
    assert len(L.requests[0].prefix_pages) == 2
    assert L.requests[0].key_row(99, 64) == 99
    assert L.requests[0].key_row(100, 64) == 2 * 64
    with pytest.raises(LayoutError, match="request 1: prefix_len 100"):
        build_layout([(64, 1), (100, 50)], page_size=64, cp=2)


@pytest.mark.parametrize("reqs,err,match", [
    ([(0, 0)], LayoutError, "extend_len must be an integer >= 1"),
    ([(-64, 5)], LayoutError, "prefix_len must be an integer >= 0"),
    ([], LayoutError, "at least one request"),
    ([(0, 5000)], LayoutError, "exceed the maximum context of 4096"),
])
def test_bad_requests(reqs, err, match):
    with pytest.raises(err, match=match):
        build_layout(reqs, page_size=64, cp=2, max_context=4096)


@pytest.mark.parametrize("kw,match", [
    (dict(page_size=48, cp=2), "power of two"),
    (dict(page_size=64, cp=0), "cp must be"),
    (dict(page_size=64, cp=2, strategy="spiral"), "unknown split strategy"),
])
def test_bad_setup(kw, match):
    with pytest.raises(ConfigError, match=match):
        build_layout([(0, 10)], **kw)


def test_bad_prefix_pages():
    with pytest.raises(LayoutError, match="expected 2 prefix pages, got 1"):
        build_layout([(128, 1)], page_size=64, cp=2, prefix_pages=[[(0, 1)]])
    with pytest.raises(LayoutError, match="page 0 is reserved"):
        build_layout([(64, 1)], page_size=64, cp=2, prefix_pages=[[(0, 0)]])
    with pytest.raises(LayoutError, match="owner must be in"):
        build_layout([(64, 1)], page_size=64, cp=2, prefix_pages=[[(2, 1)]])
