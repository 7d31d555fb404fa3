from __future__ import annotations

import pytest

from cpkv.config import AdmissionCaps, CPConfig, PRESETS
from cpkv.errors import AdmissionError
from cpkv.kvcache import KVCacheManager, PageAllocator
from cpkv.layout import cdiv, check_invariants
from cpkv.scheduler import Admitted, PrefillAdder, Rejected, Request, Scheduler, Status

P = 4
TINY = PRESETS["tiny"]


def make(cp=2, pages=64, policy="solo", full_hit="page", replicated=False, **caps):
    kw = dict(chunk_size=16, max_requests=4)
    kw.update(caps)
    allocs = [PageAllocator(pages, f"rank{r}") for r in range(1 if replicated else cp)]
    kv = KVCacheManager(P, allocs)
    sched = Scheduler(kv, AdmissionCaps(**kw), model=TINY, cp=CPConfig(cp, P), policy=policy,
                      full_hit=full_hit, replicated=replicated)
    return sched, kv.tree, allocs


def req(rid, tokens):
    return Request(rid, list(tokens), len(tokens))


def toks(base, n):
    return list(range(base, base + n))


def run_all(sched):
    """Drive the scheduler to the end; returns [[(id, prefix, extend, chunked, last)], ...] per batch."""
    out = []
    while sched.has_work:
        batch = sched.next_batch()
        if batch is None:
            break
        check_invariants(batch.layout())
        out.append([(e.rid, e.prefix_len, e.extend_len, e.chunked, e.last_chunk) for e in batch.entries])
        sched.postprocess(batch)
    return out


def assert_clean(cache, allocs):
    """No page leaked: every used page belongs to the tree, nothing stays locked."""
    assert sum(a.num_used for a in allocs) == cache.num_device_pages
    assert cache.evictable_pages() == cache.num_device_pages


def test_short_requests_share_a_batch_and_later_turns_hit():
    sched, cache, allocs = make()
    a, b = toks(100, 10), toks(200, 6)
    sched.add(req("a", a))
    sched.add(req("b", b))
    assert run_all(sched) == [[("a", 0, 10, False, True), ("b", 0, 6, False, True)]]
    sched.add(req("a2", a + [7, 7, 7]))  # next turn: history (2 full pages cached) + new tokens
    assert run_all(sched) == [[("a2", 8, 5, False, True)]]
    assert_clean(cache, allocs)


def test_entry_writers_and_pages_match_the_layout():
    sched, cache, allocs = make(cp=3)
    for i, n in enumerate((9, 13, 5)):
        sched.add(req(i, toks(100 * i, n)))
    batch = sched.next_batch()
    lay = batch.layout()
    assert [c.writer for c in lay.current_pages] == [w for e in batch.entries for w in e.writers]
    for e in batch.entries:
        assert len(e.pages) == cdiv(e.extend_len, P)
        assert [o for o, _ in e.pages] == list(e.writers)  # shared KV: the writer owns its page
        assert all(allocs[o].refcount(p) == 1 for o, p in e.pages)


def test_budget_seeded_with_true_carried_prefix():
    sched, cache, allocs = make()
    hist = toks(100, 8)
    sched.add(req("h", hist))
    run_all(sched)
    sched.add(req("long", hist + toks(500, 40)))  # 8 cached, 40 new: chunks of 16, 16, 8
    got = run_all(sched)
    assert got == [[("long", 8, 16, True, False)], [("long", 24, 16, True, False)], [("long", 40, 8, True, True)]]
    r = [e for b in got for e in b]
    assert all(p == 8 + sum(x[2] for x in r[:i]) for i, (_, p, *_) in enumerate(r))
    assert_clean(cache, allocs)


def test_seeded_prefix_counts_against_the_cached_cap_of_followers():
    # mix: A's tail chunk carries 32 tokens; follower B carries 8 cached tokens: 40 in all.
    def scenario(cached_cap):
        sched, cache, allocs = make(policy="mix", cached_tokens=cached_cap)
        sched.add(req("b0", toks(900, 8)))
        run_all(sched)
        sched.add(req("A", toks(100, 36)))
        sched.add(req("B", toks(900, 8) + [1, 2]))
        return run_all(sched)
    assert scenario(40)[-1] == [("A", 32, 4, True, True), ("B", 8, 2, False, True)]
    assert scenario(39)[-2:] == [[("A", 32, 4, True, True)], [("B", 8, 2, False, True)]]


