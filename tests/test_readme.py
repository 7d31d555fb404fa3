"""The README's code blocks, run as a newcomer pastes them from the root of a fresh clone.

Every ```bash block runs under ``bash -e -o pipefail`` and every ```python block under this interpreter, each in
its own fresh copy of the repository (the files a clone has: no .git, .venv or caches) and its own process
session, within a time budget; each must exit with status 0 and leave no process running. ```text blocks are
output, not code; a fence of any other language fails the test (mark it, or make it text).

The rules that let the blocks run inside the environment ``.ci/run`` already installed (the ``test`` extra, a
superset of the others) instead of installing it again:

- A block whose first line is ``# needs: X[, Y]`` is skipped explicitly, each X one of ``cuda`` (a GPU),
  ``checkpoint`` (a real checkpoint's download) or ``network`` (anything else fetched); any other X fails.
- In a line that starts with ``python3 -m venv .venv``, the steps ``python3 -m venv .venv`` and
  ``[.venv/bin/]pip install ...`` are dropped, and what is left of the line runs (``.venv/bin/cpkv run``,
  ``. .venv/bin/activate``). This holds only when the cpkv importable here is this checkout's (an editable
  install, or PYTHONPATH=src); otherwise the blocks are skipped. A ``pip install`` anywhere else in an unmarked
  block fails the test (it would reach the network: mark the block ``# needs: network``).
- The copy's ``.venv/bin`` is a stand-in: ``python`` / ``python3`` run this interpreter, ``cpkv`` runs
  ``python -m cpkv`` from the copy's ``src/``, ``activate`` puts that folder first on PATH.
- The README's test command (the line ``.ci/run`` runs, checked by tests/cli/test_hardening.py) is not run: it is
  what runs this test.
- Port 30000 (the server's default, spelt out in the blocks) becomes a free port, so two runs on one machine
  do not collide.

Whatever a block leaves running is killed with its process group when the block ends, passed or failed.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NEEDS = ("cuda", "checkpoint", "network")
RUN_LANGS = ("bash", "python")
OUTPUT_LANGS = ("text",)
SETUP = "python3 -m venv .venv"
BLOCK_TIMEOUT_S = 120.0  # one block; the tiny model's server starts in ~5 s on an idle 2-core machine
TOTAL_BUDGET_S = 240.0  # all blocks together (~35 s idle on 2 cores)
LEAK_GRACE_S = 15.0  # a block's last process may take this long to exit after the block's shell
NOT_IN_A_CLONE = (".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis")  # at any depth


def _not_in_a_clone(folder: str, names: list[str]) -> set[str]:
    top = Path(folder) == ROOT  # build outputs at the top only: src/cpkv/dist is a package
    return {n for n in names if n in NOT_IN_A_CLONE or n.endswith(".egg-info") or (top and n in ("build", "dist"))}


@dataclass(frozen=True)
class Block:
    """One fenced block of README.md: ``line`` is its opening fence's line (1-based)."""

    line: int
    lang: str
    text: str

    @property
    def needs(self) -> tuple[str, ...]:
        first = self.text.split("\n", 1)[0].strip()
        m = re.fullmatch(r"#\s*needs:\s*(.+)", first)
        return tuple(x.strip() for x in m.group(1).split(",")) if m else ()

    @property
    def id(self) -> str:
        return f"{self.lang}-line{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, in order; an unclosed fence raises ValueError."""
    blocks, opened, body = [], None, []
    for i, line in enumerate(text.splitlines(), 1):
        if opened is None and line.startswith("```"):
            opened, body = (i, line[3:].strip()), []
        elif opened is not None and line.strip() == "```":
            blocks.append(Block(opened[0], opened[1], "\n".join(body) + "\n"))
            opened = None
        elif opened is not None:
            body.append(line)
    if opened is not None:
        raise ValueError(f"README.md line {opened[0]}: a code fence that is never closed")
    return blocks


def ci_test_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    cmds = [x for x in lines if x and not x.startswith(("#", "set ", "cd "))]
    assert len(cmds) == 1, cmds
    return cmds[0]


def as_run_here(block: Block, port: int) -> str:
    """The block's text under this file's rules: setup steps dropped, the test command not run, the port moved."""
    out = []
    for line in block.text.splitlines():
        if line.strip() == ci_test_command():
            line = ":  # the README's test command: it runs this test"
        elif line.startswith(SETUP):
            steps = [s.strip() for s in line.split("&&")]
            kept = [s for s in steps if s != SETUP and not re.match(r"(\.venv/bin/)?pip install ", s)]
            line = " && ".join(kept) or ":"
        out.append(line)
    return re.sub(r"\b30000\b", str(port), "\n".join(out) + "\n")


