"""The HTTP front end in-process over a scripted engine client (no ranks): health, queue bound, drain, failures and
the answer shapes, each forced deterministically."""
from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from cpkv.config import preset  # noqa: E402
from cpkv.engine.protocol import Finished, Token  # noqa: E402
from cpkv.serve.app import ServeState, build_app  # noqa: E402
from cpkv.serve.frontend import Frontend  # noqa: E402
from cpkv.serve.metrics import Metrics  # noqa: E402


class ScriptedClient:
    """EngineClient's face; the test answers each submitted request by hand (``answer``)."""

    def __init__(self) -> None:
        self.model_cfg = preset("tiny")
        self.vocab_size = self.model_cfg.vocab_size
        self.healthy, self.failure, self.pids = True, None, [11, 12]
        self.calls: dict[int, tuple] = {}
        self.cancelled: list[int] = []
        self.submitted = asyncio.Event()

    def never_reason(self, seq_len: int):
        return "max_context: too long" if seq_len > self.model_cfg.max_context else None

    def submit(self, tokens, max_new, on_event, stop_ids=frozenset(), sampling=None) -> int:
        rid = len(self.calls) + 1
        self.calls[rid] = (list(tokens), max_new, on_event)
        self.submitted.set()
        return rid

    def cancel(self, rid: int) -> None:
        self.cancelled.append(rid)

    def answer(self, rid: int, tokens: list[int], cached: int = 0, reason: str = "length", detail: str = "") -> None:
        f = self.calls[rid][2]
        for i, t in enumerate(tokens):
            f(Token(rid, t, i, cached if i == 0 else -1))
        f(Finished(rid, reason, detail))


def run(coro_fn, max_waiting: int = 64):
    client = ScriptedClient()
    fe = Frontend(client, Metrics(), max_waiting)
    app = build_app(ServeState(fe, None, "tiny"))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await coro_fn(http, client, fe)
    return asyncio.run(main())


async def until(cond, limit_s: float = 60.0) -> None:
    for _ in range(int(limit_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_generate_answer_shape_and_usage():
    async def go(http, client, fe):
        task = asyncio.ensure_future(http.post("/generate", json={"input_ids": [1, 2, 3],
                                                                  "sampling_params": {"max_new_tokens": 2}}))
        await until(lambda: client.calls)
        client.answer(1, [7, 9], cached=2)
        r = await task
        comp = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 1}))
        await until(lambda: 2 in client.calls)
        client.answer(2, [3], cached=0)
        return r, await comp

    r, c = run(go)
    body = r.json()
    assert body["output_ids"] == [7, 9] and "text" not in body  # no tokenizer: no text
    meta = body["meta_info"]
    assert (meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]) == (3, 2, 2)
    assert meta["finish_reason"] == {"type": "length", "length": 2} and meta["e2e_latency_s"] >= meta["ttft_s"] >= 0
    usage = c.json()["usage"]
    assert usage == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3,
                     "prompt_tokens_details": {"cached_tokens": 0}}
    assert c.json()["choices"][0]["token_ids"] == [3] and c.json()["object"] == "text_completion"


def test_stream_is_sse_ending_done():
    async def go(http, client, fe):
        async def engine():  # httpx's ASGI transport hands the response over only once it is complete
            await until(lambda: client.calls)
            client.answer(1, [5, 6], cached=0)
        answering = asyncio.ensure_future(engine())
        r = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True,
                                                      "stream_options": {"include_usage": True}})
        await answering
        return r.headers["content-type"], [line for line in r.text.splitlines() if line]

    ctype, lines = run(go)
    assert ctype.startswith("text/event-stream") and lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == [5, 6]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 2


def test_a_full_waiting_queue_is_429_with_retry_after():
    async def go(http, client, fe):
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        held = [asyncio.ensure_future(http.post("/generate", json=body)) for _ in range(2)]
        await until(lambda: len(client.calls) == 2)
        third = await http.post("/generate", json=body)
        for rid in (1, 2):
            client.answer(rid, [1])
        return third, [await t for t in held], fe.metrics.text().decode()

    third, held, metrics = run(go, max_waiting=2)
    assert third.status_code == 429 and third.headers["retry-after"]
    assert "queue is full" in third.json()["error"]["message"]
    assert [r.status_code for r in held] == [200, 200]
    assert 'cpkv:requests_rejected_total{reason="queue_full"} 1.0' in metrics


