"""The online engine through its client (rank processes, no HTTP): a long prefill stalls a running decode by at
most one chunk, and the decoded tokens are the single-rank reference's greedy continuation."""
from __future__ import annotations

import threading

import pytest

from cpkv.engine.client import EngineClient
from cpkv.engine.config import EngineConfig
from cpkv.engine.protocol import Finished, Token

pytestmark = pytest.mark.slow

CFG = EngineConfig(page_size=16, pages_per_rank=128, chunk_size=64, max_requests=4)


def test_a_long_prefill_stalls_a_decode_by_at_most_one_chunk():
    steps, events, done = [], {}, threading.Event()

    def on_event(ev) -> None:
        events.setdefault(ev.rid, []).append(ev)
        if isinstance(ev, Finished) and len([r for r in events.values() if isinstance(r[-1], Finished)]) == 2:
            done.set()

    client = EngineClient(CFG, timeout_s=120, on_step=steps.append)
    client.start(ready_timeout_s=300)
    try:
        first = threading.Event()
        a = client.submit(list(range(5, 45)), 30, lambda ev: (on_event(ev), first.set()))
        assert first.wait(120)
        start = len(steps)
        b = client.submit([(7 * i) % 500 + 3 for i in range(640)], 1, on_event)  # 10 chunks of 64
        assert done.wait(300), events
    finally:
        client.close(60)
    a_tokens = [e.token for e in events[a] if isinstance(e, Token)]
    assert len(a_tokens) == 30 and events[b][-1].reason == "length"
    during = steps[start:]
    b_first = next(i for i, s in enumerate(during) if any(e.rid == b and isinstance(e, Token) for e in s.events))
    a_in = [any(e.rid == a and isinstance(e, Token) for e in s.events) for s in during[:b_first]]
    assert a_in.count(False) >= 9  # B's chunks ran meanwhile ...
    gaps = "".join("a" if x else "." for x in a_in)
    assert ".." not in gaps, gaps  # ... and A got a token after every one of them

    from cpkv.model import load_model

    model, seq = load_model("tiny", seed=0), list(range(5, 45))
    for t in a_tokens[:3]:
        assert int(model.reference_prefill(seq).argmax()) == t
        seq.append(t)


def test_a_long_prompt_alone_runs_its_chunks_planned_ahead():
    """A 10-chunk prompt with nothing else running: every chunk but the first (and the decode step after the
    last, formed once the last chunk's token is known) is planned while the chunk before runs; the tokens are
    the reference's greedy continuation."""
    prompt = [(11 * i) % 500 + 2 for i in range(640)]
    got, done = [], threading.Event()

    def on_event(ev) -> None:
        if isinstance(ev, Token):
            got.append(ev.token)
        if isinstance(ev, Finished):
            done.set()

    client = EngineClient(CFG, timeout_s=120)
    client.start(ready_timeout_s=300)
    try:
        client.submit(prompt, 2, on_event)
        assert done.wait(300)
    finally:
        client.close(60)
    assert all(r["planned_ahead"] == 9 for r in client.results), client.results  # chunks 2-10

    from cpkv.model import load_model

    model, seq = load_model("tiny", seed=0), list(prompt)
    for t in got:
        assert int(model.reference_prefill(seq).argmax()) == t
        seq.append(t)
