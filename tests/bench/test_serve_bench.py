"""``cpkv bench serve``: the load generator against a small in-test HTTP server, the report, the calibration.

The fake server (plain asyncio streams, HTTP/1.1, one request per connection) implements ``/generate``,
streamed ``/v1/completions`` and ``/v1/models``; its answers are a deterministic function of the prompt,
its cached tokens the longest page-aligned prefix shared with an earlier finished prompt, and a test can
hold a request (an event) or fail it (a status code). It logs the order in which requests start and end,
so ordering is asserted from events, never from timing.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any, Awaitable, Callable

import numpy as np
import pytest

from cpkv.bench.serve import Clock, LoadConfig, Record, plan_requests, poisson_due, run_load, trace_due
from cpkv.bench.serve_report import (COST_FIELDS, Geometry, dist, features, fit_costs, isolated, predict, sent_trace,
                                     summary)
from cpkv.cli import main
from cpkv.scheduler.costs import CostModel
from cpkv.scheduler.replay import ReplayConfig
from cpkv.scheduler.trace import (SERVE_SHAPE, TraceRequest, builtin_trace, ideal_hit_ratio, materialize_tokens,
                                  write_trace)

VOCAB = 512
SLACK_S = 120.0  # every wait in these tests; none is expected to come near it


class FakeServer:
    """An HTTP server for the load generator: see the module docstring."""

    def __init__(self, hold: Callable[[list[int]], Awaitable[None]] | None = None,
                 fail: Callable[[list[int]], int | None] | None = None, token_ids: bool = True,
                 info: dict[str, Any] | None = None) -> None:
        self.hold, self.fail, self.token_ids, self.info = hold, fail, token_ids, info
        self.events: list[tuple[str, tuple[int, ...]]] = []
        self.finished: list[tuple[int, ...]] = []
        self.inflight = self.max_inflight = 0
        self.bodies: list[dict[str, Any]] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    @staticmethod
    def output(prompt: list[int], n: int) -> list[int]:
        return [(sum(prompt) + 7 * i) % VOCAB for i in range(n)]

    def cached(self, prompt: list[int]) -> int:
        best = 0
        for prev in self.finished:
            k = 0
            while k < min(len(prev), len(prompt)) and prev[k] == prompt[k]:
                k += 1
            best = max(best, k // 64 * 64)
        return min(best, (len(prompt) - 1) // 64 * 64)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, _ = (await reader.readline()).decode().split()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, v = line.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            await self._route(method, path, json.loads(body) if body else None, writer)
        finally:
            writer.close()

    async def _route(self, method: str, path: str, body: Any, writer: asyncio.StreamWriter) -> None:
        if path == "/v1/models":
            return self._json(writer, 200, {"data": [{"id": "fake-model"}]})
        if path == "/get_server_info":
            return self._json(writer, 200, self.info) if self.info else self._json(writer, 404, {})
        if path == "/detokenize":  # a server without a tokenizer
            return self._json(writer, 404, {"detail": "Not Found"})
        self.bodies.append(body)
        prompt = body["input_ids"] if path == "/generate" else body["prompt"]
        n = body["sampling_params"]["max_new_tokens"] if path == "/generate" else body["max_tokens"]
        status = self.fail(prompt) if self.fail else None
        if status:
            return self._json(writer, status, {"error": {"message": f"refused by the test ({status})"}})
        self.events.append(("start", tuple(prompt)))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.hold:
                await self.hold(prompt)
            out, cached = self.output(prompt, n), self.cached(prompt)
            if path == "/generate":
                self._json(writer, 200, {"output_ids": out, "meta_info": {
                    "prompt_tokens": len(prompt), "cached_tokens": cached, "completion_tokens": n,
                    "ttft_s": 0.25, "e2e_latency_s": 0.5}})
            else:
                await self._stream(writer, prompt, out, cached)
        finally:
            self.inflight -= 1
            self.finished.append(tuple(prompt))
            self.events.append(("end", tuple(prompt)))

    def _json(self, writer: asyncio.StreamWriter, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + data)

    async def _stream(self, writer: asyncio.StreamWriter, prompt: list[int], out: list[int], cached: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for t in out:
            choice = {"index": 0, "text": "", "finish_reason": None, **({"token_ids": [t]} if self.token_ids else {})}
            writer.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await writer.drain()
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await writer.drain()


class FakeClock(Clock):
    """Virtual time: ``sleep_until`` moves it forward at once (never back)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)
        await asyncio.sleep(0)


