from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "..", "src")}


def cpkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cpkv", *args], capture_output=True, text=True, env=ENV, timeout=120)


def test_help_lists_commands():
    out = cpkv("--help")
    assert out.returncode == 0
    for name in ("layout", "env", "check", "bench"):
        assert name in out.stdout


def test_env_lists_registry():
    out = cpkv("env", "--json")
    assert out.returncode == 0
    names = {v["name"] for v in json.loads(out.stdout)}
    assert "CPKV_BARRIER_TIMEOUT_S" in names and all(n.startswith("CPKV_") for n in names)


def test_layout_json_schema():
    out = cpkv("layout", "--cp", "2", "--page-size", "64", "--req", "128:100", "--req", "0:70", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert (d["page_size"], d["cp"], d["strategy"]) == (64, 2, "zigzag")
    r0 = d["requests"][0]
    assert (r0["prefix_len"], r0["extend_len"]) == (128, 100)
    assert [(c["start"], c["end"]) for c in r0["current_pages"]] == [(128, 192), (192, 228)]
    assert all(c["writer"] in (0, 1) for c in r0["current_pages"])
    assert [(p["request"], p["kind"]) for p in d["logical_pages"]] == [
        (0, "prefix"), (0, "prefix"), (0, "current"), (0, "current"), (1, "current"), (1, "current")]
    assert [p["rank"] for p in d["logical_pages"][:2]] == [0, 1]  # round-robin owners
    assert len(d["rank_work"]) == 2 and sum(d["rank_work"]) == sum(range(129, 229)) + sum(range(1, 71))


@pytest.mark.parametrize("args,needle", [
    (["--cp", "2", "--page-size", "64", "--req", "12"], "expected PREFIX:EXTEND"),
    (["--cp", "2", "--page-size", "64", "--req", "a:b"], "expected PREFIX:EXTEND"),
    (["--cp", "2", "--page-size", "64", "--req", "0:0"], "extend_len must be an integer >= 1"),
    (["--cp", "2", "--page-size", "64", "--req=-64:3"], "prefix_len must be an integer >= 0"),
    (["--cp", "2", "--page-size", "24", "--req", "0:3"], "power of two"),
    (["--cp", "0", "--page-size", "64", "--req", "0:3"], "--cp: expected an integer in 1..4096, got 0"),
    (["--cp", "2", "--page-size", "64", "--req", "0:9000", "--max-context", "8192"], "maximum context of 8192"),
    (["--cp", "2", "--page-size", "64", "--req", "0:3", "--strategy", "spiral"], "invalid choice"),
])
def test_layout_usage_errors_exit_2_without_traceback(args, needle):
    out = cpkv("layout", *args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
