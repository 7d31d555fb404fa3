"""The info, cache and tokenizer routes (``cpkv.serve.info``) against a scripted engine client: shapes, the
flush's 409 while anything runs, tokenize / detokenize round trips, field errors naming the field."""
from __future__ import annotations

import asyncio

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from cpkv.engine.protocol import Finished, Flushed  # noqa: E402
from cpkv.serve.app import ServeState, build_app  # noqa: E402
from cpkv.serve.frontend import Frontend  # noqa: E402
from cpkv.serve.metrics import Metrics  # noqa: E402
from cpkv.serve.tokenizer import load_tokenizer  # noqa: E402
from test_app import ScriptedClient, until  # noqa: E402


class FlushingClient(ScriptedClient):
    """Answers a flush at once: ``busy`` says whether the engine still holds generations."""

    def __init__(self) -> None:
        super().__init__()
        self.busy, self.flushes = False, 0
        self.cfg = type("Cfg", (), {"cp": 2, "pages_per_rank": 9})()
        self.in_flight = 0

    def flush(self, on_event) -> int:
        self.flushes += 1
        on_event(Flushed(-self.flushes, -1 if self.busy else 7))
        return -self.flushes


def serve(coro_fn, tok=None, context_length: int = 0):
    client = FlushingClient()
    fe = None

    async def main():
        nonlocal fe
        fe = Frontend(client, Metrics(), 64)
        app = build_app(ServeState(fe, tok, "tiny", context_length=context_length, info={"cp_size": 2}))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            await coro_fn(http, client, fe)
    asyncio.run(main())


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def test_info_routes_answer_in_sglangs_shapes():
    async def go(http, client, fe):
        info = (await http.get("/get_server_info")).json()
        assert info["cp_size"] == 2 and info["context_length"] == 100 and info["internal_states"][0][
            "pool_pages"] == 16
        assert (await http.get("/server_info")).json() == info
        model = (await http.get("/get_model_info")).json()
        assert model["is_generation"] is True and model["has_tokenizer"] is False and model["vocab_size"] == 512
        assert (await http.get("/version")).json()["version"]
        assert (await http.get("/v1/models")).json()["data"][0]["max_model_len"] == 100
    serve(go, context_length=100)


