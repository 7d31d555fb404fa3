"""Busy-loop host load (``cpkv bench engine --host-load``): the spinners use the CPU while the scope lasts,
are gone after it, and end on their own when their parent is killed."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpkv.bench.host_load import host_load

SRC = str(Path(__file__).resolve().parents[2] / "src")
linux_only = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states in /proc")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks of 1/100 s


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@linux_only
def test_spinners_burn_cpu_and_are_reaped():
    with host_load(2) as procs:
        pids = [p.pid for p in procs]
        deadline = time.monotonic() + 20  # a loaded machine gives them their time slices late, not never
        while min(_cpu_s(pid) for pid in pids) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_cpu_s(pid) >= 0.2 for pid in pids), [_cpu_s(pid) for pid in pids]
    assert all(p.returncode is not None for p in procs) and not any(_alive(pid) for pid in pids)


@linux_only
def test_spinners_of_a_killed_parent_end_on_their_own():
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from cpkv.bench.host_load import host_load\n"
                               "with host_load(2) as ps:\n    print(*[p.pid for p in ps], flush=True); time.sleep(60)"],
        env={"PYTHONPATH": SRC, "PATH": ""}, stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
def test_bench_engine_reports_each_case_under_host_load(capsys):
    from cpkv.cli import main

    rc = main(["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "1", "--prompt", "256",
               "--long", "0", "--chunk-size", "256", "--page-size", "16", "--runs", "2", "--no-profile",
               "--host-load", "1", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    load, quiet = rep["host_load"], {c["case"]: c for c in rep["cases"]}
    assert load["procs"] == 1 and [c["case"] for c in load["cases"]] == ["cold", "cached", "turn"]
    for c in load["cases"]:
        assert c["quiet_s"] == quiet[c["case"]]["batch_s"] and len(c["loaded_s_runs"]) == 2 and c["loaded_s"] > 0
        assert c["slowdown"] == pytest.approx(c["loaded_s"] / c["quiet_s"] - 1, abs=1e-3)
