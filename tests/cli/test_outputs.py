"""The output policy (cpkv.files; README, "Reliability"): what cpkv refuses to write onto, how it replaces a
file, and the ids it refuses to merge. In-process (``cpkv.cli.main``): every refusal comes before any rank
starts or any trace is replayed, so each case takes milliseconds."""
from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from cpkv.cli import main
from cpkv.errors import ConfigError
from cpkv.files import atomic_output, atomic_path, check_outputs, string_keys

REPLAY = ["replay", "--requests", "5", "--scale", "0.01"]


def _call(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text('{"id": "a", "arrival": 0, "prompt_len": 100}\n{"id": "b", "arrival": 1, "prompt_len": 80}\n')
    return p


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    p = tmp_path / "fifo"
    os.mkfifo(p)
    return p


# -- things that are not files -------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--save-trace", "--log-batches"])
def test_a_fifo_is_refused_and_stays_a_fifo(option, fifo, capsys):
    code, _, err = _call([*REPLAY, option, str(fifo)], capsys)
    _one_error(code, err, f"{option} '{fifo}': expected a regular file name, got a FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("argv", [["run", "--logits-out"], [*REPLAY, "--save-trace"], [*REPLAY, "--log-batches"]],
                         ids=["run", "save-trace", "log-batches"])
def test_a_char_device_is_refused_and_stays_a_device(argv, capsys):
    code, _, err = _call([*argv, "/dev/null"], capsys)
    _one_error(code, err, "'/dev/null': expected a regular file name, got a character device")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_socket_and_a_directory_are_refused(tmp_path, capsys):
    sock_path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        code, _, err = _call(["run", "--logits-out", str(sock_path)], capsys)
        _one_error(code, err, "got a socket")
    code, _, err = _call(["run", "--logits-out", str(tmp_path)], capsys)
    _one_error(code, err, "got a directory")


def test_a_symlink_to_a_device_is_refused_naming_the_target(tmp_path, capsys):
    link = tmp_path / "out.safetensors"
    link.symlink_to("/dev/null")
    code, _, err = _call(["run", "--logits-out", str(link)], capsys)
    _one_error(code, err, "got a character device (the symlink points to '/dev/null')")
    assert link.is_symlink() and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_symlink_loop_and_an_empty_name_are_refused(tmp_path, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    code, _, err = _call([*REPLAY, "--save-trace", str(tmp_path / "a")], capsys)
    _one_error(code, err, "symlink loop")
    code, _, err = _call([*REPLAY, "--save-trace", ""], capsys)
    _one_error(code, err, "--save-trace '': expected a file name, got an empty string")


# -- inputs --------------------------------------------------------------------------------------------------
def test_run_refuses_its_trace_as_logits_out_directly_through_a_symlink_and_a_hard_link(trace, tmp_path, capsys):
    before = trace.read_bytes()
    link, hard = tmp_path / "link", tmp_path / "hard"
    link.symlink_to(trace)
    os.link(trace, hard)
    for out in (trace, link, hard):
        code, _, err = _call(["run", "--trace", str(trace), "--logits-out", str(out)], capsys)
        _one_error(code, err, f"--logits-out '{out}' names the same file as --trace, an input of this command")
    assert trace.read_bytes() == before


def test_run_refuses_a_checkpoint_file_as_logits_out(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    shard = ck / "model-00001-of-00002.safetensors"
    shard.write_bytes(b"shard bytes")
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard.name}}))
    for out in (shard, ck / "config.json", ck / "model.safetensors.index.json"):
        code, _, err = _call(["run", "--model", str(ck), "--logits-out", str(out)], capsys)
        _one_error(code, err, f"names the same file as --model ('{out.name}'), an input of this command")
    assert shard.read_bytes() == b"shard bytes"