def test_flush_is_409_while_a_request_runs_and_200_when_idle():
    async def go(http, client, fe):
        r = await http.post("/flush_cache")
        assert r.status_code == 200 and r.json() == {"flushed": True, "pages_freed": 7}
        task = asyncio.create_task(http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 1}}))
        await until(lambda: client.calls)
        r = await http.get("/flush_cache")
        assert r.status_code == 409 and "1 requests are in flight" in r.json()["error"]["message"]
        assert client.flushes == 1  # refused before the engine was asked
        client.answer(1, [5])
        assert (await task).status_code == 200
        client.busy = True  # the ranks still hold a generation the front end no longer waits for
        assert (await http.post("/flush_cache")).status_code == 409
    serve(go)


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(tok):
    async def go(http, client, fe):
        text = "héllo 🙂 wörld"
        r = (await http.post("/tokenize", json={"prompt": text, "return_token_strs": True})).json()
        assert r["tokens"] == tok.text(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 65536
        assert len(r["token_strs"]) == r["count"]
        back = (await http.post("/detokenize", json={"tokens": r["tokens"]})).json()
        assert back == {"prompt": text}
        chat = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
        assert chat["tokens"] == tok.chat([{"role": "user", "content": "hi"}])
        bare = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "add_generation_prompt": False})).json()
        assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    serve(go, tok=tok)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"messages": [{"role": "x", "content": "a"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": [1, 512]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_fields_are_named(tok, path, body, param):
    async def go(http, client, fe):
        r = await http.post(path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    serve(go, tok=tok)


def test_tokenize_without_a_tokenizer_is_a_400():
    async def go(http, client, fe):
        r = await http.post("/tokenize", json={"prompt": "a"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
    serve(go)


def test_health_generate_makes_one_token_or_is_503():
    async def go(http, client, fe):
        task = asyncio.create_task(http.get("/health_generate"))
        await until(lambda: client.calls)
        assert client.calls[1][1] == 1  # one token asked
        client.answer(1, [9])
        assert (await task).json() == {"status": "ok", "token": 9}
        task = asyncio.create_task(http.get("/health_generate"))
        await until(lambda: 2 in client.calls)
        client.calls[2][2](Finished(2, "failed", "rank 1 died"))
        r = await task
        assert r.status_code == 503 and "rank 1 died" in r.json()["error"]
    serve(go)


def test_a_request_past_the_context_length_names_max_tokens():
    async def go(http, client, fe):
        r = await http.post("/v1/completions", json={"prompt": [1] * 60, "max_tokens": 41})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert "context length 100" in r.json()["error"]["message"]
    serve(go, context_length=100)


def test_ttft_tpot_and_itl_are_observed_where_tokens_arrive():
    from prometheus_client.parser import text_string_to_metric_families

    async def go(http, client, fe):
        task = asyncio.create_task(http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 3}}))
        await until(lambda: client.calls)
        client.answer(1, [5, 6, 7])
        assert (await task).status_code == 200
        got = {s.name: s.value for f in text_string_to_metric_families(fe.metrics.text().decode())
               for s in f.samples}
        assert got["cpkv:inter_token_latency_seconds_count"] == 2  # tokens 2 and 3
        assert got["cpkv:time_per_output_token_seconds_count"] == 1
        assert got["cpkv:time_per_output_token_seconds_sum"] >= 0
    serve(go)


def test_step_log_prints_a_prefill_line_per_first_token_batch_and_a_decode_line_per_interval(caplog):
    import logging

    from cpkv.engine.protocol import Step, Token
    from cpkv.serve.logs import StepLog

    lens = {1: 100, 2: 50}
    steps = StepLog(lambda rid: lens[rid], lambda: (1, 2), pool_pages=200, decode_interval=2)
    with caplog.at_level(logging.INFO, logger="cpkv.serve"):
        steps.step(Step((Token(1, 5, 0, 64), Token(2, 5, 0, 0)), (10, 12)))
        steps.step(Step((), (10, 12)))  # a middle chunk: no line
        steps.step(Step((Token(1, 6, 1),), (11, 12)))
        steps.step(Step((Token(1, 7, 2),), (11, 12)))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("Prefill batch. #new-seq: 2, #new-token: 86, #cached-token: 64, KV pages: 22/200 (11.0%), "
                        "#running-req: 1, #queue-req: 2")
    assert len(lines) == 2 and lines[1].startswith("Decode batch. #running-req: 1, KV pages: 23/200 (11.5%), "
                                                   "cache hit rate: 42.7%, gen throughput (token/s): ")


def test_step_log_counts_a_request_gone_before_its_line_from_its_first_token(caplog):
    """A one-token request finishes (its flight closed) before the watch thread logs its step: the first token
    carries its prompt length, so the line never counts negative new tokens."""
    import logging

    from cpkv.engine.protocol import Step, Token
    from cpkv.serve.logs import StepLog

    steps = StepLog(lambda rid: 0, lambda: (0, 0), pool_pages=200)
    with caplog.at_level(logging.INFO, logger="cpkv.serve"):
        steps.step(Step((Token(1, 5, 0, 128, prompt=192),), (10, 12)))
    assert "#new-seq: 1, #new-token: 64, #cached-token: 128," in caplog.records[0].getMessage()


def test_mem_fraction_sizes_the_pool_from_the_memory_plan(monkeypatch):
    from cpkv.cli import plan_cmd
    from cpkv.engine.config import EngineConfig
    from cpkv.errors import ConfigError
    from cpkv.serve.cmd import pool_for_fraction

    monkeypatch.setattr(plan_cmd, "host_available", lambda: 8 << 30)
    cfg = EngineConfig(model="tiny", cp=2, device="cpu", page_size=16, chunk_size=64, pages_per_rank=16)
    small, large = pool_for_fraction(cfg, 0.1), pool_for_fraction(cfg, 0.2)
    assert 16 < small < large
    with pytest.raises(ConfigError, match="--mem-fraction-static 0.001"):
        pool_for_fraction(cfg, 0.001)
