"""The input policy (cpkv.files; README, "Reliability"): a file a command reads that is not a regular file (a
FIFO, a socket, a device, a directory, also through a symlink; a symlink loop) is refused before it is opened,
one line naming the option, exit 2.

A regression here would block on a FIFO's open, so every case that names a FIFO runs in one subprocess with a
generous timeout (the suite fails, never hangs); the other kinds cannot block and run in-process.
"""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cpkv.cli import main
from cpkv.errors import CheckpointError, ConfigError, TraceError
from cpkv.files import check_inputs, check_outputs, input_problem
from cpkv.model.checkpoint import read_header
from cpkv.scheduler.costs import CostModel
from cpkv.scheduler.trace import load_trace
from test_outputs import _one_error  # noqa: E402 (tests/cli on sys.path: one exit-2-and-one-line check)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
FIFO_TIMEOUT_S = 600  # the whole subprocess; each case takes about a second when the policy holds
TRACE_LINE = '{"id": "a", "arrival": 0, "prompt_len": 100}\n'

# (argv with {p} for the path, the option the error names) for every command that reads a file named by an option
COMMANDS = [
    (["run", "--trace", "{p}"], "--trace"),
    (["replay", "{p}"], "TRACE"),
    (["replay", "--requests", "5", "--scale", "0.01", "--costs", "{p}"], "--costs"),
    (["bench", "serve", "--trace", "{p}", "--url", "http://127.0.0.1:1"], "--trace"),
    (["bench", "serve", "--requests", "2", "--scale", "0.01", "--costs", "{p}", "--url", "http://127.0.0.1:1"],
     "--costs"),
]


