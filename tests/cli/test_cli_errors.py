"""Bad input from the shell: every command answers with one line naming what was expected and what came,
exits 2, prints no traceback, and leaves no partly written output file. In-process (``cpkv.cli.main``) except
for one subprocess check of the whole program."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpkv.cli import main

ENV = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "..", "src")}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bin.jsonl").write_bytes(bytes(range(128, 256)) * 2)
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "arrival": 0,\n')
    (tmp_path / "dir").mkdir()
    (tmp_path / "badcfg").mkdir()
    (tmp_path / "badcfg" / "config.json").write_text("{not json")
    (tmp_path / "vocab.jsonl").write_text('{"id": "a", "arrival": 0, "tokens": [1, 2, 600]}\n')
    (tmp_path / "i64.jsonl").write_text('{"id": "a", "arrival": 0, "tokens": [1, %d]}\n' % 2 ** 64)
    (tmp_path / "long.jsonl").write_text('{"id": "a", "arrival": 0, "prompt_len": 70000}\n'
                                         '{"id": "b", "arrival": 1, "prompt_len": 70100, "parent": "a"}\n'
                                         '{"id": "c", "arrival": 2, "prompt_len": 40}\n')
    (tmp_path / "bigint.jsonl").write_text('{"id": %s, "arrival": 0, "prompt_len": 5}\n' % ("9" * 5000))
    (tmp_path / "deep.jsonl").write_text('{"id": "a", "arrival": 0, "prompt_len": %s}\n' % ("[" * 100_000))
    (tmp_path / "huge.jsonl").write_text('{"id": "a", "arrival": 0, "prompt_len": 1000000000000}\n')
    (tmp_path / "ok.jsonl").write_text('{"id": "a", "arrival": 0, "prompt_len": 100}\n')
    (tmp_path / "far.jsonl").write_text('{"id": "a", "arrival": 0, "prompt_len": 100}\n'
                                        '{"id": "b", "arrival": 1e308, "prompt_len": 100}\n')
    names = {"empty": "empty.jsonl", "bin": "bin.jsonl", "bad": "bad.jsonl", "dir": "dir", "badcfg": "badcfg",
             "vocab": "vocab.jsonl", "i64": "i64.jsonl", "long": "long.jsonl", "bigint": "bigint.jsonl",
             "deep": "deep.jsonl", "huge": "huge.jsonl", "ok": "ok.jsonl", "far": "far.jsonl"}
    return {k: str(tmp_path / v) for k, v in names.items()} | {
        "missing": str(tmp_path / "missing.jsonl"), "nofolder": str(tmp_path / "no" / "x.jsonl"), "tmp": str(tmp_path)}


def _call(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


CASES = [
    # cpkv run: validated by EngineConfig / the parser before any rank starts
    (["run", "--cp", "0"], "argument --cp: expected an integer in 1..64, got 0"),
    (["run", "--cp", "-1"], "argument --cp: expected an integer in 1..64, got -1"),
    (["run", "--page-size", "3"], "--page-size must be a power of two >= 1, got 3"),
    (["run", "--chunk-size", "0"], "--chunk-size: expected an integer in 1..2^24, got 0"),
    (["run", "--chunk-size", "24"], "--chunk-size 24 must be a multiple of --page-size 64"),
    (["run", "--pages-per-rank", "0"], "--pages-per-rank: expected an integer in 2..2^24, got 0"),
    (["run", "--max-requests", "0"], "--max-requests: expected an integer in 1..65536, got 0"),
    (["run", "--host-pages", "-1"], "--host-pages: expected an integer in 0..2^24, got -1"),
    (["run", "--num-layers", "0"], "--num-layers: expected an integer in 1..1024, got 0"),
    (["run", "--requests", "0"], "--requests: expected an integer in 1..1000000, got 0"),
    (["run", "--timeout", "0"], "--timeout: expected a finite number > 0 and <= 604800, got 0"),
    (["run", "--mode", "bogus"], "invalid choice: 'bogus'"),
    (["run", "--policy", "bogus"], "invalid choice: 'bogus'"),
    (["run", "--model", "bogus"], "expected a preset (glm5, deepseek-v32, tiny; or preset:NAME) or a directory holding config.json"),
    (["run", "--model", "{dir}"], "or a directory holding config.json"),
    (["run", "--model", "{badcfg}"], "config.json: expected a JSON object of model fields"),
    (["run", "--trace", "{dir}"], "--trace '{dir}': expected a regular file, got a directory"),
    (["run", "--trace", "{missing}"], "cannot read the trace (No such file or directory)"),
    (["run", "--trace", "{empty}"], "the trace holds no requests"),
    (["run", "--trace", "{bin}"], "expected a UTF-8 JSONL text file"),
    (["run", "--trace", "{bad}"], "bad.jsonl:1: bad JSON"),
    # issue 18: token ids checked against the model before any rank starts (2), requests that can never run
    # refused unless --allow-rejected, naming the option to change (3)
    (["run", "--trace", "{vocab}"], "--trace {vocab}:1: 'tokens'[2] = 600 is outside the vocabulary of model tiny "
                                    "(token ids 0..511)"),
    (["run", "--trace", "{i64}"], "i64.jsonl:1: 'tokens'[1] must be an integer in 0..2^63-1"),
    (["run", "--pages-per-rank", "2"], "12 of 12 requests can never run under these options (request 's0.t0': "
                                       "pool_pages"),
    (["run", "--pages-per-rank", "2"], "raise --pages-per-rank (now 2) or --cp (now 2)"),
    (["run", "--pages-per-rank", "2"], "or pass --allow-rejected to accept a partial run"),
    (["run", "--trace", "{long}"], "2 of 3 requests can never run under these options (request 'a': max_context: "
                                   "70000 tokens exceed the model's context of"),
    (["run", "--trace", "{long}", "--page-size", "16", "--pages-per-rank", "2", "--allow-rejected"],
     "nothing to run: 3 of 3 requests"),
    # issue 18: trace reading bounded (4)
    (["run", "--trace", "{bigint}"], "bigint.jsonl:1: bad JSON (Exceeds the limit (4300 digits)"),
    (["replay", "{deep}"], "deep.jsonl:1: bad JSON (nested too deeply)"),
    (["replay", "{huge}"], "huge.jsonl:1: 'prompt_len' must be an integer in 1..16777216, got 1000000000000"),
    # issue 40: every trace field has a range (an arrival of 1e308 s would be a silent wait in bench serve)
    (["replay", "{far}"], "far.jsonl:2: 'arrival' must be a number of seconds in 0..10000000"),
    (["run", "--trace", "{far}"], "far.jsonl:2: 'arrival' must be a number of seconds in 0..10000000"),
    (["bench", "serve", "--trace", "{far}", "--url", "http://127.0.0.1:1"], "far.jsonl:2: 'arrival' must be"),
    (["replay", "/dev/zero"], "TRACE '/dev/zero': expected a regular file, got a character device"),
    # issue 18: replay options (10)
    (["replay", "--cp", "4"], "--cp 4: no memory left for KV at cp=4"),
    (["replay", "--cp", "2"], "give a budget with --kv-tokens-per-rank, or raise --cp"),
    (["replay", "{ok}", "--requests", "5"], "--requests: only for the built-in trace, but a TRACE file"),
    (["replay", "{ok}", "--seed", "3", "--scale", "2"], "--seed, --scale: only for the built-in trace"),
    (["replay", "--requests", "5", "--save-trace", "{tmp}/x.jsonl", "--log-batches", "{tmp}/x.jsonl"],
     "--log-batches '{tmp}/x.jsonl' names the same file as --save-trace"),
    (["replay", "{ok}", "--save-trace", "{ok}"], "--save-trace '{ok}' names the same file as TRACE"),
    (["replay", "--requests", "5", "--save-trace", "/proc/x.jsonl"], "--save-trace '/proc/x.jsonl': cannot create a "
                                                                     "file in '/proc'"),
    (["replay", "--chunk-size", "100"], "--chunk-size 100 must be a multiple of --page-size 64"),
    (["check", "compose", "--model", "bogus"], "unknown model preset 'bogus'"),
    (["check", "compose", "--timeout", "0"], "--timeout: expected a finite number > 0 and <= 604800, got 0"),
    # cpkv replay: validated by ReplayConfig / the parser; output paths checked before the run
    (["replay", "--cp", "0"], "--cp: expected an integer in 1..4096, got 0"),
    (["replay", "--chunk-size", "0"], "--chunk-size: expected an integer in 1..2^24, got 0"),
    (["replay", "--page-size", "3"], "--page-size must be a power of two >= 1, got 3"),
    (["replay", "--kv-tokens-per-rank", "0"], "--kv-tokens-per-rank: expected an integer in 1..2^40, got 0"),
    (["replay", "--max-requests", "0"], "--max-requests: expected an integer in 1..65536, got 0"),
    (["replay", "--requests", "0"], "--requests: expected an integer in 1..1000000, got 0"),
    (["replay", "--scale", "-1"], "--scale: expected a finite number > 0 and <= 1000, got -1"),
    (["replay", "--policy", "fifo"], "invalid choice: 'fifo'"),
    (["replay", "{bin}"], "expected a UTF-8 JSONL text file"),
    (["replay", "{dir}"], "TRACE '{dir}': expected a regular file, got a directory"),
    (["replay", "--costs", "{bin}"], "cannot read a cost model"),
    (["replay", "--costs", "/dev/zero"], "--costs '/dev/zero': expected a regular file, got a character device"),
    (["replay", "--requests", "5", "--log-batches", "{dir}"], "--log-batches '{dir}': expected a regular file name, got a directory"),
    (["replay", "--requests", "5", "--save-trace", "{nofolder}"], "does not exist"),
    (["replay", "--requests", "5", "--plot", "{tmp}/ttft.foo"], "expected a file name ending in one of"),
    # cpkv layout
    (["layout", "--cp", "0", "--page-size", "64", "--req", "0:3"], "--cp: expected an integer in 1..4096, got 0"),
    (["layout", "--cp", "2", "--page-size", "64", "--req", "0:3", "--max-context", "0"],
     "--max-context: expected an integer in 1..2^24, got 0"),
    # cpkv check compose: validated by CheckConfig
    (["check", "compose", "--cp", "0"], "cpkv check compose: error: argument --cp: expected an integer in 1..64, got 0"),
    (["check", "compose", "--batches", "0"], "--batches: expected an integer in 1..100000, got 0"),
    (["check", "compose", "--layers", "0"], "--layers: expected an integer in 1..1024, got 0"),
    (["check", "compose", "--seed", "-1"], "--seed: expected an integer in 0..2^63-1, got -1"),
    (["check", "compose", "--page-size", "3"], "--page-size must be a power of two >= 1, got 3"),
    (["check", "compose", "--modes", "bogus"], "unknown compose mode 'bogus'; supported: span-reduce"),
    # benches: bad values first, then the missing device
    (["bench", "compose", "--cp", "0"], "--cp: expected an integer in 1..64, got 0"),
    (["bench", "compose", "--requests", "0"], "--requests: expected an integer in 1..65536, got 0"),
    (["bench", "compose", "--modes", "x"], "unknown compose mode 'x'"),
    (["bench", "engine", "--cp", "0"], "--cp: expected an integer in 1..64, got 0"),
    (["bench", "engine", "--cached", "1.5"], "--cached: expected a share in [0, 1), got 1.5"),
    (["bench", "engine", "--layers", "0"], "--layers: expected an integer in 1..1024, got 0"),
    (["bench", "engine", "--host-load", "0"], "argument --host-load: expected an integer in 1..4096, got 0"),
    (["bench", "engine", "--host-load", "x"], "argument --host-load: expected an integer in 1..4096, got 'x'"),
    (["bench", "engine", "--decode", "--decode-keys", "1,x"], "--decode-keys: expected comma-separated integers"),
    (["bench", "engine", "--decode", "--decode-batches", "0"], "--decode-batches: expected comma-separated integers"),
    (["bench", "decode", "--weights", "fp4"], "--weights: expected distinct values of auto, fp8, bf16"),
    (["bench", "attention", "--tokens", "a,b"], "--tokens: expected comma-separated integers in 1..2^24"),
    (["bench", "attention", "--topk", "10", "--kv-rows", "5"], "expected at most --kv-rows (5)"),
    (["bench", "indexer", "--scenarios", "nope"], "--scenarios: expected some of cold, tail, warm, warm_long"),
    (["bench", "indexer", "--settle-ms", "-1"], "--settle-ms: expected a finite number >= 0 and <= 60000, got -1"),
]


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_usage_errors_exit_2_with_one_line(argv, needle, files, capsys):
    argv = [a.format(**files) for a in argv]
    code, out, err = _call(argv, capsys)
    assert code == 2, err
    assert needle.format(**files) in err
    assert "Traceback" not in err and out == ""
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


NO_CUDA = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on CPU machines")


@NO_CUDA
@pytest.mark.parametrize("argv", [["bench", t] for t in ("compose", "indexer", "attention", "engine")]
                         + [["bench", "indexer", "--decode"]]
                         + [["run", "--device", "cuda"], ["check", "compose", "--device", "cuda"]])
def test_cuda_on_a_cpu_machine_says_so(argv, capsys):
    code, out, err = _call(argv + ["--json"] if argv[0] == "bench" else argv, capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "CUDA" in err
    if argv == ["bench", "engine"]:
        assert "--device cpu runs it on the CPU" in err


def test_failed_replay_leaves_no_partial_output(tmp_path, capsys, monkeypatch):
    """An error mid-run keeps an existing --log-batches file intact and leaves no temporary file."""
    import cpkv.cli.replay_cmd as replay_cli

    log = tmp_path / "batches.jsonl"
    log.write_text("old\n")
    real = replay_cli.replay

    def failing(trace, cfg, costs, log=None, progress=None):
        real(trace, cfg, costs, log=log, progress=progress)
        raise KeyboardInterrupt

    monkeypatch.setattr(replay_cli, "replay", failing)
    code = main(["replay", "--requests", "20", "--scale", "0.01", "--log-batches", str(log)])
    assert code == 130
    assert log.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batches.jsonl"]


def test_replay_outputs_written_whole(tmp_path, capsys):
    log, saved = tmp_path / "b.jsonl", tmp_path / "t.jsonl"
    assert main(["replay", "--requests", "20", "--scale", "0.01", "--json", "--log-batches", str(log),
                 "--save-trace", str(saved)]) == 0
    json.loads(capsys.readouterr().out)  # --json: only JSON on stdout
    assert all(json.loads(line)["requests"] for line in log.read_text().splitlines())
    assert len(saved.read_text().splitlines()) == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.jsonl", "t.jsonl"]


def test_whole_program_binary_trace_and_bad_config():
    """Through ``python -m cpkv``: exit 2, the one-line message, no traceback."""
    for args, needle in ((["replay", "/bin/sh"], "expected a UTF-8 JSONL text file"),
                         (["run", "--cp", "0"], "cpkv run: error: argument --cp: expected an integer in 1..64, got 0")):
        out = subprocess.run([sys.executable, "-m", "cpkv", *args], capture_output=True, text=True, env=ENV,
                             timeout=120)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr
