"""The README's quick-start server (``cpkv serve``, the tiny preset with its shipped tokenizer) as a subprocess: text
and chat through the official openai client, the info / tokenize / flush / health_generate endpoints, the flags
reported back, the prefill / decode / access log lines, the decode histograms in /metrics."""
from __future__ import annotations

import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
from test_serve import Server  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    s = Server("tiny", "--cp", "2", "--log-requests", "--decode-log-interval", "1", "--context-length", "4096")
    yield s
    s.close()


def test_text_and_chat_through_the_openai_client(server):
    client = server.openai()
    c = client.completions.create(model="tiny", prompt="Hello, how are you?", max_tokens=4)
    assert c.usage.prompt_tokens == server.post("/tokenize", {"prompt": "Hello, how are you?"}).json()["count"]
    assert c.choices[0].finish_reason in ("length", "stop") and 1 <= c.usage.completion_tokens <= 4
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == server.post(
        "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["count"]


def test_server_info_reports_the_flags(server):
    info = server.get("/get_server_info").json()
    assert (info["cp_size"], info["page_size"], info["chunked_prefill_size"], info["pages_per_rank"],
            info["max_running_requests"], info["context_length"]) == (2, 16, 64, 512, 8, 4096)
    assert info["model_path"] == "tiny" and server.get("/get_model_info").json()["has_tokenizer"] is True
    assert server.get("/v1/models").json()["data"][0]["max_model_len"] == 4096


def test_flush_empties_the_prefix_cache(server):
    body = {"text": "The quick brown fox jumps over the lazy dog. " * 8, "sampling_params": {"max_new_tokens": 1}}
    server.post("/generate", body)
    assert server.post("/generate", body).json()["meta_info"]["cached_tokens"] > 0
    r = server.post("/flush_cache")
    assert r.status_code == 200 and r.json()["pages_freed"] > 0
    assert server.post("/generate", body).json()["meta_info"]["cached_tokens"] == 0


def test_detokenize_tokenize_and_health_generate(server):
    text = "naïve café 🙂"
    ids = server.post("/tokenize", {"prompt": text}).json()["tokens"]
    assert server.post("/detokenize", {"tokens": ids}).json() == {"prompt": text}
    assert server.get("/health_generate").json()["status"] == "ok"
    assert server.get("/version").status_code == 200


def test_logs_and_decode_histograms(server):
    server.post("/generate", {"input_ids": list(range(1, 40)), "sampling_params": {"max_new_tokens": 4}})
    m = server.metrics()
    assert m[("cpkv:inter_token_latency_seconds_count", ())] >= 3
    assert m[("cpkv:time_per_output_token_seconds_count", ())] >= 1
    err = server.stderr
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO: +"
    assert re.search(stamp + r"Prefill batch\. #new-seq: 1, #new-token: \d+, #cached-token: \d+", err), err
    assert re.search(stamp + r"Decode batch\. #running-req: \d+, KV pages: \d+/1022 .*gen throughput", err), err
    assert re.search(stamp + r'127\.0\.0\.1:\d+ - "POST /generate HTTP/1\.1" 200', err), err


@pytest.mark.parametrize("endpoint", ["completions", "generate"])
def test_bench_serve_sends_text_prompts(server, endpoint, tmp_path, capsys):
    """``cpkv bench serve --prompt-format text``: the trace's tokens turned into text by the server's /detokenize,
    sent as text; a follow-up is its parent's prompt + answer + its own text, so it hits the parent's pages."""
    import json

    from cpkv.cli import main
    from cpkv.scheduler.trace import TraceRequest, write_trace

    trace, out = tmp_path / "t.jsonl", tmp_path / "r.jsonl"
    write_trace([TraceRequest("a0", 0.0, 80), TraceRequest("b0", 0.0, 40),
                 TraceRequest("a1", 0.0, 120, parent="a0")], trace)
    server.post("/flush_cache")
    assert main(["bench", "serve", "--url", server.url, "--trace", str(trace), "--closed-loop", "--endpoint", endpoint,
                 "--prompt-format", "text", "--max-tokens", "3", "--out-jsonl", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["prompt_format"] == "text" and rep["summary"]["completed"] == 3 and rep["summary"]["failed"] == 0
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert all(isinstance(r["output_text"], str) and r["prompt_tokens"] > 0 for r in recs.values())
    assert recs["a1"]["parent_output_missing"] is False and recs["a1"]["prompt_tokens"] > recs["a0"]["prompt_tokens"]
    assert recs["a1"]["cached_tokens"] > 0  # the conversation's text prefix hit the parent's pages
