"""The counting barrier across real rank processes: no early pass, phase-safe, drained, timeouts named."""
from __future__ import annotations

import os
import time

import pytest

from cpkv.compose.barrier import CountingBarrier, make_barrier
from cpkv.compose.peer import PeerMemory
from cpkv.compose.runtime import ComposeRuntime
from cpkv.config import KINDS, AdmissionCaps, preset
from cpkv.dist import launch
from cpkv.errors import ComposeTimeout, RankFailure
from cpkv.layout import build_layout

ROUNDS = 60


def _storm(ctx, rounds):
    mem = PeerMemory.create(ctx)
    bar = CountingBarrier(mem, timeout_s=60)
    late = CountingBarrier(mem, name="late", timeout_s=1.0)
    mem.alloc_host((1,), "log")
    mem.exchange()
    logs = [t.numpy() for t in mem.peers("log")]
    early = ahead = 0
    for k in range(1, rounds + 1):
        delayed = (k % ctx.world_size) == ctx.rank
        if delayed and k % 2 == 0:
            time.sleep(0.002)  # late arrival
        logs[ctx.rank][0] = k
        bar.arrive()
        if delayed and k % 2 == 1:
            time.sleep(0.002)  # arrived, but slow to wait: peers run one round ahead meanwhile
        bar.wait()
        seen = [int(x[0]) for x in logs]
        early += sum(s < k for s in seen)  # a peer that had not reached round k: we passed early
        ahead += sum(s > k + 1 for s in seen)  # more than one round ahead: phase safety broken
        counts = bar.counters()
        early += sum(c < k for c in counts)
        ahead += sum(c > k + 1 for c in counts)
    ctx.barrier()
    drained = bar.counters()
    timeout_msg = None
    if ctx.rank != ctx.world_size - 1:  # the last rank never arrives at the "late" barrier
        try:
            late()
        except ComposeTimeout as exc:
            timeout_msg = str(exc)
    ctx.barrier()
    mem.close()
    return {"early": early, "ahead": ahead, "drained": drained, "rounds": bar.rounds, "timeout": timeout_msg}


def test_counting_barrier_storm_with_rotating_late_rank():
    out = launch(_storm, 3, args=(ROUNDS,), timeout_s=180)
    for rank, o in enumerate(out):
        assert o["early"] == 0, f"rank {rank} passed a barrier before every rank arrived"
        assert o["ahead"] == 0, f"rank {rank} saw a peer more than one round ahead"
        assert o["drained"] == [ROUNDS] * 3 and o["rounds"] == ROUNDS
    for rank in (0, 1):
        msg = out[rank]["timeout"]
        assert msg is not None and "ranks [2] never arrived" in msg and f"rank {rank}:" in msg
    assert out[2]["timeout"] is None


def _compose_then_die(ctx):
    caps = AdmissionCaps(chunk_size=64, cached_tokens=64, max_requests=2)
    rt = ComposeRuntime.create(ctx, preset("tiny"), num_pages=16, page_size=4, caps=caps, num_layers=2)
    layout = build_layout([(8, 10)], page_size=4, cp=ctx.world_size)
    plan = rt.plan_batch(layout)
    rt.current_rows(plan, 0, "token")
    rt.compose(plan, 0, "token", mode="symm")  # one full round works
    if ctx.rank == 2:
        os._exit(3)
    rt.current_rows(plan, 0, "index")
    try:
        rt.compose(plan, 0, "index", mode="symm")
    except ComposeTimeout as exc:
        return str(exc)
    return None


def test_a_killed_rank_makes_the_others_time_out(monkeypatch):
    monkeypatch.setenv("CPKV_BARRIER_TIMEOUT_S", "1.5")
    with pytest.raises(RankFailure, match="rank 2 died with exit code 3") as info:
        launch(_compose_then_die, 3, timeout_s=120, grace_s=30)
    for rank in (0, 1):
        msg = info.value.results[rank]
        assert msg is not None and "ranks [2] never arrived" in msg, msg
    assert KINDS == ("token", "index")


def _make(ctx):
    mem = PeerMemory.create(ctx)
    bar = make_barrier(mem)
    mem.exchange()
    bar()
    bar()
    return type(bar).__name__, bar.counters()


def test_cpu_runs_keep_the_host_barrier():
    """make_barrier: the GPU barrier needs CUDA IPC peer memory; shared-memory (CPU) groups wait on the host."""
    assert launch(_make, 2, timeout_s=60) == [("CountingBarrier", [2, 2])] * 2