def test_replay_refuses_its_trace_and_costs_files(trace, tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text("{}")
    code, _, err = _call(["replay", str(trace), "--log-batches", str(trace)], capsys)
    _one_error(code, err, "names the same file as TRACE, an input of this command")
    code, _, err = _call([*REPLAY, "--costs", str(costs), "--save-trace", str(costs)], capsys)
    _one_error(code, err, "names the same file as --costs, an input of this command")
    code, _, err = _call([*REPLAY, "--save-trace", str(tmp_path / "x"), "--log-batches", str(tmp_path / "x")], capsys)
    _one_error(code, err, "names the same file as --save-trace, each output needs its own file")


def test_empty_trace_name_is_an_error_not_the_builtin_trace(capsys):
    code, _, err = _call(["run", "--trace", ""], capsys)
    _one_error(code, err, "--trace '': expected a trace file name, got an empty string")
    code, _, err = _call(["replay", ""], capsys)
    _one_error(code, err, "TRACE '': expected a trace file name")


# -- how a file is replaced ---------------------------------------------------------------------------------
def test_a_replaced_file_keeps_its_permissions_and_a_new_one_gets_the_umask(tmp_path, capsys):
    old = tmp_path / "old.jsonl"
    old.write_text("old\n")
    os.chmod(old, 0o640)
    mask = os.umask(0o027)
    try:
        assert main([*REPLAY, "--save-trace", str(old), "--log-batches", str(tmp_path / "new.jsonl")]) == 0
    finally:
        os.umask(mask)
    capsys.readouterr()
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o640 and len(old.read_text().splitlines()) == 5
    assert stat.S_IMODE(os.stat(tmp_path / "new.jsonl").st_mode) == 0o640  # 0666 & ~0027
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.jsonl", "old.jsonl"]


def test_a_symlink_is_kept_and_its_target_replaced(tmp_path, capsys):
    target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    target.write_text("old\n")
    os.chmod(target, 0o600)
    link.symlink_to(target.name)
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to("made.jsonl")
    assert main([*REPLAY, "--save-trace", str(link), "--log-batches", str(dangling)]) == 0
    capsys.readouterr()
    assert link.is_symlink() and os.readlink(link) == "real.jsonl"
    assert len(target.read_text().splitlines()) == 5 and stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert dangling.is_symlink() and (tmp_path / "made.jsonl").read_text()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "out.txt"
    p.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output(p) as f:
            f.write("partial")
            raise RuntimeError("mid-write")
    assert p.read_text() == "old" and [x.name for x in tmp_path.iterdir()] == ["out.txt"]
    with pytest.raises(FileNotFoundError):  # a block that wrote nothing: nothing appears, not an empty file
        with atomic_path(tmp_path / "never.txt"):
            pass
    assert [x.name for x in tmp_path.iterdir()] == ["out.txt"]


def test_a_long_name_is_written_and_a_too_long_one_refused_in_words(tmp_path):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    longest = tmp_path / ("n" * (limit - 6) + ".jsonl")
    check_outputs({"--save-trace": str(longest)})  # no temporary-name probe gets in its way
    with atomic_output(longest) as f:
        f.write("x\n")
    assert longest.read_text() == "x\n"
    with pytest.raises(ConfigError, match=rf"the file name is {limit + 1} bytes, the file system takes at most {limit}"):
        check_outputs({"--save-trace": str(tmp_path / ("n" * (limit + 1)))})


def test_a_read_only_file_is_refused_unless_root(tmp_path):
    p = tmp_path / "ro.jsonl"
    p.write_text("keep")
    os.chmod(p, 0o444)
    if os.geteuid() == 0:
        pytest.skip("root writes read-only files")
    with pytest.raises(ConfigError, match="read-only"):
        check_outputs({"--save-trace": str(p)})


# -- ids -----------------------------------------------------------------------------------------------------
def test_ids_that_become_one_key_are_an_error_naming_both(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"request ids 1 and '1' both become the key '1'"):
        string_keys([1, "x", "1"], "logits")
    assert string_keys([1, "2", 3], "logits") == ["1", "2", "3"]
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": 1, "arrival": 0, "prompt_len": 40}\n{"id": "1", "arrival": 1, "prompt_len": 40}\n')
    out = tmp_path / "logits.safetensors"
    code, _, err = _call(["run", "--trace", str(trace), "--logits-out", str(out)], capsys)
    _one_error(code, err, "request ids 1 and '1' both become the key '1'")
    assert not out.exists()