def _this_checkout_is_installed() -> bool:
    spec = importlib.util.find_spec("cpkv")
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(ROOT / "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stand_in_venv(clone: Path) -> None:
    """clone/.venv/bin: python, python3, cpkv and activate, all reaching this interpreter."""
    bin_ = clone / ".venv" / "bin"
    bin_.mkdir(parents=True)
    exe = shlex.quote(sys.executable)
    scripts = {"python": f'exec {exe} "$@"', "python3": f'exec {exe} "$@"', "cpkv": f'exec {exe} -m cpkv "$@"'}
    for name, body in scripts.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    venv = shlex.quote(str(clone / ".venv"))
    (bin_ / "activate").write_text(f'VIRTUAL_ENV={venv}\nexport VIRTUAL_ENV\nPATH="$VIRTUAL_ENV/bin:$PATH"\n'
                                   "export PATH\nhash -r 2>/dev/null || true\n")


def _live_in_group(pgid: int) -> list[str]:
    """The processes of a process group that have not exited (zombies left out), as 'pid cmdline'."""
    live = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                live.append(f"{d.name} {cmdline}")
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return live


def _end_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while _live_in_group(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


_BLOCKS = readme_blocks(README.read_text())
_started: list[float] = []


def _budget_left() -> float:
    if not _started:
        _started.append(time.monotonic())
    return TOTAL_BUDGET_S - (time.monotonic() - _started[0])


def test_every_block_is_run_output_or_marked():
    """Each fence says its language; a `needs` mark names a known reason; the main job, the server and the tests
    are among the blocks run (so this file cannot pass by skipping them)."""
    for b in _BLOCKS:
        assert b.lang in RUN_LANGS + OUTPUT_LANGS, f"README.md line {b.line}: fence language {b.lang!r}"
        unknown = set(b.needs) - set(NEEDS)
        assert not unknown, f"README.md line {b.line}: needs {sorted(unknown)}, known {list(NEEDS)}"
        if b.lang in RUN_LANGS and not b.needs:
            rest = as_run_here(b, 30000)
            assert "pip install" not in rest, f"README.md line {b.line}: pip install in an unmarked block"
    run = "".join(b.text for b in _BLOCKS if b.lang == "bash" and not b.needs)
    assert _BLOCKS[0].lang == "bash" and ci_test_command() in _BLOCKS[0].text.splitlines()
    for cmd in (".venv/bin/cpkv run\n", "cpkv serve --port 30000", "cpkv bench serve --url", "kill $SERVER; wait $SERVER"):
        assert cmd in run, cmd


@pytest.mark.parametrize("block", [b for b in _BLOCKS if b.lang in RUN_LANGS], ids=lambda b: b.id)
def test_readme_block_runs(block: Block, tmp_path: Path):
    if block.needs:
        pytest.skip(f"README.md line {block.line} needs {', '.join(block.needs)}")
    if not _this_checkout_is_installed():
        pytest.skip("cpkv is not importable from this checkout's src/ (run through .ci/run)")
    timeout = min(BLOCK_TIMEOUT_S, _budget_left())
    assert timeout > 0, f"the README's blocks ran past their {TOTAL_BUDGET_S:.0f} s budget"
    clone = tmp_path / "clone"
    shutil.copytree(ROOT, clone, ignore=_not_in_a_clone)
    _stand_in_venv(clone)
    script = as_run_here(block, _free_port())
    argv = ["bash", "-e", "-o", "pipefail", "-c", script] if block.lang == "bash" else [sys.executable, "-c", script]
    env = {**os.environ, "PYTHONPATH": str(clone / "src"), "NO_PROXY": "localhost,127.0.0.1",
           "no_proxy": "localhost,127.0.0.1", "CPKV_PROGRESS_S": os.environ.get("CPKV_PROGRESS_S", "5")}
    log = tmp_path / "output.txt"
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=clone, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"README.md line {block.line}: still running after {timeout:.0f} s\n{log.read_text()[-4000:]}")
        deadline = time.monotonic() + LEAK_GRACE_S
        while (left := _live_in_group(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rc == 0, f"README.md line {block.line}: exit status {rc}\n{log.read_text()[-4000:]}"
        assert not left, f"README.md line {block.line}: left running: {left}"
    finally:
        _end_group(proc.pid)
