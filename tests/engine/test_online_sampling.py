"""Sampling through the online engine (rank processes, no HTTP) at cp 2 and cp 4: the ranks agree on every sampled
token (each step's tokens are those the single-rank reference picks from its own logits with the same seed: a
rank that took another token would change every later step), the same seed gives the same tokens, another seed
other tokens, top_k 1 the greedy ones, per-request parameters side by side in one batch, log-probabilities."""
from __future__ import annotations

import threading

import pytest
import torch

from cpkv.engine.client import EngineClient
from cpkv.engine.config import EngineConfig
from cpkv.engine.protocol import Finished, SamplingParams, Token
from cpkv.engine.sampling import pick

pytestmark = pytest.mark.slow

N = 6
PROMPTS = [[(13 * i + 7 * k) % 500 + 5 for i in range(20 + 9 * k)] for k in range(3)]
HOT = SamplingParams(temperature=1.5, top_p=0.95, top_k=50, min_p=0.01, repetition_penalty=1.2,
                     frequency_penalty=0.3, presence_penalty=0.2, seed=11)


def generate(client: EngineClient, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[Token]]:
    """Submit every job at once (one batch where they fit) -> each one's tokens."""
    events: dict[int, list] = {}
    done = threading.Event()
    lock = threading.Lock()

    def on_event(ev) -> None:
        with lock:
            events.setdefault(ev.rid, []).append(ev)
            if sum(isinstance(v[-1], Finished) for v in events.values()) == len(jobs):
                done.set()
    rids = [client.submit(p, N, on_event, sampling=s) for p, s in jobs]
    assert done.wait(300), events
    assert all(events[r][-1].reason == "length" for r in rids), events
    return [[e for e in events[r] if isinstance(e, Token)] for r in rids]


@pytest.fixture(scope="module")
def reference():
    from cpkv.model import load_model

    return load_model("tiny", seed=0)


def expected(model, prompt: list[int], p: SamplingParams) -> list[int]:
    seq = list(prompt)
    for step in range(N):
        seq.append(pick(model.reference_prefill(seq).float(), p, seq, len(prompt), step))
    return seq[len(prompt):]


@pytest.mark.parametrize("cp", [2, 4])
def test_sampled_tokens_agree_across_ranks_and_follow_the_seed(cp, reference):
    cfg = EngineConfig(cp=cp, page_size=16, pages_per_rank=128, chunk_size=64, max_requests=8)
    client = EngineClient(cfg, timeout_s=120)
    client.start(ready_timeout_s=300)
    try:
        other = SamplingParams(temperature=1.5, top_p=0.95, top_k=50, seed=12)
        jobs = [(PROMPTS[0], HOT), (PROMPTS[1], SamplingParams()), (PROMPTS[1], SamplingParams(temperature=2.0,
                top_k=1, seed=5)), (PROMPTS[2], other), (PROMPTS[2], SamplingParams(temperature=1.5, top_p=0.95,
                top_k=50, seed=13, logprobs=3))]
        first = generate(client, jobs)
        again = generate(client, jobs[:1] + jobs[3:4])
    finally:
        client.close(60)
    toks = [[t.token for t in ts] for ts in first]
    assert [t.token for t in again[0]] == toks[0] and [t.token for t in again[1]] == toks[3]  # same seed
    assert toks[2] == toks[1]                  # top_k 1 at any temperature: greedy
    assert toks[3] != toks[4]                  # another seed, other tokens (6 draws at temperature 1.5)
    for (prompt, p), got in zip(jobs, toks):   # every rank took the token the reference picks
        assert got == expected(reference, prompt, p), p
    assert all(t.logprob is None for t in first[0])
    seq = list(PROMPTS[2])
    for t in first[4]:                         # log-probabilities of the raw logits, from the holding rank
        lp = torch.log_softmax(reference.reference_prefill(seq).double(), -1)
        assert t.logprob == pytest.approx(float(lp[t.token]), abs=1e-3) and len(t.top) == 3
        assert t.top[0][0] == int(torch.argmax(lp)) and t.top[0][1] >= t.top[1][1] >= t.top[2][1]
        seq.append(t.token)
