"""The scheduler's online verbs: decode steps queue before new prompts and get a turn between the chunks of a long
prompt (a decode waits at most one chunk), and ``cancel`` takes a request out, dropping what it holds."""
from __future__ import annotations

import pytest

from cpkv.config import PRESETS, AdmissionCaps, CPConfig
from cpkv.errors import AdmissionError
from cpkv.kvcache import KVCacheManager, PageAllocator
from cpkv.scheduler import Request, Scheduler, Status

P = 4


def make(policy="solo", pages=64, **caps):
    kw = dict(chunk_size=16, max_requests=4)
    kw.update(caps)
    allocs = [PageAllocator(pages, f"rank{r}") for r in range(2)]
    kv = KVCacheManager(P, allocs)
    return Scheduler(kv, AdmissionCaps(**kw), model=PRESETS["tiny"], cp=CPConfig(2, P), policy=policy), kv, allocs


def req(rid, tokens):
    return Request(rid, list(tokens), len(tokens))


def step(sched):
    """Run one batch: its (id, prefix, extend) entries; finished requests are returned too."""
    batch = sched.next_batch()
    if batch is None:
        return None, []
    entries = [(e.rid, e.prefix_len, e.extend_len) for e in batch.entries]
    return entries, sched.postprocess(batch)


def test_decode_steps_go_before_new_prompts():
    sched, kv, _ = make(max_requests=2)
    sched.add(req("new", range(100, 106)))
    sched.add(req("d", range(200, 205)), decode=True)
    entries, _ = step(sched)
    assert [e[0] for e in entries] == ["d", "new"]


def test_running_decodes_never_starve_a_chunked_prompt():
    """A chunked prompt cannot share a batch (solo); decode steps re-queued every batch still let it in next."""
    sched, kv, _ = make()
    sched.add(req("long", range(1000, 1040)))  # 40 tokens: 3 chunks of 16
    order = []
    for k in range(6):
        sched.add(req(f"d{k}", range(10 * k, 10 * k + 6)), decode=True)  # a running generation's next step
        entries, _ = step(sched)
        order.append([e[0] for e in entries])
    assert order[0] == ["d0"] and order[1] == ["long"]  # led by decode steps, then by the waiting prompt
    assert order[2:] == [["d1", "d2"], ["long"], ["d3", "d4"], ["long"]]


@pytest.mark.parametrize("policy", ["solo", "mix"])
def test_a_long_prefill_stalls_a_decode_by_at_most_one_chunk(policy):
    """A 5-chunk prompt runs; decode steps arriving meanwhile each run right after the chunk in flight."""
    sched, kv, allocs = make(policy=policy)
    sched.add(req("long", range(1000, 1080)))  # 80 tokens: 5 chunks of 16
    order = []
    for k in range(8):
        if k in (1, 2, 4):  # a decode step arrives while chunk k-1 ran
            sched.add(req(f"d{k}", range(10 * k, 10 * k + 6)), decode=True)
        entries, _ = step(sched)
        if entries is None:
            break
        order.append([e[0] for e in entries])
    assert order == [["long"], ["d1"], ["long"], ["d2"], ["long"], ["d4"], ["long"], ["long"]]
    assert not sched.has_work
    assert sum(a.num_used for a in allocs) == kv.tree.num_device_pages  # nothing leaked or held
    assert kv.tree.evictable_pages() == kv.tree.num_device_pages


def test_cancel_takes_out_a_waiting_or_chunked_request_and_drops_its_prefix():
    sched, kv, allocs = make()
    sched.add(req("long", range(1000, 1080)))
    sched.add(req("w", range(0, 10)))
    step(sched)  # the first chunk of "long": its 4 pages now held as its carried prefix
    long = sched._resume
    assert long is not None and long.rid == "long" and kv.tree.evictable_pages() < kv.tree.num_device_pages
    waiting = sched.waiting[0]
    assert sched.cancel(long) and sched.cancel(waiting)
    assert long.status is Status.CANCELLED and waiting.status is Status.CANCELLED
    assert not sched.has_work and not sched.cancel(long)
    assert kv.tree.evictable_pages() == kv.tree.num_device_pages == sum(a.num_used for a in allocs) == 4
    sched.add(req("long2", range(1000, 1040)))  # its cached first chunk (16 tokens, 4 pages) is still there
    step(sched)
    assert sched._resume is not None and sched._resume.cached == 16


def test_cancel_refuses_while_a_batch_is_in_flight():
    sched, _, _ = make()
    r = req("a", range(10))
    sched.add(r)
    batch = sched.next_batch()
    with pytest.raises(AdmissionError, match="in flight"):
        sched.cancel(r)
    sched.postprocess(batch)
    assert not sched.cancel(r)  # finished: nothing to take out