def conversation_trace() -> list[TraceRequest]:
    return [TraceRequest("a0", 0.0, 100), TraceRequest("b0", 1.5, 70), TraceRequest("a1", 2.0, 180, parent="a0"),
            TraceRequest("c0", 4.0, 30), TraceRequest("a2", 4.5, 300, parent="a1"),
            TraceRequest("b1", 9.0, 90, parent="b0")]


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), SLACK_S))


@pytest.mark.parametrize("endpoint", ["completions", "generate"])
def test_open_loop_sends_at_arrivals_and_follow_ups_after_their_parents(endpoint):
    trace = conversation_trace()
    plan = plan_requests(trace, VOCAB, trace_due(trace))
    toks = materialize_tokens(trace, VOCAB)
    server, clock = FakeServer(), FakeClock()

    async def go():
        port = await server.start()
        return await run_load(plan, LoadConfig(f"http://127.0.0.1:{port}", endpoint=endpoint, max_tokens=3), clock)

    recs = {r.id: r for r in run(go)}
    assert all(r.status == "ok" for r in recs.values())
    for rid in ("a0", "b0", "c0"):  # first turns: exactly at their arrival, with cpkv run's tokens
        assert recs[rid].sent_s == next(r.arrival for r in trace if r.id == rid)
    starts = {p: i for i, (kind, p) in enumerate(server.events) if kind == "start"}
    ends = {p: i for i, (kind, p) in enumerate(server.events) if kind == "end"}
    prompts = {}
    for r in trace:  # every prompt as defined: parent's prompt + parent's output + this turn's new tokens
        own = toks[r.id][len(toks[r.parent]):] if r.parent else toks[r.id]
        prompts[r.id] = (prompts[r.parent] + FakeServer.output(prompts[r.parent], 3) if r.parent else []) + own
        assert tuple(prompts[r.id]) in starts
        assert recs[r.id].prompt_tokens == len(prompts[r.id])
        if r.parent:
            assert ends[tuple(prompts[r.parent])] < starts[tuple(prompts[r.id])]
            assert recs[r.id].sent_s >= max(r.arrival, recs[r.parent].end_s)
            assert recs[r.id].cached_tokens == len(prompts[r.parent]) // 64 * 64 > 0
    assert recs["a0"].output_ids == FakeServer.output(prompts["a0"], 3) and recs["a0"].completion_tokens == 3
    if endpoint == "generate":
        assert recs["a0"].ttft_s == 0.25  # the server's meta_info
        assert server.bodies[0]["sampling_params"] == {"max_new_tokens": 3, "temperature": 0}
    else:
        assert server.bodies[0]["stream"] is True and server.bodies[0]["model"] == "cpkv"


