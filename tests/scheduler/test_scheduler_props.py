"""Invariants of admission over random queues and caps (hypothesis)."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpkv.config import AdmissionCaps, CPConfig, PRESETS
from cpkv.kvcache import KVCacheManager, PageAllocator
from cpkv.layout import check_invariants
from cpkv.scheduler import Request, Scheduler, Status

P = 4
TINY = PRESETS["tiny"]

config = st.fixed_dictionaries({
    "cp": st.integers(1, 3),
    "pages": st.one_of(st.integers(3, 40), st.just(400)),
    "extend_tokens": st.one_of(st.integers(1, 40), st.just(32)),
    "chunk_size": st.one_of(st.integers(1, 40), st.just(32)),
    "cached_tokens": st.one_of(st.integers(1, 120), st.integers(20, 60)),
    "max_requests": st.one_of(st.integers(1, 5), st.just(4)),
    "buffer_bytes": st.one_of(st.just(1 << 40), st.integers(5_000, 60_000)),
    "policy": st.sampled_from(["solo", "mix"]),
    "full_hit": st.sampled_from(["page", "token"]),
})
# (parent: index of an earlier request or None, new tokens, batches to run after adding it); the first
# ``warm`` requests are run to the end before the others arrive, so that many of those hit the cache.
queue = st.tuples(
    st.integers(0, 4),
    st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 20)), st.one_of(st.integers(0, 6), st.integers(0, 40)),
                       st.sampled_from([0, 0, 0, 1, 2])), min_size=1, max_size=12))


def build(cfg):
    allocs = [PageAllocator(cfg["pages"], f"rank{r}") for r in range(cfg["cp"])]
    kv = KVCacheManager(P, allocs)
    caps = AdmissionCaps(min(cfg["extend_tokens"], cfg["chunk_size"]), cfg["cached_tokens"], cfg["buffer_bytes"],
                         cfg["max_requests"])
    sched = Scheduler(kv, caps, model=TINY, cp=CPConfig(cfg["cp"], P), policy=cfg["policy"],
                      full_hit=cfg["full_hit"], staging_pages=caps.staging_pages(P))
    return sched, kv.tree, allocs


def prompts(items):
    items = items[1]
    out, fresh = [], 10_000
    for parent, new, _ in items:
        base = out[parent % len(out)] if parent is not None and out else []
        n = new if base else max(new, 1)
        out.append(base + list(range(fresh, fresh + n)))
        fresh += n
    return out


def check_batch(sched, batch, started):
    adm, caps = sched.adm, sched.adm.caps
    lay = batch.layout()
    check_invariants(lay)
    assert [c.writer for c in lay.current_pages] == [w for e in batch.entries for w in e.writers]
    assert len(batch.entries) <= caps.max_requests
    assert batch.extend_tokens <= adm.chunk_tokens
    assert batch.prefix_tokens <= caps.cached_tokens
    rows = max(lay.query_tokens(r) for r in range(adm.cp))
    assert adm.buffer_bytes(batch.num_slots, rows) <= caps.buffer_bytes
    assert lay.num_current <= adm.staging_pages
    for i, e in enumerate(batch.entries):
        r = e.request
        assert e.prefix_len == (r.cached if e.request.rid not in started else started[r.rid])
        started[r.rid] = e.prefix_len + e.extend_len
        if not e.last_chunk:
            assert e.chunked and e.seq_len % P == 0 and e.extend_len == adm.chunk_tokens
        alone = e.prefix_len % P or (e.chunked and (adm.policy == "solo" or not e.last_chunk))
        if alone:
            assert len(batch.entries) == 1
        if e.chunked:
            assert i == 0


def drive(cfg, queue_):
    warm, items = queue_
    sched, cache, allocs = build(cfg)
    reqs = [Request(i, toks, len(toks)) for i, toks in enumerate(prompts(queue_))]
    log, started, first = [], {}, []
    for k, (req, (_, _, steps)) in enumerate(zip(reqs, items)):
        sched.add(req)
        if k + 1 == warm:
            steps = 10 ** 6
        for _ in range(steps):
            batch = sched.next_batch()
            if batch is None:
                break
            log.append(step(sched, batch, started, first))
    while sched.has_work:
        batch = sched.next_batch()
        if batch is None:
            break
        log.append(step(sched, batch, started, first))
    return sched, cache, allocs, reqs, log, first


def step(sched, batch, started, first):
    for e in batch.entries:
        if e.request.rid not in started:
            first.append(e.request.rid)
    check_batch(sched, batch, started)
    out = [(e.rid, e.prefix_len, e.extend_len, e.pages) for e in batch.entries]
    sched.postprocess(batch)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config, queue)
def test_caps_hold_everything_completes_fifo(cfg, items):
    sched, cache, allocs, reqs, log, first = drive(cfg, items)
    assert not sched.has_work
    for r in reqs:
        assert r.status in (Status.FINISHED, Status.REJECTED)
        assert (r.status is Status.REJECTED) == bool(r.reason)
    assert first == sorted(first)                              # FIFO: requests start in arrival order
    assert sum(a.num_used for a in allocs) == cache.num_device_pages   # no page leaked
    assert cache.evictable_pages() == cache.num_device_pages           # nothing left locked
    assert drive(cfg, items)[4] == log                          # deterministic, page ids included


@settings(max_examples=60, deadline=None)
@given(config, queue)
def test_nothing_rejected_when_caps_are_loose(cfg, items):
    total = sum(len(t) for t in prompts(items))
    cfg = {**cfg, "buffer_bytes": 1 << 40, "cached_tokens": 10_000, "pages": total + 2}
    sched, cache, allocs, reqs, log, first = drive(cfg, items)
    assert all(r.status is Status.FINISHED for r in reqs)
    assert first == list(range(len(reqs)))
