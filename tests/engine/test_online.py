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
