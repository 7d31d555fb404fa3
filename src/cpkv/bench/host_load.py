"""Busy-loop processes that keep host cores busy while a benchmark runs (``cpkv bench engine --host-load``).

A prefill whose forward pass is bound by the host slows down when other processes hold the cores: each
kernel launch waits for a time slice. ``host_load(n)`` starts ``n`` Python processes that spin on the CPU
for as long as the scope lasts; each also checks every 0.2 s that its parent is alive, so a parent killed
with SIGKILL leaves no spinning orphan behind.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Iterator

SPIN = """
import os, sys, time
parent = int(sys.argv[1])  # the launcher's pid, given: it may be gone before this line runs
while os.getppid() == parent:
    until = time.monotonic() + 0.2
    while time.monotonic() < until:
        pass
"""


def default_procs() -> int:
    """One busy process per host core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def host_load(procs: int) -> Iterator[list[subprocess.Popen]]:
    """``procs`` spinning processes for the scope's lifetime (all ended, and reaped, when it exits)."""
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(procs):
            spinners.append(subprocess.Popen([sys.executable, "-c", SPIN, str(os.getpid())], stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield spinners
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
