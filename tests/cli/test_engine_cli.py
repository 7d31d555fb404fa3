"""``cpkv run`` end to end: the JSON contract and the exit status."""
from __future__ import annotations

import json
import re

import pytest

import cpkv.cli.run_cmd as run_cli
from cpkv.cli import main

pytestmark = pytest.mark.slow


def test_cpkv_run_json(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in [
        {"id": "a", "arrival": 0, "prompt_len": 120},
        {"id": "b", "arrival": 1, "prompt_len": 150, "parent": "a"},
        {"id": "c", "arrival": 2, "tokens": [5] * 40},
        {"id": "z", "arrival": 3, "prompt_len": 70000},
    ]))
    assert main(["run", "--trace", str(trace), "--json"]) == 2  # z can never run: refused before any rank starts
    assert "request 'z': max_context" in capsys.readouterr().err
    assert main(["run", "--trace", str(trace), "--json", "--allow-rejected"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and (out["cp"], out["device"], out["model"], out["mode"]) == (2, "cpu", "tiny", "symm")
    assert out["experts_per_rank"] == [12, 12]  # the tiny model's 24 routed experts split over the 2 ranks
    assert out["gpu_memory_per_rank"] is None  # CUDA only
    assert out["trace"] == {"file": str(trace), "requests": 4}
    assert out["summary"]["command_s"] >= out["summary"]["ranks_s"] >= out["summary"]["wall_s"] > 0
    assert [r["id"] for r in out["requests"]] == ["a", "b", "c"]
    assert set(out["requests"][0]) == {"id", "prompt_len", "cached_len", "ttft_s", "first_token"}
    assert out["requests"][1]["cached_len"] == 64  # a's one full page (default page size 64)
    assert out["rejected"][0]["id"] == "z" and "max_context" in out["rejected"][0]["reason"]
    for key in ("wall_s", "tokens_per_s", "cache_hit_ratio", "kv_pages_per_rank", "kv_pages_replicated"):
        assert key in out["summary"]
    assert out["verify"]["ok"] and out["verify"]["tokens_equal"]
    assert out["verify"]["max_logit_diff"] <= out["verify"]["tolerance"]


def test_bad_trace_is_reported(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": 1, "arrival": 0}\n')
    assert main(["run", "--trace", str(trace)]) == 2
    assert "t.jsonl:1" in capsys.readouterr().err


def test_requests_rejected_by_the_ranks_fail_the_run(capsys, tmp_path, monkeypatch):
    """A request the ranks reject (the parent's check bypassed here) makes the run fail: no PASSED, exit 2, the
    option to change named. Progress lines follow the ranks when stderr is not a terminal."""
    monkeypatch.setattr(run_cli, "never_runs", lambda trace, cfg, model_cfg: {})
    monkeypatch.setenv("CPKV_PROGRESS_S", "0")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "arrival": 0, "prompt_len": 40}\n{"id": "b", "arrival": 0, "prompt_len": 8}\n')
    assert main(["run", "--trace", str(trace), "--page-size", "16", "--pages-per-rank", "2", "--max-requests", "1"]) == 2
    out = capsys.readouterr()
    assert "PASSED" not in out.out and "verification against a single rank: INCOMPLETE" in out.out
    assert re.search(r"^a\s+40\s+-\s+rejected\s+pool_pages", out.out, re.M), out.out
    err = out.err.splitlines()
    assert err[-1].startswith("cpkv run: error: 1 of 2 requests were rejected (request 'a': pool_pages")
    assert "raise --pages-per-rank (now 2)" in err[-1] and "--allow-rejected" in err[-1]
    assert err[0] == "cpkv run: 0/2 (starting 2 rank processes, 0 s)" and any("batch 1" in x for x in err), err


def test_long_conversation_runs_sparse_selection_and_verifies(capsys):
    """``--long N``: the built-in trace gains a two-turn conversation past the model's index top-k (tiny: 64), so the
    run selects sparsely and the verification covers the indexer's decisions."""
    assert main(["run", "--requests", "2", "--long", "200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [r["id"] for r in out["requests"]][-2:] == ["long.t0", "long.t1"]
    assert out["summary"]["attention_calls"]["sparse"] > 0


def test_long_with_a_trace_file_is_one_line(capsys, tmp_path):
    assert main(["run", "--long", "10", "--trace", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--long" in err and len(err.splitlines()) == 1