def test_engine_failure_is_503_and_health_turns_503():
    async def go(http, client, fe):
        task = asyncio.ensure_future(http.post("/generate", json={"input_ids": [1, 2]}))
        await until(lambda: client.calls)
        client.answer(1, [4], reason="failed", detail="rank 1 died with exit code -9 before returning")
        client.healthy, client.failure = False, "rank 1 died with exit code -9 before returning"
        return await task, await http.get("/health"), await http.post("/generate", json={"input_ids": [1]})

    r, health, after = run(go)
    assert r.status_code == 503 and "rank 1 died" in r.json()["error"]["message"]
    assert health.status_code == 503 and "rank 1" in health.json()["status"]
    assert after.status_code == 503 and after.headers["retry-after"]


def test_drain_refuses_new_requests_and_fails_the_late_ones():
    async def go(http, client, fe):
        task = asyncio.ensure_future(http.post("/generate", json={"input_ids": [1, 2]}))
        await until(lambda: client.calls)
        drain = asyncio.ensure_future(fe.drain(0.2))
        await until(lambda: fe.draining)
        new = await http.post("/generate", json={"input_ids": [3]})
        health = await http.get("/health")
        await drain
        return await task, new, health

    late, new, health = run(go)
    assert new.status_code == 503 and "shutting down" in new.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "stopping"
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]


def test_engine_admission_rejection_is_503():
    async def go(http, client, fe):
        task = asyncio.ensure_future(http.post("/generate", json={"input_ids": [1, 2]}))
        await until(lambda: client.calls)
        client.answer(1, [], reason="rejected", detail="pages: a writer rank has too few free pages")
        return await task, fe.metrics.text().decode()

    r, metrics = run(go)
    assert r.status_code == 503 and "pages" in r.json()["error"]["message"]
    assert 'cpkv:requests_rejected_total{reason="admission"} 1.0' in metrics
    assert "cpkv:num_requests_waiting 0.0" in metrics


def test_a_taken_port_is_one_error_line_before_any_rank_starts(capsys):
    import socket

    from cpkv.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", "--port", str(s.getsockname()[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cpkv serve: error: --host 127.0.0.1 --port ") and "--port 0" in err[0]


class BlockingTokenizer:
    """A chat tokenizer whose ``chat`` waits until the test releases it: tokenization that runs on the event loop
    would hold every other request until then."""

    has_chat_template = True
    stop_ids = frozenset()

    def __init__(self) -> None:
        import threading

        self.entered, self.release, self.returned = threading.Event(), threading.Event(), False

    def chat(self, messages) -> list[int]:
        self.entered.set()
        self.release.wait(60.0)  # only a server tokenizing on its event loop reaches this bound
        self.returned = True
        return [1, 2, 3]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_tokenizing_a_chat_leaves_the_event_loop_serving():
    """/health answers while a chat request's tokenization is still running, and the chat completes after it."""
    tok, client = BlockingTokenizer(), ScriptedClient()
    fe = Frontend(client, Metrics(), 64)
    app = build_app(ServeState(fe, tok, "tiny"))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            chat = asyncio.create_task(http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
            await until(tok.entered.is_set)
            health = await http.get("/health")
            answered_during = not tok.returned
            tok.release.set()
            await until(lambda: 1 in client.calls)
            client.answer(1, [5, 6])
            return health, answered_during, await chat
    health, answered_during, chat = asyncio.run(main())
    assert health.status_code == 200 and answered_during
    assert chat.status_code == 200 and client.calls[1][0] == [1, 2, 3]
    assert chat.json()["choices"][0]["message"]["content"] == "5 6"


def test_a_bad_chat_tokenized_off_the_loop_is_still_a_named_4xx():
    """Errors raised where the tokenization runs (its worker thread) come back as the same JSON 4xx naming the field,
    and the engine sees nothing."""
    tok, client = BlockingTokenizer(), ScriptedClient()
    tok.release.set()
    app = build_app(ServeState(Frontend(client, Metrics(), 64), tok, "tiny"))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            wrong = await http.post("/v1/chat/completions", json={
                "model": "other", "messages": [{"role": "user", "content": "hi"}]})
            outside = await http.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 1})
            return wrong, outside
    tok.text = lambda text: [1, client.vocab_size]  # a text prompt whose second id is outside the vocabulary
    wrong, outside = asyncio.run(main())
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
    assert "not served here" in wrong.json()["error"]["message"]
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "prompt"
    assert "outside the vocabulary" in outside.json()["error"]["message"]
    assert client.calls == {}
