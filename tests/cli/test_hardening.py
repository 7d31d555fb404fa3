"""Hardening cases that are not one command's usage error: the environment registry, torch-free start-up,
bounded trace reading, peer-memory agreement, progress lines, the README test command."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cpkv import envs
from cpkv.config import COMPOSE_MODES
from cpkv.cli import main
from cpkv.errors import TraceError
from cpkv.scheduler.trace import MAX_LINE_BYTES, load_trace

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


# -- environment -----------------------------------------------------------------------------------
BAD_ENV = [
    ("CPKV_LOG_LEVEL", "LOUD", "expected a logging level, one of CRITICAL"),
    ("CPKV_MASTER_PORT", "-1", "expected a TCP port in 0..65535"),
    ("CPKV_MASTER_PORT", "70000", "expected a TCP port in 0..65535"),
    ("CPKV_MASTER_PORT", "http", "expected a TCP port in 0..65535"),
    ("CPKV_BARRIER_TIMEOUT_S", "-1", "expected a finite number of seconds > 0"),
    ("CPKV_BARRIER_TIMEOUT_S", "nan", "expected a finite number of seconds > 0"),
    ("CPKV_MQA_LOGITS_CHUNK_MAX_GB", "0", "expected a finite number of GiB > 0"),
    ("CPKV_COMPOSE_MODE", "fast", "expected one of span-reduce, batch-reduce, prefix-gather, symm, prefetch"),
    ("CPKV_DISABLE_TRITON", "maybe", "expected one of 1/0/true/false"),
    ("CPKV_SPARSE_MLA", "fast", "expected one of auto, cpkv, flashmla"),
    ("CPKV_GROUPED_MM_TORCH", "maybe", "expected one of 1/0/true/false"),
    ("CPKV_PROGRESS_S", "-5", "expected a finite number of seconds >= 0"),
]


@pytest.mark.parametrize("name,value,needle", BAD_ENV, ids=[f"{n}={v}" for n, v, _ in BAD_ENV])
@pytest.mark.parametrize("argv", [["--help"], ["layout", "--cp", "2", "--page-size", "64", "--req", "0:9"],
                                  ["run", "--cp", "2"]], ids=["help", "layout", "run"])
def test_a_bad_variable_is_one_error_line_before_any_command(name, value, needle, argv, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    assert main(argv) == 2
    out = capsys.readouterr()
    line, = out.err.splitlines()
    assert line.startswith(f"cpkv{' ' + argv[0] if argv[0] != '--help' else ''}: error: {name}={value!r}: {needle}")
    assert out.out == ""


def test_cpkv_env_names_the_bad_variable_and_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("CPKV_MASTER_PORT", "70000")
    assert main(["env", "--json"]) == 2
    out = capsys.readouterr()
    rows = {r["name"]: r for r in json.loads(out.out)}
    assert not rows["CPKV_MASTER_PORT"]["valid"] and "0..65535" in rows["CPKV_MASTER_PORT"]["problem"]
    assert all(r["valid"] for n, r in rows.items() if n != "CPKV_MASTER_PORT")
    assert out.err.startswith("cpkv env: error: CPKV_MASTER_PORT='70000'")
    assert main(["env"]) == 2 and "<- INVALID" in capsys.readouterr().out


def test_the_registry_knows_the_compose_modes():
    from cpkv.compose.modes import MODES
    from cpkv.engine.config import MODES as ENGINE_MODES

    assert tuple(COMPOSE_MODES) == tuple(MODES) == tuple(ENGINE_MODES)


@pytest.mark.parametrize("argv", [["--help"], ["env"], ["env", "--json"], ["check", "--help"], ["bench", "--help"],
                                  ["run", "--help"], ["replay", "--help"], ["layout", "--help"],
                                  ["serve", "--help"]])
def test_help_and_env_do_not_import_torch(argv):
    code = ("import sys\nfrom cpkv.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')" % (argv,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "NO TORCH", out.stdout + out.stderr


# -- trace reading ---------------------------------------------------------------------------------
HOSTILE = [
    ('{"id": %s, "arrival": 0, "prompt_len": 5}' % ("9" * 5000), "t:1: bad JSON (Exceeds the limit"),
    ('{"id": "a", "arrival": 0, "prompt_len": %s}' % ("[" * 100_000), "t:1: bad JSON (nested too deeply)"),
    ('{"id": "a", "arrival": 0, "prompt_len": 1000000000000}', "t:1: 'prompt_len' must be an integer in 1..16777216"),
    ('{"id": "a", "arrival": 0, "tokens": [1, %d]}' % 2 ** 64, "t:1: 'tokens'[1] must be an integer in 0..2^63-1"),
    ('{"id": %d, "arrival": 0, "prompt_len": 5}' % 2 ** 70, "t:1: 'id' must be a string or an integer within int64"),
    ('{"id": "a", "arrival": 0, "prompt_len": 9, "parent": "%s"}' % ("x" * 500), "t:1: unknown parent"),
]


@pytest.mark.parametrize("line,needle", HOSTILE, ids=["5000-digit id", "deep nesting", "prompt_len 1e12",
                                                       "token > int64", "id > int64", "long parent"])
def test_hostile_trace_lines_are_trace_errors(line, needle, tmp_path):
    path = tmp_path / "t"
    path.write_text(line + "\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert needle.replace("t:1", f"{path}:1") in str(info.value)
    assert len(str(info.value)) < 400  # a one-line message, whatever the line held


def test_reading_is_bounded(tmp_path):
    """An endless or huge line is refused after MAX_LINE_BYTES, not read into memory whole."""
    path = tmp_path / "long.jsonl"
    path.write_bytes(b'{"id": "a", "arrival": 0, "prompt_len": 4}\n' + b" " * (MAX_LINE_BYTES + 10))
    with pytest.raises(TraceError, match=r"long.jsonl:2: line longer than 32 MiB"):
        load_trace(path)
    if Path("/dev/zero").exists():  # an endless device is refused before it is opened (the input policy)
        with pytest.raises(TraceError, match=r"/dev/zero: expected a regular file, got a character device"):
            load_trace("/dev/zero")


def test_replay_reports_no_ttft_when_nothing_completed(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "arrival": 0, "prompt_len": 10000000}\n')
    assert main(["replay", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    run, = out["runs"]
    assert run["completed"] == 0 and run["rejected"] == 1
    assert run["ttft_s"] == {"p50": None, "p90": None, "p99": None, "max": None}
    assert out["trace"]["requests"] == 1 and out["trace"]["file"] == str(path) and out["cp"] == 8
    assert main(["replay", str(path)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"shared\s+1\s+1\s+0\s+-\s+-\s+-\s+-", text), text


# -- peer memory -----------------------------------------------------------------------------------
def _peer_kind_with_local_env(ctx):
    """Rank 1 alone disables peer memory in its own environment."""
    from cpkv.compose.peer import PeerMemory

    if ctx.rank == 1:
        os.environ["CPKV_DISABLE_PEER_MEMORY"] = "1"
    mem = PeerMemory.create(ctx)
    kind = mem.kind
    mem.close()
    ctx.barrier()
    return kind


def test_peer_memory_agrees_when_ranks_disagree():
    """Every rank joins the probe's collectives; the group settles on no peer memory at once (before the
    fix, rank 0 waited in the probe's exchange until the group's timeout)."""
    from cpkv.dist import launch

    assert launch(_peer_kind_with_local_env, 2, timeout_s=90) == ["none", "none"]


# -- progress --------------------------------------------------------------------------------------
def test_replay_progress_lines_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.setenv("CPKV_PROGRESS_S", "0")
    assert main(["replay", "--requests", "30", "--scale", "0.01", "--json"]) == 0
    out = capsys.readouterr()
    json.loads(out.out)  # stdout is the report alone
    lines = out.err.splitlines()
    assert lines and all(re.fullmatch(r"cpkv replay: \d+/30 \(\d+ s\)", x) for x in lines), lines
    assert lines[-1].startswith("cpkv replay: 30/30")


def test_short_work_prints_no_progress(capsys):
    assert main(["replay", "--requests", "30", "--scale", "0.01"]) == 0  # default: a line every 5 s
    assert capsys.readouterr().err == ""


# -- the README test command -----------------------------------------------------------------------
def _readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    return next(line for line in text.splitlines() if "pytest" in line and not line.startswith("#"))


def test_ci_runs_exactly_the_readme_test_command():
    ci = [x for x in (ROOT / ".ci" / "run").read_text().splitlines() if x and not x.startswith(("#", "set ", "cd "))]
    assert ci == [_readme_test_command()]


def test_the_readme_test_command_prints_the_passed_line(tmp_path):
    """The pytest options of README's command, with this project's configuration: the summary line shows."""
    argv = shlex.split(_readme_test_command().split("&&")[-1])
    opts = argv[argv.index("pytest") + 1:]
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    out = subprocess.run([sys.executable, "-m", "pytest", *opts, "-c", str(ROOT / "pyproject.toml"),
                          "--rootdir", str(tmp_path), "-p", "no:cacheprovider", str(tmp_path / "test_one.py")],
                         capture_output=True, text=True, timeout=120)
    assert re.search(r"\b1 passed\b", out.stdout), out.stdout + out.stderr


# -- short outputs, the soak's CI version ----------------------------------------------------------
def test_layout_of_a_long_request_keeps_lines_short(capsys):
    assert main(["layout", "--cp", "4", "--page-size", "64", "--req", "131072:100"]) == 0
    out = capsys.readouterr().out
    assert max(len(x) for x in out.splitlines()) < 200
    assert "(2048 pages in 2048 runs)" in out  # prefix owners round-robin: every page its own run


def test_check_compose_soak_short_glm5_rows(monkeypatch, capsys):
    """The CI version of the soak recorded in BENCHMARKS.md: GLM-5 row sizes, partial pages, cp 3, every mode."""
    monkeypatch.setenv("CPKV_PROGRESS_S", "0")
    assert main(["check", "compose", "--model", "glm5", "--cp", "3", "--batches", "4", "--layers", "1"]) == 0
    out = capsys.readouterr()
    rows = [r for r in map(str.split, out.out.splitlines()) if len(r) == 6 and r[0] in COMPOSE_MODES]
    assert [r[0] for r in rows] == list(COMPOSE_MODES)
    assert all(r[3] == "0" and r[5] == r[0] for r in rows), rows  # no mismatch; "ran as" the mode itself
    assert "model=glm5" in out.out and "OK: every rank's dense buffers match" in out.out
    assert out.err.splitlines()[-1].startswith("cpkv check compose: 4/4 (cp 3")
