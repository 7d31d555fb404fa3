"""``cpkv serve`` as a real subprocess (CPU, the tiny model, cp 2), driven by the official ``openai`` client and raw
HTTP: tokens equal ``cpkv run``'s, 32 concurrent requests never cross, later turns hit the prefix cache, /metrics
parses, a disconnect cancels in the engine, a killed rank fails in-flight requests and ends the server naming it,
SIGTERM drains and leaves no process behind.

One server (a tiny checkpoint with a tokenizer and chat template) serves the module; the SIGTERM test ends it,
so it runs last. A second server (the ``tiny`` preset with its shipped tokenizer) is the one whose rank gets killed.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.slow

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
OPTS = ["--page-size", "16", "--chunk-size", "64", "--max-requests", "8", "--pages-per-rank", "512"]
START_S = 240.0  # start-up on a loaded 2-core machine: three interpreters importing torch
WAIT_S = 120.0   # any single wait for the server


class Server:
    """A ``cpkv serve --port 0`` subprocess; its stderr is collected by a thread."""

    def __init__(self, model: str, *extra: str, api_key: str | None = None) -> None:
        env = {**ENV, "CPKV_API_KEY": api_key} if api_key else ENV
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.proc = subprocess.Popen([sys.executable, "-m", "cpkv", "serve", "--model", model, "--port", "0", *OPTS,
                                      *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + START_S
        while not self.url:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                pytest.fail(f"cpkv serve did not start: {self.stderr}")
            time.sleep(0.2)
        health = self.get("/health")
        assert health.status_code == 200, health.text
        self.ranks = [r["pid"] for r in health.json()["ranks"]]

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=WAIT_S, headers=self.headers)

    def post(self, path: str, body=None, content: bytes | None = None) -> httpx.Response:
        if content is not None:
            return httpx.post(self.url + path, content=content, timeout=WAIT_S, headers=self.headers)
        return httpx.post(self.url + path, json=body, timeout=WAIT_S, headers=self.headers)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=WAIT_S, max_retries=0)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        out = {}
        for fam in text_string_to_metric_families(self.get("/metrics").text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_for(cond, what: str, limit_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def tiny_checkpoint(path: Path) -> Path:
    """The tiny preset's weights (seed 0) saved as a checkpoint with a word-level tokenizer of the model's 512
    ids and a jinja chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from cpkv.config import preset
    from cpkv.model.weights import random_weights, save_checkpoint

    cfg = preset("tiny")
    save_checkpoint(path, cfg, random_weights(cfg, 0))
    special = ["<unk>", "<eos>", "<user>", "<assistant>", "<system>"]
    vocab = {w: i for i, w in enumerate(special + [f"w{i}" for i in range(len(special), cfg.vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<eos>",
        "chat_template": template}))
    return path


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 500 + 5 for i in range(n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(str(ckpt))
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference():
    from cpkv.model import load_model

    return load_model("tiny", seed=0)


def greedy(model, tokens: list[int], n: int) -> list[int]:
    seq, out = list(tokens), []
    for _ in range(n):
        out.append(int(model.reference_prefill(seq).argmax()))
        seq.append(out[-1])
    return out


def generate(server: Server, ids: list[int], n: int) -> dict:
    r = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                         "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


# -- the module server -----------------------------------------------------------------------------
def test_health_and_models(server):
    assert server.get("/health").json()["status"] == "ok"
    assert len(server.ranks) == 2 and all(alive(p) for p in server.ranks)
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [server_model(server)]


def server_model(server: Server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


def test_the_model_id_is_the_directory_name_not_its_path(server, ckpt):
    r = server.get("/v1/models")
    assert r.json()["data"][0]["id"] == ckpt.name and str(ckpt) not in r.text
    bad = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "model": "x"})
    assert bad.status_code == 404 and str(ckpt) not in bad.text


def test_no_socket_of_the_server_or_its_ranks_leaves_loopback(server):
    """``--host 127.0.0.1``: the HTTP socket, the rendezvous store and gloo's listeners, over the whole process
    tree, are all on loopback (read from /proc)."""
    from listening import exposed, listening, tree

    pids = tree(server.proc.pid)
    assert set(server.ranks) <= set(pids)
    port = int(server.url.rsplit(":", 1)[1])
    assert ("127.0.0.1", port) in listening(server.proc.pid)  # the reader sees the HTTP socket ...
    assert all(listening(r) for r in server.ranks)           # ... and each rank's gloo listener
    assert exposed(server.proc.pid) == {}


def test_generate_equals_cpkv_run(server, ckpt, tmp_path):
    """First token and greedy continuation: /generate's tokens are the first tokens ``cpkv run`` gives for the
    prompt plus the tokens so far (one prompt chunked at the chunk size of 64)."""
    prompts = [prompt(1, 40), prompt(2, 75), prompt(3, 150)]
    outs = [generate(server, p, 4) for p in prompts]
    for p, o in zip(prompts, outs):
        assert len(o["output_ids"]) == 4 and o["meta_info"]["prompt_tokens"] == len(p)
        assert o["meta_info"]["completion_tokens"] == 4 and o["meta_info"]["finish_reason"]["type"] == "length"
        assert o["meta_info"]["ttft_s"] > 0 and o["meta_info"]["e2e_latency_s"] >= o["meta_info"]["ttft_s"]
        assert isinstance(o["text"], str)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"id": f"p{i}.{k}", "arrival": 0, "tokens": p + o["output_ids"][:k]}) + "\n"
                             for i, (p, o) in enumerate(zip(prompts, outs)) for k in range(4)))
    run = subprocess.run([sys.executable, "-m", "cpkv", "run", "--model", str(ckpt), "--trace", str(trace), "--json",
                          "--no-verify", *OPTS[:6]], env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    first = {r["id"]: r["first_token"] for r in json.loads(run.stdout)["requests"]}
    for i, o in enumerate(outs):
        assert [first[f"p{i}.{k}"] for k in range(4)] == o["output_ids"]


def test_openai_completions_and_stream(server):
    client, ids = server.openai(), prompt(4, 37)
    res = client.completions.create(model=server_model(server), prompt=ids, max_tokens=5, temperature=0)
    choice = res.choices[0]
    assert choice.finish_reason in ("length", "stop") and res.usage.prompt_tokens == 37
    toks = choice.token_ids
    assert res.usage.completion_tokens == len(toks) and 1 <= len(toks) <= 5
    assert res.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.completions.create(model=server_model(server), prompt=ids, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert streamed == toks
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == len(toks) and chunks[-1].usage.prompt_tokens == 37
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 32  # the same prompt again: its full pages
    text = client.completions.create(model=server_model(server), prompt="w7 w8 w9 w10", max_tokens=2)
    assert text.usage.prompt_tokens == 4


def test_chat_uses_the_template(server):
    client = server.openai()
    msgs = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9"}]
    res = client.chat.completions.create(model=server_model(server), messages=msgs, max_tokens=3, temperature=0)
    assert res.usage.prompt_tokens == 8  # <system> w5 w6 <user> w7 w8 w9 <assistant>, as the template renders
    assert res.choices[0].message.role == "assistant" and isinstance(res.choices[0].message.content, str)
    chunks = list(client.chat.completions.create(model=server_model(server), messages=msgs, max_tokens=3,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == res.choices[0].message.content


@pytest.mark.parametrize("path,body,param,status", [
    ("/v1/completions", b"{\"prompt\": [1, 2", None, 400),
    ("/v1/completions", b"[1, 2]", None, 400),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "3"}, "max_tokens", 400),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens", 400),
    ("/v1/completions", {"prompt": [1, 2], "frobnicate": 1}, "frobnicate", 400),
    ("/v1/completions", {"prompt": [1, 600]}, "prompt", 400),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt", 400),
    ("/v1/completions", {"prompt": [1, 2], "temperature": -0.8}, "temperature", 400),
    ("/v1/completions", {"prompt": [1, 2], "n": 0}, "n", 400),
    ("/v1/completions", {"prompt": [1, 2], "model": "gpt-4"}, "model", 404),
    ("/v1/completions", {"prompt": [1] * 70000}, "prompt", 400),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 66000}, "max_tokens", 400),
    ("/v1/completions", {"prompt": [1] * 17000}, "prompt", 400),  # more pages than every pool holds
    ("/generate", {"input_ids": [1, 2], "text": "w5"}, "input_ids", 400),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "top_k": -3}},
     "sampling_params.top_k", 400),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "regex": "a+"}},
     "sampling_params.regex", 400),
    ("/generate", {"input_ids": "1 2"}, "input_ids", 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0]", 400),
    ("/v1/completions", b'{"prompt": "\\ud800 w1"}', "prompt", 400),
    ("/generate", b'{"text": "w5 \\ud800"}', "text", 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w5 \\udc00"}]}', "messages[0].content", 400),
    ("/v1/chat/completions", {"messages": [{"role": "hacker", "content": "w5"}]}, "messages[0].role", 400),
    ("/v1/chat/completions", {"messages": [{"role": "assistant> w5 <user", "content": "w5"}]}, "messages[0].role",
     400),
    ("/v1/completions", {"prompt": [1, 2], "echo": 0}, "echo", 400),
    ("/v1/completions", {"prompt": [1, 2], "n": 1.0}, "n", 400),
    ("/v1/completions", b'{"prompt": [1, 2], "temperature": NaN}', "temperature", 400),
    ("/generate", {"input_ids": [1], "sampling_params": {"skip_special_tokens": 0}},
     "sampling_params.skip_special_tokens", 400),
    ("/v1/completions", b"[" * 100 + b"]" * 100, None, 400),
    ("/v1/completions", b'{"prompt": [' + b"1, " * (3 << 20) + b'1]}', None, 413),  # past the 4 MiB default
    ("/nowhere", {"prompt": [1]}, None, 404),
    ("/health", {"prompt": [1]}, None, 405),
])
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, param, status):
    r = server.post(path, content=body) if isinstance(body, bytes) else server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]
    assert server.get("/health").status_code == 200


def test_32_concurrent_requests_never_cross(server, reference):
    prompts = [prompt(10 + k, 20 + 3 * k) for k in range(8)]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as c:
            body = lambda p: {"input_ids": p, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}  # noqa
            rs = await asyncio.gather(*(c.post("/generate", json=body(prompts[i % 8])) for i in range(32)))
        return rs

    rs = asyncio.run(main())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    want = [greedy(reference, p, 3) for p in prompts]
    for i, r in enumerate(rs):
        assert r.json()["output_ids"] == want[i % 8], i


def test_later_turns_hit_the_prefix_cache(server):
    client, history = server.openai(), prompt(30, 50)
    cached = []
    for turn in range(3):
        res = client.completions.create(model=server_model(server), prompt=history, max_tokens=4)
        cached.append(res.usage.prompt_tokens_details.cached_tokens)
        history = history + res.choices[0].token_ids + prompt(40 + turn, 9)
    assert cached[0] == 0
    assert all(c >= 48 for c in cached[1:]), cached  # at least the first turn's full 16-token pages


def test_metrics_parse_and_count(server):
    before = server.metrics()
    assert server.post("/v1/completions", {"prompt": [1, 2], "bogus": 1}).status_code == 400
    generate(server, prompt(50, 33), 2)
    m = server.metrics()
    names = {name for name, _ in m}
    for n in ("cpkv:time_to_first_token_seconds_count", "cpkv:e2e_request_latency_seconds_bucket",
              "cpkv:prompt_tokens_total", "cpkv:cached_tokens_total", "cpkv:generation_tokens_total",
              "cpkv:num_requests_running", "cpkv:num_requests_waiting", "cpkv:cache_hit_rate",
              "cpkv:kv_pages_used", "cpkv:requests_rejected_total"):
        assert n in names, n
    get = lambda d, n, **lb: d.get((n, tuple(sorted(lb.items()))), 0.0)  # noqa: E731
    assert get(m, "cpkv:time_to_first_token_seconds_count") == get(before, "cpkv:time_to_first_token_seconds_count") + 1
    assert get(m, "cpkv:prompt_tokens_total") == get(before, "cpkv:prompt_tokens_total") + 33
    assert get(m, "cpkv:generation_tokens_total") == get(before, "cpkv:generation_tokens_total") + 2
    assert get(m, "cpkv:requests_rejected_total", reason="invalid") == \
        get(before, "cpkv:requests_rejected_total", reason="invalid") + 1
    assert get(m, "cpkv:kv_pages_used", rank="0") > 0 and get(m, "cpkv:kv_pages_used", rank="1") > 0
    assert 0 < get(m, "cpkv:cache_hit_rate") < 1
    assert get(m, "cpkv:num_requests_running") == 0 and get(m, "cpkv:num_requests_waiting") == 0


def test_a_disconnect_cancels_the_request_in_the_engine(server):
    body = {"input_ids": prompt(60, 30), "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
            "stream": True}
    with httpx.Client(timeout=WAIT_S) as c:
        with c.stream("POST", server.url + "/generate", json=body) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert len(json.loads(first[6:])["output_ids"]) >= 1
    # the connection is closed: the engine drops the generation long before its 4000 tokens
    key = ("cpkv:requests_finished_total", (("reason", "cancelled"),))
    wait_for(lambda: server.metrics().get(key, 0) >= 1, "the cancelled request to be counted")
    wait_for(lambda: server.metrics()[("cpkv:engine_requests", ())] == 0, "the engine to drop the generation")
    assert server.metrics()[("cpkv:num_requests_running", ())] == 0
    assert len(generate(server, prompt(61, 20), 2)["output_ids"]) == 2


def test_sigterm_drains_then_exits_0_leaving_nothing(server):
    """Runs last in the module: it ends the shared server."""
    body = {"input_ids": prompt(70, 30), "sampling_params": {"max_new_tokens": 12, "ignore_eos": True},
            "stream": True}
    with httpx.Client(timeout=WAIT_S) as c:
        with c.stream("POST", server.url + "/generate", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert len(json.loads(rest[-2][6:])["output_ids"]) == 12  # the in-flight request finished
    assert server.proc.wait(timeout=WAIT_S) == 0, server.stderr
    wait_for(lambda: not any(alive(p) for p in server.ranks), "every rank to end", 30)
    assert "draining" in server.stderr


# -- a server whose rank gets killed -----------------------------------------------------------------
def test_preset_with_its_tokenizer_then_a_killed_rank():
    s = Server("tiny", api_key="k3y-from-env")
    try:
        anon = httpx.post(s.url + "/generate", json={"input_ids": [1, 2]}, timeout=WAIT_S)
        assert anon.status_code == 401 and anon.json()["error"]["code"] == 401
        assert httpx.get(s.url + "/v1/models", timeout=WAIT_S).status_code == 401
        assert httpx.get(s.url + "/health", timeout=WAIT_S).status_code == 200
        assert httpx.get(s.url + "/metrics", timeout=WAIT_S).status_code == 200
        assert "API key required" in s.stderr and "k3y-from-env" not in s.stderr
        r = s.post("/v1/completions", {"prompt": "hello", "max_tokens": 1})  # the preset ships a tokenizer
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
        assert "text" in generate(s, prompt(80, 20), 1)
        result = {}

        def long_request():
            result["r"] = s.post("/generate", {"input_ids": prompt(81, 20),
                                               "sampling_params": {"max_new_tokens": 5000}})

        t = threading.Thread(target=long_request)
        t.start()
        wait_for(lambda: s.metrics()[("cpkv:num_requests_running", ())] == 1, "the long request to run")
        os.kill(s.ranks[1], signal.SIGKILL)
        t.join(WAIT_S)
        assert result["r"].status_code == 503, result["r"].text
        assert "rank 1" in result["r"].json()["error"]["message"]
        assert s.proc.wait(timeout=WAIT_S) == 2
        assert re.search(r"cpkv serve: error: rank 1 (died|was killed)", s.stderr), s.stderr
        wait_for(lambda: not alive(s.ranks[0]), "rank 0 to end", 30)
    finally:
        s.close()
