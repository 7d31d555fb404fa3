from __future__ import annotations

import json
import sys

import pytest

from cpkv.cli import main
from cpkv.errors import ConfigError
from cpkv.scheduler.costs import CostModel
from cpkv.scheduler.replay import ReplayConfig, percentile, replay
from cpkv.scheduler.trace import BuiltinShape, TraceRequest, builtin_trace, write_trace

SMALL = dict(cp=2, page_size=16, chunk_size=256, kv_tokens_per_rank=8192)


@pytest.fixture(scope="module")
def trace():
    # chunked fresh prompts and multi-turn cache hits at a small scale, arriving fast enough to queue
    return builtin_trace(300, seed=1, scale=1 / 128, shape=BuiltinShape(rate=80.0, think_s=(0.05, 0.2)))


def batches_of(trace, **kw):
    log = []
    res = replay(trace, ReplayConfig(**{**SMALL, **kw}), log=lambda b, t0, t1: log.append((b, t0, t1)))
    return res, log


def test_replay_is_deterministic(trace):
    a = replay(trace, ReplayConfig(**SMALL)).summary()
    b = replay(trace, ReplayConfig(**SMALL)).summary()
    assert a == b
    assert a["completed"] == len(trace) and a["rejected"] == 0
    assert a["batches"] >= 1 and 0 < a["ttft_s"]["p50"] <= a["ttft_s"]["p90"] <= a["ttft_s"]["p99"] <= a["ttft_s"]["max"]


@pytest.mark.parametrize("policy", ["solo", "mix"])
def test_replay_chunked_and_cache_hit_traffic(trace, policy):
    res, log = batches_of(trace, policy=policy)
    assert len(res.ttft) == len(trace) and all(t > 0 for t in res.ttft)
    assert res.hit_tokens / res.prompt_tokens > 0.5
    progress, t_prev, chunked, followers = {}, 0.0, 0, 0
    for batch, t0, t1 in log:
        assert t0 >= t_prev and t1 > t0
        t_prev = t1
        for i, e in enumerate(batch.entries):
            r = e.request
            assert e.prefix_len == progress.get(r.rid, r.cached)   # the true carried prefix
            progress[r.rid] = e.prefix_len + e.extend_len
            if e.chunked:
                chunked += 1
                assert i == 0
                if policy == "solo" or not e.last_chunk:
                    assert len(batch.entries) == 1
                else:
                    followers += len(batch.entries) - 1
            if not e.last_chunk:
                assert e.seq_len % 16 == 0
    assert chunked > 0
    if policy == "mix":
        assert followers > 0          # tail chunks did take followers


def test_shared_kv_caches_more_than_replicated():
    trace = builtin_trace(400, seed=2, scale=1 / 64)
    shared = replay(trace, ReplayConfig(**{**SMALL, "kv": "shared", "cp": 4})).summary()
    repl = replay(trace, ReplayConfig(**{**SMALL, "kv": "replicated", "cp": 4})).summary()
    assert shared["cache_hit_ratio"] > repl["cache_hit_ratio"]


def test_percentile_matches_linear_interpolation():
    v = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(v, 50) == 3.0 and percentile(v, 100) == 10.0 and percentile(v, 0) == 1.0
    assert percentile(v, 90) == pytest.approx(7.6, abs=1e-12)
    assert percentile([], 50) == 0.0


def test_cost_model_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"linear_s_per_token": 1e-4, "num_layers": 61}))
    c = CostModel.from_json(path)
    assert c.linear_s_per_token == 1e-4 and c.num_layers == 61 and isinstance(c.num_layers, int)
    path.write_text(json.dumps({"linear_s_per_tok": 1}))
    with pytest.raises(ConfigError, match="unknown cost field"):
        CostModel.from_json(path)
    with pytest.raises(ConfigError, match=r"topk must be an integer >= 1 and <= 2\^24, got -1"):
        CostModel().updated({"topk": -1})
    with pytest.raises(ConfigError, match="linear_s_per_token must be a finite number >= 0"):
        CostModel().updated({"linear_s_per_token": -1})
    assert 300_000 < CostModel().kv_tokens_per_rank(8) < 500_000


def test_batch_cost_grows_with_prefix_and_extend(trace):
    _, log = batches_of(trace)
    c = CostModel()
    for batch, t0, t1 in log[:50]:
        assert t1 - t0 == pytest.approx(c.batch_seconds(batch), rel=1e-12)
        assert c.batch_seconds(batch, replicated=True) > 0


def test_replicated_kv_holds_one_rank_of_pages():
    trace = [TraceRequest(f"r{i}", float(i), 600) for i in range(5)]
    res = replay(trace, ReplayConfig(**{**SMALL, "kv": "replicated"}))
    assert res.kv_tokens_per_rank == 8192 and len(res.ttft) == 5


# -- the command line -------------------------------------------------------------------------------
def test_cli_json_schema_and_batch_log(tmp_path, capsys, trace):
    path, log = tmp_path / "t.jsonl", tmp_path / "b.jsonl"
    write_trace(trace[:120], path)
    argv = ["replay", str(path), "--policy", "both", "--kv", "both", "--cp", "2", "--page-size", "16",
            "--chunk-size", "256", "--kv-tokens-per-rank", "8192", "--json", "--log-batches", str(log)]
    assert main(argv) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["policy"], r["kv"]) for r in runs] == [("solo", "shared"), ("solo", "replicated"),
                                                      ("mix", "shared"), ("mix", "replicated")]
    for r in runs:
        assert {"policy", "kv", "requests", "ttft_s", "cache_hit_ratio", "batches", "mean_batch_requests",
                "mean_queue_s"} <= set(r)
        assert set(r["ttft_s"]) == {"p50", "p90", "p99", "max"} and r["requests"] == 120
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(rows) == sum(r["batches"] for r in runs)
    for row in rows:
        assert row["t_end"] > row["t_start"]
        for e in row["requests"]:
            assert set(e) == {"id", "prefix_len", "extend_len", "chunked", "last_chunk"}
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["runs"] == runs   # same trace, same report


def test_cli_table_and_builtin(capsys):
    assert main(["replay", "--requests", "60", "--scale", "0.01", "--cp", "2", "--policy", "both",
                 "--kv-tokens-per-rank", "8192"]) == 0
    out = capsys.readouterr().out
    assert "p90 s" in out and "p99 s" in out and "solo" in out and "mix" in out and "built-in trace" in out


def test_cli_malformed_trace_names_the_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1, "arrival": 0, "prompt_len": 5}\n{"id": 2, "arrival": 1, "prompt_len": 9, '
                    '"parent": 3}\n')
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "unknown parent 3" in err


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "ttft.png"
    assert main(["replay", "--requests", "40", "--scale", "0.01", "--cp", "2", "--plot", str(png),
                 "--kv-tokens-per-rank", "8192"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["replay", "--requests", "10", "--scale", "0.01", "--plot", str(tmp_path / "x.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_replay_reports_rejected_requests_and_goes_on():
    trace = [TraceRequest("ok", 0.0, 300), TraceRequest("too-long", 0.0, 300_000), TraceRequest("ok2", 1.0, 200)]
    s = replay(trace, ReplayConfig(**SMALL)).summary()
    assert (s["completed"], s["rejected"], s["rejected_by_reason"]) == (2, 1, {"max_context": 1})
