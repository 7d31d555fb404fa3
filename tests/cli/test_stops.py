"""Stops and failures of rank processes: signals end every rank and leave nothing behind, a dead, stopped or
silent rank is named first, long before the run's limit, a taken port is one error line.

Correct on a loaded machine (CI): every step waits for an event (a rank's line on stdout, a report through
its pipe, a process state in ``/proc``), never for a fixed time, and every bound is slack (``SLACK_S``):
the launcher ends its ranks within ``STOP_S`` of a signal (SIGTERM, then SIGKILL) on an idle machine; the
tests only check that they do end, and that the parent's exit status says why.

Rank functions live at module level (the spawned ranks import this module). Signal tests run a small
launcher (or ``cpkv run``) in a subprocess and watch its rank processes through ``/proc``.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from cpkv.dist import launch
from cpkv.errors import ConfigError, RankFailure

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(HERE)])}
SLACK_S = 60.0  # a bound no healthy run comes near, even with both cores busy
linux_only = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states in /proc")


# -- rank functions --------------------------------------------------------------------------------
def _wait_in_barrier(ctx, seconds):
    """Every rank waits in a collective that rank 0 joins only after ``seconds``."""
    os.write(1, f"rank {ctx.rank} ready\n".encode())  # one write: lines from two ranks never interleave
    if ctx.rank == 0:
        time.sleep(seconds)
    dist.barrier()
    return ctx.rank


def _kill_self(ctx, sig):
    ctx.barrier()
    if ctx.rank == 1:
        os.kill(os.getpid(), sig)
        time.sleep(60)
    dist.barrier()
    return ctx.rank


def _silence_heartbeat(ctx):
    if ctx.rank == 1:
        ctx.report("heard")  # the parent hears this rank once (its heartbeat clock starts), then never again
        ctx.channel.lock.acquire()  # the heartbeat thread can no longer send: the rank looks hung
        time.sleep(600)
    dist.barrier()
    return ctx.rank


# -- in-process ------------------------------------------------------------------------------------
@linux_only
@pytest.mark.parametrize("sig,why", [(signal.SIGKILL, "rank 1 was killed by SIGKILL"),
                                     (signal.SIGSTOP, "rank 1 stopped responding: its process is stopped")])
def test_a_dead_or_stopped_rank_is_named_first(sig, why):
    """Rank 0 waits in a barrier for rank 1, which is killed or stopped: rank 1 is the named cause, and the
    launch ends long before its 120 s limit (rank 0's own error, if any, follows)."""
    with pytest.raises(RankFailure) as info:
        launch(_kill_self, 2, args=(sig,), timeout_s=300, grace_s=0.5)
    assert str(info.value).startswith(why), str(info.value)
    assert info.value.first == 1 and "did not finish" not in str(info.value).split(";")[0]
    assert "\n" not in str(info.value)  # one line; the tracebacks are in exc.tracebacks


def test_a_rank_without_heartbeat_is_named():
    """heartbeat_s 5: rank 0 beats from a thread every 0.25 s, so only a rank whose beats stopped is named (a
    starved parent forgives everyone: it was not running)."""
    with pytest.raises(RankFailure, match=r"^rank 1 stopped responding: no heartbeat for"):
        launch(_silence_heartbeat, 2, timeout_s=300, grace_s=0.5, heartbeat_s=5.0)


def test_a_taken_master_port_is_one_config_error(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("CPKV_MASTER_PORT", str(s.getsockname()[1]))
        with pytest.raises(ConfigError, match=r"CPKV_MASTER_PORT=\d+: cannot listen on .* unset CPKV_MASTER_PORT"):
            launch(_wait_in_barrier, 1, args=(0,), timeout_s=120)


# -- signals, through a subprocess -----------------------------------------------------------------
LAUNCHER = f"""
import signal
import sys
# Ctrl-C's default: a shell's background job (e.g. CI started with `nohup ... &`) starts its processes with SIGINT
# ignored, and Python then leaves it ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
from cpkv.cli import _install_stop_handlers
from cpkv.dist import launch
from test_stops import _wait_in_barrier
_install_stop_handlers()
print("up", flush=True)
try:
    launch(_wait_in_barrier, 2, args=(900,), timeout_s=1200)
except KeyboardInterrupt as exc:
    sys.exit(130)
"""


def _ranks(pid: int, n: int, limit_s: float = 2 * SLACK_S) -> list[int]:
    """The pids of the ``n`` rank processes of ``pid`` (spawned children, the resource tracker left out)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                found += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                continue
        ranks = [c for c in found if "spawn_main" in _cmdline(c)]
        if len(ranks) >= n:
            return ranks
        time.sleep(0.05)
    raise AssertionError(f"{n} rank processes did not start within {limit_s} s")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone_within(pids: list[int], seconds: float = SLACK_S) -> float:
    start = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - start < seconds, f"ranks {[p for p in pids if _alive(p)]} still alive"
        time.sleep(0.02)
    return time.monotonic() - start


@linux_only
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_parent_ends_every_rank(sig):
    """The ranks are up and waiting in their barrier (their lines on stdout: an event, not a sleep); the signal
    ends them all (SIGTERM, SIGKILL STOP_S later) and the parent exits saying which signal it got."""
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ranks = _ranks(proc.pid, 2)
        ready = {proc.stdout.readline().strip() for _ in range(3)}
        assert ready == {"up", "rank 0 ready", "rank 1 ready"}, ready
        proc.send_signal(sig)
        _gone_within(ranks)
        assert proc.wait(timeout=SLACK_S) in (130, 128 + sig)
    finally:
        proc.kill()
        proc.communicate()


@linux_only
def test_a_killed_parent_takes_its_ranks_along():
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ranks = _ranks(proc.pid, 2)
        ready = {proc.stdout.readline().strip() for _ in range(3)}  # past start-up: the ranks run their function
        assert ready == {"up", "rank 0 ready", "rank 1 ready"}, ready
        proc.kill()
        proc.wait(timeout=SLACK_S)
        _gone_within(ranks)  # no orphan re-parented to PID 1 (PR_SET_PDEATHSIG)
    finally:
        proc.communicate()


@linux_only
@pytest.mark.slow
def test_sigterm_to_cpkv_run_stops_it_cleanly():
    """The real command: exit 128 + SIGTERM, one line saying so, every rank gone."""
    proc = subprocess.Popen([sys.executable, "-m", "cpkv", "run"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ranks = _ranks(proc.pid, 2)
        proc.send_signal(signal.SIGTERM)
        _gone_within(ranks)
        out, err = proc.communicate(timeout=SLACK_S)
        assert proc.returncode == 128 + signal.SIGTERM
        assert "cpkv run: stopped by SIGTERM" in err and "Traceback" not in err, err
    finally:
        proc.kill()
        proc.communicate()


@linux_only
def test_sigterm_to_replay_leaves_no_partial_output(tmp_path):
    """--log-batches and --save-trace appear whole or not at all: a stop mid-run leaves the folder as it was."""
    log = tmp_path / "batches.jsonl"
    log.write_text("old\n")
    proc = subprocess.Popen([sys.executable, "-m", "cpkv", "replay", "--requests", "200000", "--cp", "8",
                             "--log-batches", str(log)], env={**ENV, "CPKV_PROGRESS_S": "0"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "replay" in proc.stderr.readline()  # the first progress line: it is replaying
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=SLACK_S)
        assert proc.returncode == 128 + signal.SIGTERM, err
    finally:
        proc.kill()
        proc.communicate()
    assert log.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batches.jsonl"]