def _call(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture
def socket_path(tmp_path: Path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        yield path


# -- in-process: kinds whose open cannot block -------------------------------------------------------------
@pytest.mark.parametrize("argv, option", COMMANDS, ids=[" ".join(a[:2]) + " " + o for a, o in COMMANDS])
def test_a_directory_a_socket_a_device_and_a_symlink_to_one_are_refused(argv, option, tmp_path, socket_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    for path, what in ((tmp_path, "a directory"), (socket_path, "a socket"), ("/dev/null", "a character device"),
                       (link, f"a directory (the symlink points to '{tmp_path}')")):
        code, err = _call([a.format(p=path) for a in argv], capsys)
        _one_error(code, err, f"{option} '{path}': expected a regular file, got {what}")


def test_a_symlink_loop_is_refused_naming_the_option(tmp_path, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    code, err = _call(["replay", str(tmp_path / "a")], capsys)
    _one_error(code, err, f"TRACE '{tmp_path / 'a'}': expected a file, got a symlink loop")


def test_bench_serve_refuses_an_empty_trace_name(capsys):
    code, err = _call(["bench", "serve", "--trace", "", "--url", "http://127.0.0.1:1"], capsys)
    _one_error(code, err, "--trace '': expected a file name, got an empty string")


def test_a_regular_file_a_symlink_to_one_and_a_missing_file_pass_the_policy(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(TRACE_LINE)
    link = tmp_path / "link"
    link.symlink_to(f)
    assert [input_problem(p) for p in (f, link, tmp_path / "missing")] == [None, None, None]
    check_inputs({"--trace": str(link), "--costs": [str(f), str(tmp_path / "missing")], "--x": None})
    assert load_trace(link)[0].prompt_len == 100


def test_check_outputs_checks_its_inputs_first(tmp_path):
    with pytest.raises(ConfigError, match=r"^--trace '/dev/null': expected a regular file, got a character device"):
        check_outputs({"--out": str(tmp_path / "out")}, {"--trace": "/dev/null"})


def test_loaders_refuse_what_is_not_a_regular_file(tmp_path, socket_path):
    """The library's own readers check before they open, for callers that declare no inputs."""
    with pytest.raises(TraceError, match=r"expected a regular file, got a directory"):
        load_trace(tmp_path)
    with pytest.raises(ConfigError, match=r"expected a regular file, got a socket"):
        CostModel.from_json(socket_path)
    with pytest.raises(CheckpointError, match=r"expected a safetensors file, got a directory"):
        read_header(tmp_path)


# -- FIFOs: the functions that stat, in-process (they never open) ----------------------------------------
def test_input_problem_names_a_fifo_and_a_symlink_to_one_without_opening_it(tmp_path):
    fifo, link = tmp_path / "f", tmp_path / "link"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    assert input_problem(fifo) == "expected a regular file, got a FIFO: cpkv reads only regular files"
    assert input_problem(link) == (f"expected a regular file, got a FIFO (the symlink points to '{fifo}'): "
                                   "cpkv reads only regular files")
    with pytest.raises(ConfigError, match="^" + re.escape(f"--costs '{fifo}': expected a regular file, got a FIFO")):
        check_inputs({"--costs": [str(tmp_path / "missing"), str(fifo)]})
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# -- FIFOs: every command and loader, in one subprocess ------------------------------------------------------
SCRIPT = r"""
import contextlib, io, json, sys
from cpkv.cli import main
from cpkv.scheduler.costs import CostModel
from cpkv.scheduler.trace import load_trace
from cpkv.model.checkpoint import read_header

out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    out.append([argv, code, err.getvalue()])
for name, fn in (("load_trace", load_trace), ("CostModel.from_json", CostModel.from_json),
                 ("read_header", read_header)):
    try:
        fn(sys.argv[2])
        out.append([name, 0, "no error"])
    except Exception as exc:
        out.append([name, type(exc).__name__, str(exc)])
print(json.dumps(out))
"""


def _checkpoint_with_fifo(folder: Path, fifo_name: str) -> Path:
    from cpkv.config import preset
    from cpkv.model.weights import random_weights, save_checkpoint

    cfg = preset("tiny").with_layers(1)
    save_checkpoint(folder, cfg, random_weights(cfg, seed=0), shards=2)
    (folder / fifo_name).unlink()
    os.mkfifo(folder / fifo_name)
    return folder / fifo_name


def test_a_fifo_is_refused_by_every_command_and_loader_never_opened(tmp_path):
    fifo, link = tmp_path / "fifo", tmp_path / "link"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    shard = _checkpoint_with_fifo(tmp_path / "ck_shard", "model-00001-of-00002.safetensors")
    index = _checkpoint_with_fifo(tmp_path / "ck_index", "model.safetensors.index.json")
    config = _checkpoint_with_fifo(tmp_path / "ck_config", "config.json")
    cases = [([a.format(p=p) for a in argv], f"{option} '{p}': expected a regular file, got a FIFO")
             for argv, option in COMMANDS for p in (fifo, link)]
    cases += [(["run", "--model", str(shard.parent)], f"--model '{shard}': expected a regular file, got a FIFO"),
              (["run", "--model", str(index.parent)], f"--model '{index}': expected a regular file, got a FIFO"),
              (["run", "--model", str(config.parent)], f"--model '{config}': expected a regular file, got a FIFO"),
              (["plan", "--model", str(config.parent), "--cp", "1"], "config.json: the directory holds as a FIFO")]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([c[0] for c in cases]), str(fifo)],
                          capture_output=True, text=True, timeout=FIFO_TIMEOUT_S, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    for (argv, needle), (_, code, err) in zip(cases, results):
        assert code == 2, (argv, err)
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, (argv, err)
        assert lines[0].startswith(f"cpkv {argv[0]}"), (argv, err)
    loaders = {name: (kind, text) for name, kind, text in results[len(cases):]}
    assert loaders == {
        "load_trace": ("TraceError", f"{fifo}: expected a regular file, got a FIFO: cpkv reads only regular files"),
        "CostModel.from_json": ("ConfigError", f"{fifo}: expected a regular file, got a FIFO: cpkv reads only "
                                               "regular files"),
        "read_header": ("CheckpointError", f"{fifo}: expected a safetensors file, got a FIFO")}
    assert all(stat.S_ISFIFO(os.lstat(p).st_mode) for p in (fifo, shard, index, config))