def test_tail_chunk_admits_followers_only_under_mix():
    def scenario(policy):
        sched, cache, allocs = make(policy=policy)
        sched.add(req("A", toks(100, 36)))
        sched.add(req("B", toks(300, 5)))
        sched.add(req("C", toks(400, 3)))
        out = run_all(sched)
        assert_clean(cache, allocs)
        return out
    assert scenario("solo") == [
        [("A", 0, 16, True, False)], [("A", 16, 16, True, False)], [("A", 32, 4, True, True)],
        [("B", 0, 5, False, True), ("C", 0, 3, False, True)]]
    assert scenario("mix") == [
        [("A", 0, 16, True, False)], [("A", 16, 16, True, False)],
        [("A", 32, 4, True, True), ("B", 0, 5, False, True), ("C", 0, 3, False, True)]]


def test_full_chunk_stays_alone_under_mix():
    sched, cache, allocs = make(policy="mix")
    sched.add(req("B", toks(300, 5)))
    sched.add(req("A", toks(100, 32)))   # exactly two full chunks: no tail to share
    sched.add(req("C", toks(400, 3)))
    assert run_all(sched) == [[("B", 0, 5, False, True)], [("A", 0, 16, True, False)],
                              [("A", 16, 16, True, True)], [("C", 0, 3, False, True)]]
    adder = PrefillAdder(sched.adm, sched.kv)
    assert isinstance(adder.try_add(req("D", toks(600, 3))), Admitted)
    res = adder.try_add(req("E", toks(700, 40)))
    assert isinstance(res, Rejected) and res.reason == "solo" and not res.permanent


@pytest.mark.parametrize("policy", ["solo", "mix"])
def test_unaligned_prefix_runs_alone(policy):
    sched, cache, allocs = make(policy=policy, full_hit="token")
    a = toks(100, 8)
    sched.add(req("a", a))
    run_all(sched)
    sched.add(req("a-again", a))          # whole prompt cached: recompute the last token only
    sched.add(req("c", toks(400, 3)))
    assert run_all(sched) == [[("a-again", 7, 1, False, True)], [("c", 0, 3, False, True)]]
    assert_clean(cache, allocs)
    adder = PrefillAdder(sched.adm, sched.kv)
    assert isinstance(adder.try_add(req("d", toks(600, 3))), Admitted)
    res = adder.try_add(req("a-third", a))
    assert isinstance(res, Rejected) and res.reason == "solo"


def test_full_hit_page_mode_recomputes_the_last_page_and_stays_aligned():
    sched, cache, allocs = make()
    a = toks(100, 8)
    sched.add(req("a", a))
    run_all(sched)
    sched.add(req("a-again", a))
    sched.add(req("c", toks(400, 3)))
    assert run_all(sched) == [[("a-again", 4, 4, False, True), ("c", 0, 3, False, True)]]
    assert_clean(cache, allocs)


def test_caps_name_the_reason():
    sched, cache, allocs = make(max_requests=2, cached_tokens=10)
    sched.add(req("h", toks(100, 8)))
    run_all(sched)
    adder = PrefillAdder(sched.adm, sched.kv)
    assert isinstance(adder.try_add(req("x", toks(200, 10))), Admitted)
    assert adder.try_add(req("y", toks(300, 7))).reason == "chunk_size"
    assert isinstance(adder.try_add(req("z", toks(100, 8) + [1])), Admitted)   # 8 cached tokens
    assert adder.try_add(req("w", toks(400, 1))).reason == "max_requests"
    adder = PrefillAdder(sched.adm, sched.kv)
    assert isinstance(adder.try_add(req("z2", toks(100, 8) + [2])), Admitted)
    assert adder.try_add(req("z3", toks(100, 8) + [3])).reason == "cached_tokens"


