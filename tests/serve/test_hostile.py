"""The server against a hostile client, in-process (no ranks): request strictness, the API key, body limits and
timeouts, a disconnect mid-body, parsing off the event loop, 404/405 shapes, and the command's exposure checks.
Interleavings are forced with events (a blocking parser, a receive that never completes), never with sleeps."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import socket
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from cpkv.serve import app as app_mod  # noqa: E402
from cpkv.serve.app import OFF_LOOP_BYTES, ServeState, build_app  # noqa: E402
from cpkv.serve.frontend import Frontend  # noqa: E402
from cpkv.serve.metrics import Metrics  # noqa: E402
from cpkv.serve.protocol import BadRequest, parse_chat, parse_completion, parse_generate  # noqa: E402
from test_app import ScriptedClient, until  # noqa: E402

WAIT_S = 60.0  # any wait for a condition that must come (generous: a loaded 2-core machine)


def make(tok=None, **limits) -> tuple[ScriptedClient, object]:
    client = ScriptedClient()
    return client, build_app(ServeState(Frontend(client, Metrics(), 64), tok, "tiny", **limits))


def run(app, coro_fn):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await coro_fn(http)
    return asyncio.run(main())


# -- request strictness (the parsers alone) -------------------------------------------------------------
@pytest.mark.parametrize("parse,body,param,words", [
    (parse_completion, {"prompt": [1], "echo": 0}, "echo", "true or false"),
    (parse_completion, {"prompt": [1], "echo": True, "logprobs": 1}, "echo", "prompt's log-probabilities"),
    (parse_completion, {"prompt": [1], "n": 1.0}, "n", "an integer in 1..64"),
    (parse_completion, {"prompt": [1], "n": True}, "n", "an integer in 1..64"),
    (parse_completion, {"prompt": [1], "n": 65}, "n", "an integer in 1..64"),
    (parse_completion, {"prompt": [1], "temperature": -0.1}, "temperature", ">= 0"),
    (parse_completion, {"prompt": [1], "top_p": 0}, "top_p", "in (0, 1]"),
    (parse_completion, {"prompt": [1], "top_k": -2}, "top_k", "-1 or 0"),
    (parse_completion, {"prompt": [1], "top_k": 2.0}, "top_k", "-1 or 0"),
    (parse_completion, {"prompt": [1], "min_p": 1.5}, "min_p", "in [0, 1]"),
    (parse_completion, {"prompt": [1], "presence_penalty": 2.5}, "presence_penalty", "in [-2, 2]"),
    (parse_completion, {"prompt": [1], "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    (parse_completion, {"prompt": [1], "seed": 1.5}, "seed", "an integer"),
    (parse_completion, {"prompt": [1], "logprobs": 21}, "logprobs", "0..20"),
    (parse_completion, {"prompt": [1], "logprobs": True}, "logprobs", "0..20"),
    (parse_completion, {"prompt": [1], "stop": ["a", ""]}, "stop", "non-empty strings"),
    (parse_completion, {"prompt": [1], "stop": 3}, "stop", "non-empty strings"),
    (parse_completion, {"prompt": [1], "stop_token_ids": [-1]}, "stop_token_ids", "token id"),
    (parse_completion, {"prompt": [1], "best_of": 2}, "best_of", "not supported by this server"),
    (parse_completion, {"prompt": [1], "min_tokens": 3}, "min_tokens", "not supported by this server"),
    (parse_completion, {"prompt": [1], "use_beam_search": True}, "use_beam_search", "not supported"),
    (parse_completion, {"prompt": [1], "logit_bias": {"5": 1}}, "logit_bias", "not supported"),
    (parse_completion, {"prompt": [1], "suffix": "x"}, "suffix", "not supported"),
    (parse_completion, {"prompt": [1], "response_format": {"type": "json_object"}}, "response_format",
     "not supported"),
    (parse_completion, {"prompt": [[1], "w2", [3]], "n": 2, "frobnicate": 0}, "frobnicate", "unknown field"),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "needs 'logprobs'"),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools",
     "not supported"),
    (parse_chat, {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": 1}},
     "chat_template_kwargs", "not supported"),
    (parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", "type \"image_url\" are not supported"),
    (parse_chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0]", "\"text\": string"),
    (parse_chat, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "text parts"),
    (parse_generate, {"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n", "not supported"),
    (parse_generate, {"input_ids": [1], "sampling_params": {"min_new_tokens": 2}}, "sampling_params.min_new_tokens",
     "not supported"),
    (parse_generate, {"input_ids": [1], "return_hidden_states": True}, "return_hidden_states", "not supported"),
    (parse_generate, {"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len", "not supported"),
    (parse_generate, {"input_ids": [1], "sampling_params": {"top_k": 0.5}}, "sampling_params.top_k", "-1 or 0"),
    (parse_completion, {"prompt": [1], "stream": 1}, "stream", "true or false"),
    (parse_completion, {"prompt": [1], "temperature": math.nan}, "temperature", "must be a finite number, got nan"),
    (parse_completion, {"prompt": [1], "temperature": math.inf}, "temperature", "finite number, got inf"),
    (parse_completion, {"prompt": [1], "top_p": math.nan}, "top_p", "finite number"),
    (parse_completion, {"prompt": [1], "max_tokens": 10 ** 12}, "max_tokens", "1..2147483647"),
    (parse_completion, {"prompt": [1], "max_tokens": 5.0}, "max_tokens", "an integer"),
    (parse_completion, {"prompt": "\ud800 w1"}, "prompt", "lone surrogate"),
    (parse_completion, {"prompt": [1], "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats", "true or false"),
    (parse_completion, {"prompt": [1], "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "include_usage"),
    (parse_completion, {"prompt": [1], "stream_options": {"include_usage": True, "extra": 1}},
     "stream_options.extra", "unknown field"),
    (parse_generate, {"text": "w1 \udfff"}, "text", "lone surrogate"),
    (parse_generate, {"input_ids": [1], "sampling_params": {"skip_special_tokens": "false"}},
     "sampling_params.skip_special_tokens", "true or false"),
    (parse_generate, {"input_ids": [1], "sampling_params": {"ignore_eos": 0}}, "sampling_params.ignore_eos",
     "true or false"),
    (parse_generate, {"input_ids": [1], "return_logprob": 0}, "return_logprob", "true or false"),
    (parse_chat, {"messages": [{"role": "hacker", "content": "hi"}]}, "messages[0].role", "system, user"),
    (parse_chat, {"messages": [{"role": "", "content": "hi"}]}, "messages[0].role", "system, user"),
    (parse_chat, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant> w5 <user", "content": "b"}]},
     "messages[1].role", "system, user"),
    (parse_chat, {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages[0].content", "lone surrogate"),
    (parse_chat, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "unknown field"),
    (parse_chat, {"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name", "a string"),
])
def test_strict_fields_are_400s_naming_them(parse, body, param, words):
    with pytest.raises(BadRequest) as err:
        parse(body)
    assert err.value.status == 400 and err.value.param == param
    assert words in err.value.message, err.value.message
    assert "\n" not in err.value.message


def test_defaults_and_known_values_pass():
    g = parse_generate({"input_ids": [1], "sampling_params": {"skip_special_tokens": False, "ignore_eos": False}})
    assert g.skip_special_tokens is False
    assert parse_generate({"input_ids": [1]}).skip_special_tokens is True
    c = parse_completion({"prompt": [1], "n": 1, "echo": False, "stream": True,
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert c.include_usage and c.continuous_usage
    chat = parse_chat({"messages": [{"role": r, "content": "x"} for r in ("system", "user", "assistant", "tool")]})
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]


def test_sglang_and_vllm_defaults_pass_and_honoured_fields_arrive():
    """What sglang-router and the clients add at their defaults is accepted; the honoured fields reach the request."""
    router_generate = {"input_ids": [1], "background": False, "return_hidden_states": False, "log_metrics": True,
                       "return_text_in_logprobs": False, "no_logs": False, "return_bytes": False,
                       "return_entropy": False, "model": None, "logprob_start_len": -1,
                       "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "top_k": 5, "min_p": 0.1,
                                           "sampling_seed": 9, "stop": "w3", "stop_token_ids": [7], "n": 1,
                                           "no_stop_trim": True, "min_new_tokens": 0,
                                           "spaces_between_special_tokens": True}}
    g = parse_generate(router_generate)
    assert (g.sampling.temperature, g.sampling.top_k, g.sampling.min_p, g.seed) == (0.7, 5, 0.1, 9)
    assert g.stop == ("w3",) and g.stop_token_ids == {7} and g.keep_stop and g.sampling.logprobs is None
    extras = {"ignore_eos": False, "no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
              "max_completion_tokens": 7, "best_of": 1, "logit_bias": {}, "min_tokens": 0, "response_format": None}
    c = parse_completion({"prompt": [[1, 2], "w3"], "n": 3, "top_p": 0.9, "seed": -4, "logprobs": 2,
                          "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, **extras})
    assert c.prompts == [[1, 2], "w3"] and c.n == 3 and c.max_new_tokens == 7 and c.seed == -4
    assert (c.sampling.top_p, c.sampling.logprobs, c.sampling.presence_penalty) == (0.9, 2, 0.5)
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "w5"},
                                                                 {"type": "text", "text": "w6"}]}],
                       "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
                       "logprobs": True, "top_logprobs": 3, "stop": ["a", "b"], "tools": None, "tool_choice": "auto",
                       **extras})
    assert chat.messages[0]["content"] == "w5\nw6" and chat.sampling.logprobs == 3 and chat.stop == ("a", "b")
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True}).sampling.logprobs == 0
    assert parse_completion({"prompt": [1], "temperature": 0}).sampling.greedy


# -- answers -------------------------------------------------------------------------------------------------
class SpecialTokenizer:
    """Decodes id 1 as the special '<eos>' unless skip_special_tokens; every other id as 'w<id>'."""

    has_chat_template = True
    stop_ids = frozenset()

    def text(self, prompt: str) -> list[int]:
        return [2, 3]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join("<eos>" if i == 1 and not skip_special_tokens else f"w{i}" for i in ids if i != 1 or
                        not skip_special_tokens)


def test_skip_special_tokens_false_is_honoured():
    client, app = make(SpecialTokenizer())

    async def go(http):
        out = []
        for skip in (False, True):
            task = asyncio.ensure_future(http.post("/generate", json={
                "input_ids": [4], "sampling_params": {"max_new_tokens": 2, "skip_special_tokens": skip}}))
            await until(lambda: len(client.calls) == len(out) + 1)
            client.answer(len(out) + 1, [5, 1])
            out.append((await task).json()["text"])
        return out
    assert run(app, go) == ["w5 <eos>", "w5"]


def test_continuous_usage_stats_puts_usage_in_every_chunk():
    client, app = make()

    async def go(http):
        async def engine():
            await until(lambda: client.calls)
            client.answer(1, [5, 6, 7])
        answering = asyncio.ensure_future(engine())
        r = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True,
                                                      "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}})
        await answering
        return [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    chunks = run(app, go)
    with_choices = [c for c in chunks if c["choices"]]
    assert [c["usage"]["completion_tokens"] for c in with_choices] == [1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 2 for c in chunks)


@pytest.mark.parametrize("method,path,status,words", [
    ("GET", "/nowhere", 404, "no such path: /nowhere"),
    ("GET", "/v1/completions", 405, "allowed: POST"),
    ("DELETE", "/health", 405, "GET"),
])
def test_404_and_405_are_json_errors(method, path, status, words):
    _, app = make()
    r = run(app, lambda http: http.request(method, path))
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and words in err["message"]


# -- the API key ---------------------------------------------------------------------------------------------
def test_the_api_key_guards_everything_but_health_and_metrics(monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    client, app = make(api_key="s3cret")
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}

    async def go(http):
        out = {}
        for name, headers in (("none", {}), ("wrong", {"Authorization": "Bearer s3cre"}),
                              ("basic", {"Authorization": "Basic s3cret"}), ("longer", {"Authorization":
                                                                                      "Bearer s3cret0"})):
            out[name] = [await http.post("/generate", json=body, headers=headers),
                         await http.get("/v1/models", headers=headers),
                         await http.post("/v1/chat/completions", json={}, headers=headers),
                         await http.get("/nowhere", headers=headers)]
        out["open"] = [await http.get("/health"), await http.get("/metrics")]
        task = asyncio.ensure_future(http.post("/generate", json=body, headers={"Authorization": "bearer s3cret"}))
        await until(lambda: client.calls)
        client.answer(1, [3])
        out["right"] = [await task, await http.get("/v1/models", headers={"Authorization": "Bearer s3cret"})]
        return out
    out = run(app, go)
    for name in ("none", "wrong", "basic", "longer"):
        for r in out[name]:
            assert r.status_code == 401, (name, r.text)
            assert r.json()["error"]["code"] == 401 and "API key" in r.json()["error"]["message"]
            assert r.headers["www-authenticate"] == "Bearer"
    assert [r.status_code for r in out["open"]] == [200, 200]
    assert [r.status_code for r in out["right"]] == [200, 200]
    assert len(client.calls) == 1 and compared  # the only request the engine saw is the authorized one


# -- body limits, timeouts, disconnects (raw ASGI: the test is the server) ----------------------------------
class RawCall:
    """One request driven through the ASGI app by hand: ``messages`` are what receive() hands out, in order;
    after them receive() blocks until ``gone`` is set (then reports a disconnect)."""

    def __init__(self, app, path: str, messages: list[dict], headers: list[tuple[bytes, bytes]] = ()) -> None:
        self.app, self.path, self.messages, self.headers = app, path, list(messages), list(headers)
        self.taken, self.sent = 0, []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        if self.taken < len(self.messages):
            self.taken += 1
            return self.messages[self.taken - 1]
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def __call__(self) -> int:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                 "query_string": b"", "root_path": "", "headers": self.headers, "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 2)}
        await self.app(scope, self.receive, self.send)
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    def body(self) -> dict:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body"))


def chunk(data: bytes, more: bool = True) -> dict:
    return {"type": "http.request", "body": data, "more_body": more}


def test_a_declared_oversize_body_is_413_before_reading_it():
    client, app = make(max_body_bytes=1000)
    call = RawCall(app, "/generate", [chunk(b"x" * 10)], [(b"content-length", b"5000")])
    assert asyncio.run(call()) == 413
    assert call.taken == 0 and "limit of" in call.body()["error"]["message"] and not client.calls


def test_a_streamed_oversize_body_is_413_while_it_is_read():
    """No content-length (chunked): the cap stops the read at the chunk that crosses it; the rest is never taken."""
    client, app = make(max_body_bytes=1000)
    call = RawCall(app, "/generate", [chunk(b"x" * 400) for _ in range(50)])
    assert asyncio.run(call()) == 413
    assert call.taken == 3 and not client.calls  # 400, 800, 1200 > 1000: stop


def test_a_body_that_stops_arriving_is_408():
    """The client sends part of its body and then nothing (a 1 byte/s trickle, or a stall): 408 at the deadline."""
    client, app = make(body_timeout_s=0.3)
    call = RawCall(app, "/generate", [chunk(b'{"input_ids": ')])
    assert asyncio.run(asyncio.wait_for(call(), WAIT_S)) == 408
    assert "did not arrive within 0.3 s" in call.body()["error"]["message"] and not client.calls


def test_a_disconnect_mid_body_is_quiet(caplog):
    client, app = make()
    call = RawCall(app, "/v1/completions", [chunk(b'{"prompt": [1, '), {"type": "http.disconnect"}])
    with caplog.at_level(logging.DEBUG):
        status = asyncio.run(call())
    assert status == 499 and not client.calls
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "Traceback" not in caplog.text


def test_a_long_body_is_parsed_off_the_event_loop(monkeypatch):
    """/health answers while a long body's JSON parse is still running (held by the test) on a worker thread."""
    entered, release = threading.Event(), threading.Event()
    real = app_mod.load_json

    def slow_load(raw: bytes):
        entered.set()
        release.wait(WAIT_S)  # only a parse on the event loop would hold /health until this bound
        return real(raw)
    monkeypatch.setattr(app_mod, "load_json", slow_load)
    client, app = make()
    ids = [7] * (OFF_LOOP_BYTES // 2)  # '7, ' per id: more than OFF_LOOP_BYTES of JSON

    async def go(http):
        big = asyncio.ensure_future(http.post("/generate", json={"input_ids": ids,
                                                                 "sampling_params": {"max_new_tokens": 1}}))
        await until(entered.is_set)
        health = await http.get("/health")
        during = not release.is_set()
        release.set()
        await until(lambda: client.calls)
        client.answer(1, [3])
        return health, during, await big
    health, during, big = run(app, go)
    assert health.status_code == 200 and during
    assert big.status_code == 200 and len(client.calls[1][0]) == len(ids)


# -- the connection: header and drain deadlines ---------------------------------------------------------------
def recv_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a socket timeout raises instead)."""
    out = b""
    while True:
        got = sock.recv(65536)
        if not got:
            return out
        out += got


def test_slow_clients_are_cut_off_and_fast_ones_are_not():
    """A connection holding partial headers is closed at the header deadline, and so is one still sending a body
    after its answer (a 413's) at the drain deadline, the answer read first; a connection whose headers are in
    keeps its request running past both deadlines (its answer comes after the others were cut)."""
    from cpkv.serve.conn import deadline_protocol

    in_app, go_on = threading.Event(), threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            in_app.set()
            await asyncio.get_running_loop().run_in_executor(None, go_on.wait, WAIT_S)
        status = 413 if scope["path"] == "/big" else 200  # /big answers without reading its body
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections wait in the backlog until the server runs: no race with its start
    config = uvicorn.Config(app, log_level="warning", lifespan="off", http=deadline_protocol(0.3, 0.3),
                            timeout_keep_alive=1000)  # only the deadlines under test close a connection
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    conns = []

    def connect() -> socket.socket:
        conns.append(socket.create_connection(sock.getsockname(), timeout=WAIT_S))
        return conns[-1]
    try:
        full = connect()
        full.sendall(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        assert in_app.wait(WAIT_S)
        partial = connect()
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")  # no blank line: the headers never end
        assert recv_all(partial) == b""
        big = connect()
        big.sendall(b"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000)
        assert recv_all(big).startswith(b"HTTP/1.1 413")  # answered, then closed with 999000 bytes unsent
        go_on.set()
        assert full.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        go_on.set()
        for c in conns:
            c.close()
        server.should_exit = True
        thread.join(WAIT_S)


# -- the command's exposure checks -----------------------------------------------------------------------------
def test_the_model_id_is_never_a_path(tmp_path):
    from cpkv.serve.cmd import served_name

    d = tmp_path / "GLM-5-FP8"
    d.mkdir()
    assert served_name(str(d), None) == "GLM-5-FP8"
    assert served_name(str(d) + "/", None) == "GLM-5-FP8"
    assert served_name(str(d), "glm") == "glm"
    assert served_name("tiny", None) == "tiny"


@pytest.mark.parametrize("host,words", [
    ("no-such-host.invalid", "does not resolve"),
    ("203.0.113.77", "not an address of this machine"),
])
def test_a_bad_host_says_what_is_wrong(capsys, host, words):
    from cpkv.cli import main

    assert main(["serve", "--host", host, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "pick another port" not in err[0], err


def test_listening_off_loopback_without_a_key_is_a_warning(capsys):
    from cpkv.serve.cmd import _warn_if_exposed

    for host, key, warned in (("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)):
        with socket.socket() as s:
            s.bind((host, 0))
            _warn_if_exposed(s, key)
        err = capsys.readouterr().err
        assert ("warning: listening on 0.0.0.0" in err) == warned, (host, key, err)
        assert len(err.splitlines()) == (1 if warned else 0)


def test_the_api_key_flag_and_variable(monkeypatch):
    from cpkv.cli import build_parser, main

    monkeypatch.setenv("CPKV_API_KEY", "from-env")
    assert build_parser(["serve"]).parse_args(["serve"]).api_key == "from-env"
    assert build_parser(["serve"]).parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.setenv("CPKV_API_KEY", "has space")
    assert main(["serve", "--port", "0"]) == 2


def test_cpkv_env_never_shows_the_key(monkeypatch, capsys):
    from cpkv.cli import main

    monkeypatch.setenv("CPKV_API_KEY", "topsecret-1")
    assert main(["env", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["CPKV_API_KEY"]["value"] == "(set, hidden)" and rows["CPKV_API_KEY"]["valid"]
    monkeypatch.setenv("CPKV_API_KEY", "topsecret 2")
    assert main(["env"]) == 2
    out = capsys.readouterr()
    assert "topsecret" not in out.out + out.err and "CPKV_API_KEY=(hidden)" in out.err
