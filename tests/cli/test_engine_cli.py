"""``cpkv run`` end to end: the JSON contract and the exit status."""
from __future__ import annotations

import json

import pytest

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
    assert main(["run", "--trace", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
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
