"""The paged decode bookkeeping (cpkv.scheduler.decode, no torch): a kept last chunk hands its pages to the
Decoder, steps take fresh tail pages on rotating owners, filled pages enter the prefix cache, a finished generation
leaves its full pages cached and frees its tail; exact page ids."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpkv.config import PRESETS, AdmissionCaps, CPConfig
from cpkv.kvcache import KVCacheManager, PageAllocator
from cpkv.scheduler import Request, Scheduler
from cpkv.scheduler.decode import Decoder

P = 4


def make(cp=2, pages=8, full_hit="page"):
    allocs = [PageAllocator(pages, f"rank{r}") for r in range(cp)]
    kv = KVCacheManager(P, allocs)
    sched = Scheduler(kv, AdmissionCaps(chunk_size=16, max_requests=4), model=PRESETS["tiny"], cp=CPConfig(cp, P),
                      full_hit=full_hit)
    return sched, kv, allocs, Decoder(kv, cp, P)


def prefill(sched, rid, tokens, keep=True):
    req = Request(rid, list(tokens), len(tokens))
    req.keep = keep
    sched.add(req)
    batch = sched.next_batch()
    assert sched.postprocess(batch) == [req]
    return req, batch.entries[0]


def test_a_kept_last_chunk_holds_its_full_pages_and_keeps_its_tail():
    sched, kv, allocs, _ = make()
    req, e = prefill(sched, "a", range(10))  # pages [0, 4) [4, 8) full, [8, 10) the tail
    assert req.keep and req.prefix.pages == e.pages[:2] and req.tail == e.pages[2:]
    assert sum(a.num_used for a in allocs) == 3  # nothing released
    assert kv.tree.match(list(range(10))).nodes[0].lock == 1  # held for the decoder


def test_an_unkept_last_chunk_releases_its_tail_as_before():
    sched, kv, allocs, _ = make()
    req, _ = prefill(sched, "a", range(10), keep=False)
    assert req.tail == () and len(req.prefix) == 0 and sum(a.num_used for a in allocs) == 2


def test_steps_fill_the_tail_then_take_a_fresh_page_on_the_next_owner():
    sched, kv, allocs, dec = make()
    tokens = list(range(10))
    req, e = prefill(sched, "a", tokens)
    tokens.append(100)  # the prefill's token: its KV comes with the first decode step
    dec.start("a", tokens, req.prefix, req.tail)
    table: dict[int, tuple[int, int]] = {}  # the page table as the steps' changes write it
    seen = []
    for t in range(101, 108):
        step, failed = dec.plan()
        assert not failed and len(step.entries) == 1
        entry = step.entries[0]
        assert entry.token == tokens[entry.position] and entry.position == len(tokens) - 1 and entry.slot == 0
        table.update({i: (o, p) for i, o, p in entry.changes})
        assert [table[i] for i in range(len(table))] == list(dec.seqs["a"].pages)
        assert (entry.owner, entry.page) == table[entry.position // P]
        seen.append(([i for i, _, _ in entry.changes], (entry.owner, entry.page)))
        tokens.append(t)
        dec.advance("a")
    # positions 10, 11 fill the prefill's tail page (the first step writes the whole table); 12..15 a fresh page on
    # rank (spread 0 + page 3) % 2 = 1, 16 one on rank 0; only a fresh page is a change
    assert [c for c, _ in seen] == [[0, 1, 2], [], [3], [], [], [], [4]]
    assert [p for _, p in seen[:2]] == [e.pages[2]] * 2
    assert {p[0] for _, p in seen[2:6]} == {1} and seen[6][1][0] == 0
    assert dec.seqs["a"].length == 17 and len(dec.seqs["a"].prefix) == 4  # 16 tokens in 4 cached pages
    assert [n.page_id for n in kv.tree.match(tokens[:16]).nodes] == [p for _, p in dec.seqs["a"].prefix.pages]
    dec.finish("a")
    assert sum(a.num_used for a in allocs) == 4  # the tail page freed, the full pages cached
    assert all(n.lock == 0 for n in kv.tree.match(tokens[:16]).nodes)


def test_a_filled_page_the_cache_already_holds_is_swapped_for_its_twin_in_the_table():
    sched, kv, allocs, dec = make()
    tokens = list(range(6))
    req, _ = prefill(sched, "a", tokens)  # page [0, 4) full, [4, 6) the tail
    tokens.append(6)
    dec.start("a", tokens, req.prefix, req.tail)
    prefill(sched, "b", list(range(8)), keep=False)  # caches the page of tokens [4, 8) first
    twin = kv.match(list(range(8))).pages[1]
    for t in (7, 8):
        step, _ = dec.plan()
        tokens.append(t)
        dec.advance("a")
    assert dec.seqs["a"].prefix.pages[1] == twin  # ours went back to its allocator
    step, _ = dec.plan()
    assert step.entries[0].changes[0] == (1, *twin) and [i for i, _, _ in step.entries[0].changes] == [1, 2]


def test_slots_are_reused_lowest_first():
    sched, kv, _, dec = make(pages=16)
    for rid in "abc":
        req, _ = prefill(sched, rid, [ord(rid)] * 3)
        dec.start(rid, [ord(rid)] * 4, req.prefix, req.tail)
    dec.finish("b")
    dec.finish("a")
    req, _ = prefill(sched, "d", [9] * 3)
    dec.start("d", [9] * 4, req.prefix, req.tail)
    assert {r: s.slot for r, s in dec.seqs.items()} == {"c": 2, "d": 0} and dec.slots == 3


def test_concurrent_generations_spread_over_ranks_and_a_short_pool_fails_only_its_generation():
    sched, kv, allocs, dec = make(pages=3)  # 2 pages per rank (page 0 reserved)
    seqs = {}
    for rid, base in (("a", 0), ("b", 50)):
        toks = list(range(base, base + 4))
        req, e = prefill(sched, rid, toks)  # one full page each, no tail: both on rank 0 (one page: zigzag's first)
        assert e.pages[0][0] == 0 and req.tail == ()
        seqs[rid] = toks + [base + 40]
        dec.start(rid, seqs[rid], req.prefix, req.tail)
    step, failed = dec.plan()  # a (spread 0) -> rank 1; b (spread 1) -> rank 0, whose two pages are held
    assert [(e.rid, e.owner) for e in step.entries] == [("a", 1)] and step.counts() == [0, 1]
    assert [rid for rid, _ in failed] == ["b"] and "rank 0" in failed[0][1]
    assert list(dec.seqs) == ["a"] and kv.tree.match(seqs["b"][:4]).nodes[0].lock == 0  # b's page unheld
    assert [a.num_used for a in allocs] == [2, 1]


def test_a_full_context_fails_only_its_generation():
    sched, kv, allocs, dec = make()
    dec.max_context = 7
    for rid, n in (("a", 6), ("b", 3)):
        toks = [ord(rid) * 10 + i for i in range(n)]
        req, _ = prefill(sched, rid, toks)
        dec.start(rid, toks + [0], req.prefix, req.tail)
    step, failed = dec.plan()  # a: its token at position 6, the context's last
    assert [e.rid for e in step.entries] == ["a", "b"] and not failed
    for e in step.entries:
        dec.seqs[e.rid].tokens.append(1)
        dec.advance(e.rid)
    step, failed = dec.plan()
    assert [e.rid for e in step.entries] == ["b"] and failed == [("a", "max_context: the model's context of 7 "
                                                                 "tokens is full")]


def test_starting_twice_or_with_a_wrong_length_is_refused():
    sched, kv, _, dec = make()
    req, _ = prefill(sched, "a", range(6))
    with pytest.raises(ValueError, match="do not fit"):
        dec.start("a", list(range(20)), req.prefix, req.tail)
    dec.start("a", list(range(7)), req.prefix, req.tail)
    with pytest.raises(ValueError, match="already decoding"):
        dec.start("a", list(range(7)), req.prefix, req.tail)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cp=st.integers(1, 3), pages=st.integers(4, 14),
       ops=st.lists(st.tuples(st.sampled_from(["start", "step", "step", "step", "finish"]), st.integers(0, 50)),
                    max_size=60))
def test_random_generations_keep_the_pages_and_the_table_consistent(cp, pages, ops):
    """Over random starts, steps (with pool pressure) and finishes: the table written only from the steps' changes
    is every generation's page table; a step's token page is its owner's; every device page is cached, a tail, or
    free, never two of them; once all finish, no page is held and no tail is left."""
    sched, kv, allocs, dec = make(cp=cp, pages=pages)
    table: dict[int, dict[int, tuple[int, int]]] = {}
    n = 0
    for op, x in ops:
        if op == "start":
            toks = [n * 1000 + x + i for i in range(x % 9 + 1)]
            req = Request(n, toks, len(toks))
            req.keep = True
            if sched.add(req) is not None:
                continue
            batch = sched.next_batch()
            if batch is None:
                sched.cancel(req)
                continue
            sched.postprocess(batch)
            dec.start(n, toks + [x], req.prefix, req.tail)
            n += 1
        elif op == "step":
            step, failed = dec.plan()
            for e in step.entries if step is not None else ():
                row = table.setdefault(e.slot, {})
                row.update({i: (o, p) for i, o, p in e.changes})
                seq = dec.seqs[e.rid]
                assert [row[i] for i in range(len(seq.pages))] == list(seq.pages)
                assert (e.owner, e.page) == seq.pages[e.position // P] == seq.tail
                seq.tokens.append(x)
                dec.advance(e.rid)
        elif dec.seqs:
            dec.finish(sorted(dec.seqs)[x % len(dec.seqs)])
        tails = [s.tail for s in dec.seqs.values() if s.tail is not None]
        assert len(set(tails)) == len(tails)
        cached = {(nd.owner, nd.page_id) for nd in _nodes(kv.tree) if nd.page_id >= 1}
        assert not cached & set(tails)
        assert sum(a.num_used for a in allocs) == len(cached) + len(tails)
    for rid in list(dec.seqs):
        dec.finish(rid)
    assert all(nd.lock == 0 for nd in _nodes(kv.tree))
    assert sum(a.num_used for a in allocs) == len([nd for nd in _nodes(kv.tree) if nd.page_id >= 1])


def _nodes(tree):
    out, todo = [], list(tree.root.children.values())
    while todo:
        nd = todo.pop()
        out.append(nd)
        todo.extend(nd.children.values())
    return out