def test_sampling_fields_go_with_every_request():
    """``--temperature`` / ``--top-p`` / ``--top-k`` / ``--min-p`` (``sampling_fields``) travel in each body as its
    endpoint names them; without them a request is greedy."""
    import argparse

    from cpkv.bench.serve import request_body
    from cpkv.bench.serve_cmd import add_arguments, sampling_fields

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert sampling_fields(p.parse_args([])) == {}
    got = sampling_fields(p.parse_args(["--temperature", "0.8", "--top-p", "0.95", "--top-k", "20", "--min-p", "0"]))
    assert got == {"temperature": 0.8, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    gen = request_body("generate", "m", [1, 2], 4, got)
    assert gen["sampling_params"] == {"max_new_tokens": 4, **got}
    comp = request_body("completions", "m", [1, 2], 4, got)
    assert {k: comp[k] for k in got} == got and comp["max_tokens"] == 4
    assert request_body("completions", "m", [1, 2], 4)["temperature"] == 0
    for bad in (["--top-p", "0"], ["--temperature", "-1"], ["--min-p", "1.5"], ["--top-k", "-2"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    due = poisson_due(4000, rate=5.0, seed=3)
    assert due == poisson_due(4000, rate=5.0, seed=3) != poisson_due(4000, rate=5.0, seed=4)
    assert due[0] == 0.0 and all(b >= a for a, b in zip(due, due[1:]))
    assert abs(len(due) / due[-1] - 5.0) < 0.5


def test_duration_stops_sending_and_failures_are_counted_not_raised():
    trace = [TraceRequest("a0", 0.0, 100), TraceRequest("b0", 1.5, 70), TraceRequest("a1", 2.0, 180, parent="a0"),
             TraceRequest("b1", 3.0, 90, parent="b0"), TraceRequest("c0", 4.0, 30),
             TraceRequest("a2", 4.5, 300, parent="a1")]
    plan = plan_requests(trace, VOCAB, trace_due(trace))
    toks = materialize_tokens(trace, VOCAB)
    server = FakeServer(fail=lambda prompt: 503 if prompt == toks["b0"] else None)

    async def go():
        port = await server.start()
        cfg = LoadConfig(f"http://127.0.0.1:{port}", duration_s=4.2)
        return await run_load(plan, cfg, FakeClock())

    recs = {r.id: r for r in run(go)}
    assert recs["b0"].status == "error" and recs["b0"].http_status == 503 and "refused by the test" in recs["b0"].error
    assert recs["b1"].status == "skipped"          # its parent failed
    assert recs["a2"].status == "not_sent"         # due 4.5 > --duration 4.2
    assert [recs[k].status for k in ("a0", "a1", "c0")] == ["ok"] * 3
    s = summary(list(recs.values()))
    assert (s["completed"], s["failed"], s["not_sent"], s["skipped_parent_failed"]) == (3, 1, 1, 1)
    assert s["errors"] == {"HTTP 503: refused by the test (503)": 1}


def test_refused_connection_is_an_error_per_request():
    trace = conversation_trace()[:2]
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    recs = run(lambda: run_load(plan_requests(trace, VOCAB, [0.0, 0.0]), LoadConfig(f"http://127.0.0.1:{port}"),
                                FakeClock()))
    assert [r.status for r in recs] == ["error", "error"] and all("ConnectError" in r.error for r in recs)


def test_closed_loop_keeps_one_request_in_flight():
    trace = builtin_trace(12, seed=1, scale=1 / 512, shape=SERVE_SHAPE)
    server = FakeServer()

    async def go():
        port = await server.start()
        return await run_load(plan_requests(trace, VOCAB, None), LoadConfig(f"http://127.0.0.1:{port}", concurrency=1))

    recs = run(go)
    assert all(r.status == "ok" for r in recs) and server.max_inflight == 1
    order = [p for kind, p in server.events if kind == "start"]
    assert [len(p) for p in order] == [r.prompt_tokens for r in recs]  # trace order


def test_concurrent_open_loop_overlaps_requests():
    """32 requests due at once, each held until all have arrived at the server: they really are in flight together."""
    trace = [TraceRequest(i, 0.0, 40 + i) for i in range(32)]
    everyone = asyncio.Event

    async def go():
        arrived = everyone()
        count = [0]

        async def hold(prompt):
            count[0] += 1
            if count[0] == 32:
                arrived.set()
            await arrived.wait()

        server = FakeServer(hold=hold)
        port = await server.start()
        recs = await run_load(plan_requests(trace, VOCAB, trace_due(trace)), LoadConfig(f"http://127.0.0.1:{port}"))
        return recs, server

    recs, server = run(go)
    assert all(r.status == "ok" for r in recs) and server.max_inflight == 32
    assert isolated(recs) == []


def test_stream_without_token_ids_sends_follow_ups_without_the_output():
    trace = conversation_trace()[:3]
    server = FakeServer(token_ids=False)

    async def go():
        port = await server.start()
        return await run_load(plan_requests(trace, VOCAB, trace_due(trace)), LoadConfig(f"http://127.0.0.1:{port}"),
                              FakeClock())

    recs = {r.id: r for r in run(go)}
    assert recs["a1"].status == "ok" and recs["a1"].parent_output_missing and recs["a1"].prompt_tokens == 180
    assert summary(list(recs.values()))["follow_ups_without_parent_output"] == 1


# -- the report ------------------------------------------------------------------------------------
def _rec(i: int, sent: float, ttft: float, e2e: float, prompt: int = 100, cached: int | None = 0, **kw) -> Record:
    r = Record(i, None, sent, status="ok", sent_s=sent, first_s=sent + ttft, end_s=sent + e2e, prompt_tokens=prompt,
               cached_tokens=cached, completion_tokens=2, **kw)
    return r


def test_percentiles_throughput_and_hit_ratio_against_numpy():
    rng = np.random.default_rng(0)
    ttft = rng.exponential(2.0, 97)
    recs = [_rec(i, float(i), float(t), float(t) + 1.0, prompt=100 + i, cached=i) for i, t in enumerate(ttft)]
    recs.append(Record("x", None, 1.0, status="error", sent_s=1.0, end_s=2.0, error="HTTP 500: boom"))
    s = summary(recs)
    for q in (50, 90, 99):
        assert s["ttft_s"][f"p{q}"] == pytest.approx(np.percentile(ttft, q), rel=1e-12)
        assert s["e2e_s"][f"p{q}"] == pytest.approx(np.percentile(ttft + 1.0, q), rel=1e-12)
    span = max(r.end_s for r in recs) - 0.0
    assert s["duration_s"] == pytest.approx(span)
    assert s["request_throughput"] == pytest.approx(97 / span)
    assert s["cache_hit_ratio"] == pytest.approx(sum(range(97)) / sum(100 + i for i in range(97)))
    assert (s["completed"], s["failed"], s["errors"]) == (97, 1, {"HTTP 500: boom": 1})
    assert dist([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}


def test_calibration_recovers_known_unit_costs():
    g = Geometry(cp=2, chunk_size=512, page_size=64, topk=64)
    truth = np.array([0.02, 4e-4, 3e-8, 2e-6, 5e-6])  # COST_FIELDS order
    rng = np.random.default_rng(1)
    recs, t = [], 0.0
    for i in range(40):
        prompt = int(rng.integers(64, 3000))
        cached = int(rng.integers(0, prompt // 64)) * 64 if i % 2 else 0
        ttft = float(np.dot(features(prompt, cached, g), truth))
        recs.append(_rec(i, t, ttft, ttft, prompt=prompt, cached=cached))
        t += ttft + 1.0  # one at a time: every request ran alone
    out = fit_costs(recs, g)
    assert out["calibration"]["requests_used"] == 40
    got = np.array([out["costs"][k] for k in COST_FIELDS])
    np.testing.assert_allclose(got, truth, rtol=1e-6)
    assert out["costs"]["topk"] == 64 and out["costs"]["layer_overhead_s"] == 0.0
    # the fitted costs are a cost model replay takes, and replay of one request alone gives its measured TTFT
    model = CostModel().updated(out["costs"])
    alone = [recs[0]]
    pred = predict(alone, model, ReplayConfig(cp=2, chunk_size=512, page_size=64, max_requests=8,
                                              kv_tokens_per_rank=255 * 64, model="tiny"))
    assert pred["ttft_s"]["p50"] == pytest.approx(recs[0].ttft_s, rel=0.05)


def test_calibration_needs_requests_that_ran_alone():
    recs = [_rec(i, 0.0, 1.0, 1.0) for i in range(10)]  # all at once: none alone
    out = fit_costs(recs, Geometry())
    assert out["costs"] is None and "--closed-loop" in out["calibration"]["reason"]


def test_sent_trace_keeps_parents_and_send_order():
    recs = [_rec("a", 0.5, 0.1, 0.2, prompt=100), _rec("b", 2.0, 0.1, 0.2, prompt=150)]
    recs[1].parent = "a"
    recs.append(Record("c", "a", 3.0, status="error"))
    tr = sent_trace(recs)
    assert [(r.id, r.arrival, r.prompt_len, r.parent) for r in tr] == [("a", 0.5, 100, None), ("b", 2.0, 150, "a")]


# -- the command -------------------------------------------------------------------------------------
class ServerThread:
    """The fake server on its own event loop in a thread (the command runs asyncio.run in the main thread)."""

    def __init__(self, server: FakeServer) -> None:
        self.server, self.loop = server, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(SLACK_S)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(SLACK_S)


def test_command_calibrates_closed_loop_then_predicts_open_loop(tmp_path, capsys):
    """The two-command flow: a closed-loop run's --json report (its costs) is the --costs of an open-loop run."""
    trace = tmp_path / "t.jsonl"
    write_trace([TraceRequest(i, 0.0, 64 + 40 * i) for i in range(8)], trace)
    out, plot, sent, calib = (tmp_path / n for n in ("r.jsonl", "ttft.png", "sent.jsonl", "calib.json"))
    with ServerThread(FakeServer()) as url:
        base = ["bench", "serve", "--url", url + "/", "--trace", str(trace), "--max-tokens", "2", "--json"]
        assert main([*base, "--closed-loop", "--warmup", "2"]) == 0
        calib.write_text(capsys.readouterr().out)
        rc = main([*base, "--rate", "50", "--costs", str(calib), "--out-jsonl", str(out), "--plot", str(plot),
                   "--sent-trace", str(sent)])
    cal = json.loads(calib.read_text())
    assert cal["url"] == url and cal["served_model"] == "fake-model" and cal["load"]["mode"] == "closed-loop"
    assert cal["warmup"] == {"requests": 2, "failed": 0} and cal["prediction"] is None  # a closed loop: not replayed
    assert cal["calibration"]["requests_used"] == 8 and set(COST_FIELDS) <= set(cal["costs"])
    assert set(cal["calibration"]["fitted_ttft_s"]) == {"p50", "p90", "p99", "mean", "max"}
    assert CostModel.from_json(calib).topk == 64  # the report is a cost file for cpkv replay
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["load"]["mode"] == "poisson" and rep["warmup"] == {"requests": 0, "failed": 0}
    s = rep["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["completion_tokens"]) == (8, 8, 0, 16)
    assert set(s["ttft_s"]) == {"p50", "p90", "p99", "mean", "max"} and s["ttft_s"]["p50"] > 0
    assert cal["summary"]["cache_hit_ratio"] == 0.0 < s["cache_hit_ratio"]  # the server kept the first run's pages
    assert s["request_throughput"] > 0
    pred = rep["prediction"]
    assert pred["costs_from"] == "--costs" and pred["requests"] == 8 and pred["ttft_s"]["p90"] > 0
    assert pred["ratio_to_measured"]["p90"] == pytest.approx(pred["ttft_s"]["p90"] / s["ttft_s"]["p90"])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == list(range(8)) and all(x["status"] == "ok" for x in lines)
    assert {"ttft_s", "e2e_s", "prompt_tokens", "cached_tokens", "completion_tokens", "sent_s"} <= set(lines[0])
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert len(sent.read_text().splitlines()) == 8
    # the documented second command: cpkv replay of the sent requests with the calibrated costs
    assert main(["replay", str(sent), "--costs", str(calib), "--cp", "2", "--chunk-size", "512",
                 "--kv-tokens-per-rank", str(255 * 64), "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert runs[0]["completed"] == 8 and runs[0]["ttft_s"]["p90"] > 0


def test_command_reports_a_dead_server_without_crashing(tmp_path, capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--requests", "3", "--scale", "0.005",
               "--rate", "1000", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 1 and rep["summary"]["failed"] >= 1 and rep["summary"]["completed"] == 0
    assert rep["served_model"] == "default" and rep["load"] == {"mode": "poisson", "rate": 1000.0, "duration_s": None}
    assert rep["costs"] is None and rep["prediction"] is None


@pytest.mark.parametrize("argv, needle", [
    (["--url", "localhost:30000"], "--url 'localhost:30000': expected http://HOST:PORT"),
    (["--url", "http://"], "--url 'http://'"),
    (["--url", "http://h:1", "--concurrency", "4"], "--concurrency 4: only with --closed-loop"),
    ([], "--url: required"),
    (["--url", "http://h:1", "--pages-per-rank", "1"], "--pages-per-rank"),
    (["--url", "http://h:1", "--chunk-size", "100"], "--chunk-size 100 must be a multiple of --page-size 64"),
])
def test_bad_options_are_one_line_exit_2(argv, needle, capsys):
    assert main(["bench", "serve", "--requests", "2", "--scale", "0.01", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cpkv bench serve: error:") and needle in err and "\n" not in err


def test_make_trace_writes_the_seed_shaped_trace(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    argv = ["--make-trace", str(path), "--requests", "50", "--seed", "3", "--scale", "0.01"]
    assert main(["bench", "serve", *argv]) == 0
    lines = path.read_text().splitlines()
    assert len(lines) == 50 and lines == [json.dumps(r.to_json()) for r in
                                          builtin_trace(50, seed=3, scale=0.01, shape=SERVE_SHAPE)]


def test_seed_shaped_trace():
    a = builtin_trace(2000, seed=5, shape=SERVE_SHAPE)
    assert a == builtin_trace(2000, seed=5, shape=SERVE_SHAPE) and a != builtin_trace(2000, seed=6, shape=SERVE_SHAPE)
    lens = np.array([r.prompt_len for r in a])
    roots = np.array([r.prompt_len for r in a if r.parent is None])
    assert lens.max() <= 131072 and roots.min() >= 16384        # conversations of 16K-128K tokens
    assert (roots > 16384).all()                                  # every first prompt needs chunked prefill at 16K
    assert ideal_hit_ratio(a, 64) > 0.85                          # short cache-hit continuations dominate
    new = [r.prompt_len - {x.id: x.prompt_len for x in a}[r.parent] for r in a if r.parent is not None]
    assert len(new) > 0.8 * len(a) and max(new) <= 3072
    small = builtin_trace(200, seed=5, scale=1 / 128, shape=SERVE_SHAPE)
    assert max(r.prompt_len for r in small) <= 1024 and min(r.prompt_len for r in small if r.parent is None) >= 128


def test_text_report_names_the_failures(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace([TraceRequest("a", 0.0, 80), TraceRequest("b", 0.0, 120, parent="a")], trace)
    with ServerThread(FakeServer(fail=lambda prompt: 429)) as url:
        rc = main(["bench", "serve", "--url", url, "--trace", str(trace)])
    out = capsys.readouterr().out
    assert rc == 1 and "0 of 2 completed, 1 failed, 0 not sent, 1 skipped (parent failed)" in out
    assert "1 x HTTP 429: refused by the test (429)" in out and "no calibration" in out


# -- issue 40: a long wait is never silent -------------------------------------------------------------------
def test_waiting_note_names_the_next_arrival_or_the_answers():
    from cpkv.bench.serve import waiting_note

    dues = [0.0, 0.0, 5.0, 9e6]
    assert waiting_note(dues, 0.0) == "next request due in 5 s"
    assert waiting_note(dues, 4.6) == "next request due in 0 s"
    assert waiting_note(dues, 5.0) == "next request due in 8999995 s"
    assert waiting_note(dues, 9e6) == waiting_note([], 0.0) == "waiting for answers"


def test_heartbeat_refreshes_the_progress_line_while_the_load_waits(capsys):
    """Driven by the event loop alone (tick 0, a fake clock): every tick sets the bar's note, and a bar that prints
    at every update (interval 0) prints it."""
    from cpkv.bench.serve_cmd import Waiting, heartbeat, tick_s
    from cpkv.cli.fmt import Progress

    bar = Progress(3, "cpkv bench serve", enabled=False, interval_s=0)
    bar.done = 1
    waiting, clock = Waiting([0.0, 2.0, 9e6]), FakeClock()
    notes = []

    async def go() -> None:
        beat = asyncio.ensure_future(heartbeat(bar, waiting.note, 0))
        for t in (None, 0.5, 3.0, 9e6):
            if t is not None:
                waiting.clock, clock.t = clock, t
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            notes.append(bar.note)
        beat.cancel()

    run(go)
    assert notes == ["warm-up", "next request due in 2 s", "next request due in 8999997 s", "waiting for answers"]
    lines = capsys.readouterr().err.splitlines()
    assert "cpkv bench serve: 1/3 (next request due in 8999997 s, " in "\n".join(lines)
    assert all(line.startswith("cpkv bench serve: 1/3 (") for line in lines)
    assert tick_s(Progress(1, "x", enabled=False, interval_s=0)) == 0.5
    assert tick_s(Progress(1, "x", enabled=False, interval_s=60)) == 5.0


def test_a_far_arrival_is_announced_and_waited_for_with_progress(tmp_path):
    """The whole command, against a port that refuses: the first request fails at once, the second is due in
    9*10^6 s. Its stderr announces the span and then says what it waits for; SIGTERM ends it cleanly. The test
    reads lines until the progress line comes (a watchdog kills the command after SLACK_S: never a hang)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    trace = tmp_path / "far.jsonl"
    trace.write_text('{"id": "a", "arrival": 0, "prompt_len": 10}\n{"id": "b", "arrival": 9000000, "prompt_len": 10}\n')
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "CPKV_PROGRESS_S": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "cpkv", "bench", "serve", "--trace", str(trace), "--url",
                             "http://127.0.0.1:1"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    watchdog = threading.Timer(SLACK_S, proc.kill)
    watchdog.start()
    seen: list[str] = []
    try:
        for line in proc.stderr:
            seen.append(line.rstrip("\n"))
            if "next request due in" in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        code = proc.wait(SLACK_S)
    finally:
        watchdog.cancel()
        proc.kill()
    assert seen[0] == ("cpkv bench serve: the trace's requests arrive over 9000000 s (104.2 days); --duration S "
                       "stops sending after S seconds"), seen
    assert re.match(r"cpkv bench serve: [01]/2 \(next request due in \d+ s, \d+ s\)$", seen[-1]), seen
    assert code == 128 + signal.SIGTERM and "stopped by SIGTERM" in rest and "Traceback" not in rest


def test_the_server_options_come_from_get_server_info_and_flags_override(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace([TraceRequest(i, 0.0, 40) for i in range(3)], trace)
    info = {"cp_size": 3, "chunked_prefill_size": 128, "page_size": 16, "max_running_requests": 5,
            "pages_per_rank": 300, "schedule_policy": "mix", "model_path": "tiny"}
    with ServerThread(FakeServer(info=info)) as url:
        base = ["bench", "serve", "--url", url, "--trace", str(trace), "--closed-loop", "--json"]
        assert main(base) == 0
        got = json.loads(capsys.readouterr().out)["server"]
        assert main([*base, "--cp", "2", "--policy", "solo"]) == 0
        over = json.loads(capsys.readouterr().out)["server"]
    assert got == {"model": "tiny", "policy": "mix", "cp": 3, "chunk_size": 128, "page_size": 16, "max_requests": 5,
                   "pages_per_rank": 300}
    assert over == {**got, "cp": 2, "policy": "solo"}


def test_an_unknown_server_info_falls_back_to_the_defaults():
    import argparse

    from cpkv.bench.serve_cmd import GEOMETRY, from_server

    args = argparse.Namespace(**{k: None for k in GEOMETRY}, policy=None, model=None)
    from_server(args, {"cp_size": "2", "page_size": 0, "schedule_policy": "lpm", "model_path": "/some/dir"})
    assert {k: getattr(args, k) for k in GEOMETRY} == GEOMETRY and (args.policy, args.model) == ("solo", "tiny")


def test_tpot_and_inter_token_latency_from_streamed_chunks():
    def rec(first: float, gaps: list[float]) -> Record:
        times = [first]
        for g in gaps:
            times.append(times[-1] + g)
        return Record(0, None, 0.0, status="ok", sent_s=0.0, first_s=first, end_s=times[-1],
                      completion_tokens=len(times), token_s=times)

    s = summary([rec(1.0, [0.1, 0.3]), rec(2.0, [0.2]), rec(0.5, [])])
    assert s["tpot_s"]["mean"] == pytest.approx((0.2 + 0.2) / 2)  # (end - first) / (tokens - 1); 1 token: none
    assert s["itl_s"]["max"] == pytest.approx(0.3)
    assert s["itl_s"]["p50"] == pytest.approx(0.2) and s["itl_s"]["mean"] == pytest.approx(0.2)


def test_a_streamed_run_reports_tpot_and_itl(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace([TraceRequest(i, 0.0, 40) for i in range(3)], trace)
    with ServerThread(FakeServer()) as url:
        assert main(["bench", "serve", "--url", url, "--trace", str(trace), "--closed-loop", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "measured TPOT" in out and "inter-token latency" in out


def test_text_prompts_need_the_servers_detokenize(tmp_path, capsys):
    """--prompt-format text against a server without /detokenize: an error naming it, no request sent."""
    server = FakeServer()
    with ServerThread(server) as url:
        rc = main(["bench", "serve", "--url", url, "--requests", "2", "--scale", "0.005", "--closed-loop",
                   "--prompt-format", "text"])
    assert rc != 0 and "POST /detokenize: HTTP 404" in capsys.readouterr().err
    assert server.bodies == []
