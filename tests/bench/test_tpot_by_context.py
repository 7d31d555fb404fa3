"""benchmarks/tpot_by_context.py: the trace it writes is one the trace reader takes (fresh prompts, lengths
interleaved), and its report groups a run's per-request rows by prompt length with the right percentiles, leaving
out failed requests."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tpot_by_context.py"


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("tpot_by_context", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_trace_is_read_back_by_the_trace_reader(mod, tmp_path):
    from cpkv.scheduler.trace import load_trace

    path = tmp_path / "t.jsonl"
    assert mod.main(["make", str(path), "--lengths", "1024,32768", "--each", "3"]) == 0
    reqs = load_trace(str(path))
    assert [r.prompt_len for r in reqs] == [1024, 32768] * 3
    assert len({r.id for r in reqs}) == 6 and all(r.parent is None for r in reqs)


def test_report_groups_by_length_and_drops_failures(mod, tmp_path, capsys):
    rows = [{"prompt_tokens": 1024, "tpot_s": t, "ttft_s": 0.1, "error": None, "completion_tokens": 64}
            for t in (0.002, 0.003, 0.004)]
    rows += [{"prompt_tokens": 32768, "tpot_s": 0.005, "ttft_s": 0.5, "error": None, "completion_tokens": 64},
             {"prompt_tokens": 32768, "tpot_s": None, "ttft_s": None, "error": "HTTP 500", "completion_tokens": 0}]
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert mod.main(["report", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [g["prompt_tokens"] for g in got] == [1024, 32768]
    assert got[0]["ok"] == 3 and got[0]["tpot_ms_p50"] == 3.0 and got[0]["tpot_ms_p90"] == pytest.approx(3.8)
    assert got[1]["requests"] == 2 and got[1]["ok"] == 1 and got[1]["tpot_ms_p50"] == 5.0


def test_bad_lengths_are_a_usage_error(mod, tmp_path):
    with pytest.raises(SystemExit) as e:
        mod.main(["make", str(tmp_path / "t.jsonl"), "--lengths", "1k"])
    assert e.value.code == 2