def test_buffer_cap_admits_followers_within_bytes():
    # mix: the tail chunk of A, then followers while dense + staging + logits bytes stay within the cap
    probe, _, _ = make(policy="mix")
    one = probe.adm.buffer_bytes(cdiv(36, P) + 2, 6)   # A's tail (9 slots) + one 5-token follower (2 slots)
    assert probe.adm.buffer_bytes(cdiv(36, P) + 4, 6) > one

    def setup():
        sched, cache, _ = make(policy="mix", buffer_bytes=one + 1)
        for rid, base, n in (("A", 100, 36), ("B", 300, 5), ("C", 400, 5)):
            sched.add(req(rid, toks(base, n)))
        for _ in range(2):
            sched.postprocess(sched.next_batch())
        return sched, cache

    sched, cache = setup()
    adder = PrefillAdder(sched.adm, sched.kv)
    assert isinstance(adder.try_add(sched._resume), Admitted)
    assert isinstance(adder.try_add(sched.waiting[0]), Admitted)
    res = adder.try_add(sched.waiting[1])
    assert isinstance(res, Rejected) and res.reason == "buffer_bytes" and not res.permanent

    sched, cache = setup()
    b3 = sched.next_batch()
    assert [e.rid for e in b3.entries] == ["A", "B"]
    rows = max(b3.layout().query_tokens(r) for r in range(2))
    assert sched.adm.buffer_bytes(b3.num_slots, rows) <= one + 1
    sched.postprocess(b3)
    assert run_all(sched) == [[("C", 0, 5, False, True)]]


def test_page_tail_split_of_the_tail_chunk_under_mix():
    sched, cache, allocs = make(cp=2, policy="mix")
    sched.add(req("A", toks(100, 38)))    # chunks 16, 16, 6: the tail ends in a half page
    sched.add(req("B", toks(300, 7)))
    for _ in range(2):
        sched.postprocess(sched.next_batch())
    batch = sched.next_batch()
    lay = batch.layout()
    check_invariants(lay)
    a, b = lay.requests
    assert [(c.start, c.end) for c in a.current_pages] == [(32, 36), (36, 38)]
    assert [(c.start, c.end) for c in b.current_pages] == [(0, 4), (4, 7)]
    assert b.slot_start == a.slot_end                       # B starts on a fresh page after A's tail
    assert lay.num_current <= sched.adm.staging_pages      # one slack page per request covers the tails
    tail = batch.entries[0].pages[-1]
    sched.postprocess(batch)
    owner, pid = tail
    assert allocs[owner].refcount(pid) == 0                 # the partial page is not cached
    assert cache.match(toks(100, 38)).num_tokens == 36
    assert cache.match(toks(300, 7)).num_tokens == 4
    assert_clean(cache, allocs)


