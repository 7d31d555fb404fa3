"""Two ``cpkv serve`` workers (tiny preset, cp 1, their shipped tokenizer) behind SGLang's router
(``sglang-router``, ``--policy cache_aware``) on loopback: the router registers them (their health and info
endpoints), forwards requests with its default-valued fields, and keeps each conversation on the worker that holds
its prefix, so the cache-hit ratio through the router is at least that of one worker alone. (Whether it also
spreads the first turns over both workers varies from run to run: not asserted.)"""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("sglang_router")
httpx = pytest.importorskip("httpx")
from test_serve import ENV, Server, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

CONVERSATIONS, TURNS = 5, 3  # odd: round robin would move every conversation to the other worker each turn
WORKER = ("--cp", "1", "--max-requests", "4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def turn_text(c: int, t: int) -> str:
    return f"Conversation {c}, turn {t}: tell me about context parallel prefill number {c * 7 + t}. " * 6


def turn_ids(c: int, t: int) -> list[int]:
    return [(c * 7919 + t * 131 + i * 104729) % 500 + 5 for i in range(90)]


def run_trace(url: str, kind: str = "text") -> list[dict]:
    """Every conversation's turns in order, each prompt the earlier turns plus their answers: /generate metas.
    ``kind``: prompts as text, or as token ids (``input_ids``)."""
    prompts: list = [""] * CONVERSATIONS if kind == "text" else [[] for _ in range(CONVERSATIONS)]
    metas = []
    for t in range(TURNS):
        for c in range(CONVERSATIONS):
            prompts[c] += turn_text(c, t) if kind == "text" else turn_ids(c, t)
            body = {"text": prompts[c]} if kind == "text" else {"input_ids": prompts[c]}
            r = httpx.post(url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 2}}, timeout=120)
            assert r.status_code == 200, r.text
            prompts[c] += r.json()["text"] if kind == "text" else r.json()["output_ids"]
            metas.append({"conv": c, "turn": t, **r.json()["meta_info"]})
    return metas


def hit_ratio(metas: list[dict]) -> float:
    return sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)


@pytest.fixture(scope="module")
def workers():
    ws = [Server("tiny", *WORKER), Server("tiny", *WORKER)]
    yield ws
    for w in ws:
        w.close()


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_cache_aware_router_keeps_conversations_on_their_worker(workers, kind):
    alone = hit_ratio(run_trace(workers[0].url, kind))
    assert workers[0].post("/flush_cache").status_code == 200
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                               str(port), "--policy", "cache_aware", "--worker-urls", *[w.url for w in workers]],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url, router), "the router to register both workers as model 'tiny'", 60)
        metas = run_trace(url, kind)
    finally:
        router.terminate()
        out = router.communicate(timeout=30)[0]
    assert all(m["cached_tokens"] == 0 for m in metas if m["turn"] == 0)  # worker 0's cache was flushed
    follow_ups = [m for m in metas if m["turn"] > 0]
    assert all(m["cached_tokens"] > 0 for m in follow_ups), (metas, out[-3000:])
    assert hit_ratio(metas) >= alone > 0


def _ready(url: str, router: subprocess.Popen) -> bool:
    """Both workers registered and healthy, under the model name the workers' info endpoints gave."""
    if router.poll() is not None:
        pytest.fail(f"the router exited: {router.stdout.read()[-3000:]}")
    try:
        workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return len(workers) == 2 and all(w["is_healthy"] and w["model_id"] == "tiny" for w in workers)