def test_staging_identity_checked():
    allocs = [PageAllocator(16) for _ in range(2)]
    kv = KVCacheManager(P, allocs)
    caps = AdmissionCaps(chunk_size=16, max_requests=4)
    Scheduler(kv, caps, model=TINY, cp=CPConfig(2, P), staging_pages=16 // P + 4)
    with pytest.raises(AdmissionError, match="staging identity"):
        Scheduler(kv, caps, model=TINY, cp=CPConfig(2, P), staging_pages=16 // P)


def test_configuration_errors():
    allocs = [PageAllocator(16) for _ in range(2)]
    caps = AdmissionCaps(chunk_size=16)
    with pytest.raises(AdmissionError, match="policy"):
        Scheduler(KVCacheManager(P, allocs), caps, model=TINY, cp=CPConfig(2, P), policy="greedy")
    with pytest.raises(AdmissionError, match="allocators"):
        Scheduler(KVCacheManager(P, allocs), caps, model=TINY, cp=CPConfig(4, P))
    with pytest.raises(AdmissionError, match="page size"):
        Scheduler(KVCacheManager(2, allocs), caps, model=TINY, cp=CPConfig(2, P))
    sched = Scheduler(KVCacheManager(P, allocs), caps, model=TINY, cp=CPConfig(2, P))
    with pytest.raises(AdmissionError, match="keys"):
        sched.add(Request("x", [1, 2], 3))


def test_impossible_requests_are_rejected_not_blocking():
    sched, cache, allocs = make(pages=8)   # 7 pages per rank, 14 in all = 56 tokens
    sched.add(req("ok1", toks(100, 5)))
    assert sched.add(req("huge", toks(0, 60))).reason == "pool_pages"
    assert sched.add(Request("long", list(range(TINY.max_context + 1)), TINY.max_context + 1)).reason == "max_context"
    sched.add(req("ok2", toks(200, 5)))
    assert run_all(sched) == [[("ok1", 0, 5, False, True), ("ok2", 0, 5, False, True)]]
    assert {r.rid for r in sched.rejected} == {"huge", "long"}
    assert all(r.status is Status.REJECTED and r.reason for r in sched.rejected)


def test_writer_rank_short_of_pages_is_rejected_when_alone():
    # 3 pages per rank, 6 in all; 2 chunks of 3 pages split [0, 1, 1] each: rank 1 would need 4
    sched, cache, allocs = make(pages=4, chunk_size=12)
    sched.add(req("big", toks(100, 24)))
    sched.add(req("small", toks(300, 3)))
    out = run_all(sched)
    assert out[-1] == [("small", 0, 3, False, True)]
    big = [r for r in sched.rejected if r.rid == "big"]
    assert big and big[0].reason.startswith("pages")
    assert_clean(cache, allocs)


def test_eviction_makes_room_lru_first():
    sched, cache, allocs = make(pages=5)   # 4 pages per rank
    sched.add(req("old", toks(100, 16)))
    run_all(sched)
    sched.add(req("new", toks(200, 16)))
    run_all(sched)
    sched.add(req("newer", toks(300, 16)))   # needs 2 pages per rank: evicts the least recent
    run_all(sched)
    assert cache.match(toks(100, 16)).num_tokens == 0
    assert cache.match(toks(200, 16)).num_tokens == 16
    assert cache.match(toks(300, 16)).num_tokens == 16
    assert_clean(cache, allocs)


def test_replicated_kv_uses_one_pool():
    sched, cache, allocs = make(replicated=True, cp=4)
    sched.add(req("a", toks(100, 30)))
    batch = sched.next_batch()
    e = batch.entries[0]
    assert {o for o, _ in e.pages} == {0} and set(e.writers) == {0, 1, 2, 3}
    sched.postprocess(batch)
    run_all(sched)
    assert cache.match(toks(100, 30)).num_tokens == 28
    assert_clean(cache, allocs)


def test_next_batch_requires_finish():
    sched, _, _ = make()
    sched.add(req("a", toks(100, 5)))
    batch = sched.next_batch()
    with pytest.raises(AdmissionError, match="in flight"):
        sched.next_batch()
    sched.postprocess(batch)
    with pytest.raises(AdmissionError, match="not the batch in flight"):
        sched.postprocess(batch)


def test_scheduler_package_imports_no_torch():
    import subprocess
    import sys
    code = ("import sys, cpkv.scheduler, cpkv.cli.replay_cmd, cpkv.scheduler.replay; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = {"PYTHONPATH": __file__.rsplit("/tests/", 1)[0] + "/src"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr


def test_host_tier_spills_through_the_hook_and_admits_the_device_run():
    allocs = [PageAllocator(5, f"rank{r}") for r in range(2)]     # 4 pages per rank
    caps = AdmissionCaps(chunk_size=16, max_requests=4)
    with pytest.raises(AdmissionError, match="on_spill"):
        KVCacheManager(P, allocs, host_pages=8)
    spilled = []
    kv = KVCacheManager(P, allocs, host_pages=8, on_spill=lambda o, p, s: spilled.append((o, p, s)))
    cache = kv.tree
    sched = Scheduler(kv, caps, model=TINY, cp=CPConfig(2, P))
    sched.add(req("old", toks(100, 16)))
    run_all(sched)
    sched.add(req("new", toks(200, 16)))
    run_all(sched)
    sched.add(req("newer", toks(300, 16)))   # evicts "old" (LRU) to the host tier through the hook
    run_all(sched)
    assert len(spilled) >= 2
    m = cache.match(toks(100, 16))
    assert m.num_tokens == 16 and m.host_nodes
    sched.add(req("old2", toks(100, 16) + [1]))
    batch = sched.next_batch()
    e = batch.entries[0]
    assert e.prefix_len == P * next(i for i, n in enumerate(m.nodes) if not n.on_device)
    sched.postprocess(batch)


def test_try_add_refuses_misuse():
    sched, cache, _ = make()
    adder = PrefillAdder(sched.adm, sched.kv)
    r = req("a", toks(100, 5))
    assert isinstance(adder.try_add(r), Admitted)
    with pytest.raises(AdmissionError, match="already in this batch"):
        adder.try_add(r)
