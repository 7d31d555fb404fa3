"""GPU: the counting barrier on the stream (rank processes sharing one GPU) and a forward pass with no
device->host synchronisation."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from cpkv.compose.barrier import make_barrier
from cpkv.compose.peer import PeerMemory
from cpkv.dist import launch
from cpkv.engine.instruments import MeasureConfig
from cpkv.errors import ComposeTimeout

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)

ROUNDS = 240
STAMP = 1 << 20  # int64 elements per parity half of each rank's round-stamped data (8 MiB)

SYNC = MeasureConfig(sync_check=True)  # each timed batch's plan + forward: no device->host sync


def _storm(ctx, rounds: int) -> dict:
    """Each round k: a rank writes k over its data (parity half k % 2), arrives and waits on the GPU, then
    counts the elements of every rank's half k % 2 that are not k (an early pass reads round k - 2's stamp).
    Rank k % cp is late: on the host (enqueues 3 ms late), on the device (its stream sleeps before the
    write), or after the reads (its next arrival is late while peers may run a round ahead)."""
    mem = PeerMemory.create(ctx)
    bar = make_barrier(mem, timeout_s=30)
    mem.alloc((2, STAMP), "stamp", torch.int64)
    mem.exchange()
    kind = type(bar).__name__
    bar.bind()
    stamps = mem.peers("stamp")
    bad = torch.zeros(rounds, ctx.world_size, dtype=torch.int64, device=ctx.device)
    for k in range(1, rounds + 1):
        late, how = (k % ctx.world_size) == ctx.rank, (k // ctx.world_size) % 3
        if late and how == 0:
            time.sleep(0.003)
        if late and how == 1:
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU cycles before this rank's write
        stamps[ctx.rank][k % 2].fill_(k)
        bar()
        for s, t in enumerate(stamps):
            bad[k - 1, s] = (t[k % 2] != k).sum()
        if late and how == 2:
            torch.cuda._sleep(2_000_000)
    torch.cuda.synchronize()
    ctx.barrier()
    out = {"kind": kind, "bad": bad.sum(0).tolist(), "bad_rounds": int((bad.sum(1) > 0).sum()),
           "drained": bar.counters(), "rounds": bar.rounds, "timed_out": int(bar.state[1])}
    ctx.barrier()
    mem.close()
    return out


def test_gpu_barrier_storm_with_rotating_late_ranks():
    out = launch(_storm, 3, device="cuda", args=(ROUNDS,), timeout_s=300)
    for rank, o in enumerate(out):
        assert o["kind"] == "DeviceBarrier"
        assert o["bad"] == [0, 0, 0] and o["bad_rounds"] == 0, f"rank {rank} read a peer's data before it arrived: {o}"
        assert o["drained"] == [ROUNDS] * 3 and o["rounds"] == ROUNDS
        assert o["timed_out"] == 0


def _late(ctx) -> dict:
    """Rank cp - 1 never arrives; the others time out once, then later rounds pass without waiting."""
    mem = PeerMemory.create(ctx)
    bar = make_barrier(mem, name="late", timeout_s=0.5)
    mem.exchange()
    bar.bind()
    msg, after_s = None, None
    if ctx.rank != ctx.world_size - 1:
        bar()
        torch.cuda.synchronize()
        t = time.perf_counter()
        bar()
        bar()
        torch.cuda.synchronize()
        after_s = time.perf_counter() - t
        try:
            bar.check()
        except ComposeTimeout as exc:
            msg = str(exc)
    ctx.barrier()
    mem.close()
    return {"msg": msg, "after_s": after_s}


def test_gpu_barrier_timeout_names_the_late_rank():
    out = launch(_late, 3, device="cuda", timeout_s=120)
    for rank in (0, 1):
        msg = out[rank]["msg"]
        assert msg is not None and f"rank {rank}:" in msg and "round 1 timed out" in msg, msg
        assert "ranks [2] never arrived (their counts: [0])" in msg, msg
        assert out[rank]["after_s"] < 0.4, "rounds after a timeout must not wait again"
    assert out[2]["msg"] is None


# GLM-5 shapes (two layers): every part of the forward runs a GPU kernel, none the torch reference
def _trace():
    from cpkv.scheduler.trace import TraceRequest

    return [TraceRequest("a0", 0.0, 3000), TraceRequest("b0", 0.0, 2500), TraceRequest("a1", 0.0, 4500, None, "a0"),
            TraceRequest("c0", 0.0, 700)]


def test_batches_at_cp2_run_without_a_host_sync():
    """Whole batches (plan + forward) at cp 2 on one GPU under symm and prefetch inside
    torch.cuda.set_sync_debug_mode("error"): any device->host synchronisation would raise in the rank."""
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_jobs

    base = EngineConfig(model="glm5", num_layers=2, cp=2, device="cuda", page_size=64, pages_per_rank=200,
                        chunk_size=4096, max_requests=1, warmup=True)
    trace = _trace()
    symm, prefetch = run_jobs([(base, trace, SYNC), (dataclasses.replace(base, mode="prefetch"), trace, SYNC)],
                              timeout_s=500)
    for res in (symm, prefetch):
        assert [r.id for r in res.requests] == ["a0", "b0", "a1", "c0"] and not res.rejected
        assert res.stats["barrier"] == "DeviceBarrier"
        assert res.stats["attention"]["sparse"] > 0 and res.requests[2].cached_len >= 2944
        assert all(bool(torch.isfinite(r.logits).all()) for r in res.requests)
    for a, b in zip(symm.requests, prefetch.requests):  # same batches, byte-exact compose: the same logits
        assert torch.equal(a.logits, b.logits), a.id


def test_shared_indexer_and_moe_layers_run_without_a_host_sync():
    """GLM-5's first 4 layers (full, full, shared, full; dense x 3 then MoE) at cp 2 on one GPU under symm: the
    shared layer's reused top-k and the MoE layer's routing and grouped expert GEMMs add no device->host
    synchronisation either (about 26 GB of weights per rank)."""
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_jobs
    from cpkv.model.config import load_model_config

    cfg_m = load_model_config("glm5", 4)
    assert cfg_m.indexer_types == ("full", "full", "shared", "full") and cfg_m.mlp_layer_types[3] == "sparse"
    cfg = EngineConfig(model="glm5", num_layers=4, cp=2, device="cuda", page_size=64, pages_per_rank=200,
                       chunk_size=4096, max_requests=1, warmup=True)
    (res,) = run_jobs([(cfg, _trace(), SYNC)], timeout_s=500)
    assert [r.id for r in res.requests] == ["a0", "b0", "a1", "c0"] and not res.rejected
    assert res.stats["attention"]["sparse"] > 0
    assert res.stats["experts_per_rank"] == [128, 128]  # expert parallelism: the MoE layer's exchange ran too
    assert res.stats["barrier"] == "DeviceBarrier"
    assert all(bool(torch.isfinite(r.logits).all()) for r in res.requests)
    from cpkv.memplan import Setup, plan_memory

    plan = plan_memory(Setup(cfg.model_config(), 2, budget=1 << 50, weights=cfg.weights_dtype, compute="bfloat16",
                             page_size=64, chunk_size=4096, max_requests=1, pages_per_rank=200))
    for mem in res.stats["gpu_memory_per_rank"]:  # measured per rank: the plan's total bounds what torch allocated
        assert 0 < mem["setup_bytes"] <= mem["peak_bytes"] <= min(mem["peak_reserved_bytes"], plan.total), (mem, plan.items)


@pytest.mark.parametrize("cp", [2, 4])
def test_expert_parallel_moe_layers_run_without_a_host_sync_and_match_one_rank(cp):
    """The tiny model's two MoE layers (24 routed experts) at cp 2 and 4 on one GPU under symm and the sync check:
    each rank holds 24 / cp experts, every MoE layer dispatches and combines through CUDA IPC peer memory and
    GPU barrier rounds (batches in which some ranks hold no tokens included: the 30-token prompt is one page),
    with no device->host synchronisation; logits verified against one process holding every expert."""
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_jobs, verify_run
    from cpkv.scheduler.trace import TraceRequest

    cfg = EngineConfig(model="tiny", cp=cp, device="cuda", page_size=64, pages_per_rank=200, chunk_size=4096,
                       max_requests=1, warmup=True)
    trace = _trace() + [TraceRequest("d0", 0.0, 30)]
    (res,) = run_jobs([(cfg, trace, SYNC)], timeout_s=500)
    assert [r.id for r in res.requests] == ["a0", "b0", "a1", "c0", "d0"] and not res.rejected
    assert res.stats["experts_per_rank"] == [24 // cp] * cp and res.stats["barrier"] == "DeviceBarrier"
    report = verify_run(res, trace)
    assert report.ok, report


def test_uploads_in_a_staging_scope_are_asynchronous_and_exact():
    from cpkv.upload import staging, upload, upload_arrays

    torch.cuda.synchronize()
    host = [torch.arange(n, dtype=dt) * 3 - 7 for n, dt in ((5, torch.int64), (1000, torch.int32),
                                                            (3 << 20, torch.int64), (0, torch.int32))]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with staging("cuda"):
            got = [upload(h, "cuda") for h in host]
            arrays = upload_arrays([np.array([4, 5, 6], np.int32), np.arange(7, dtype=np.int32)], "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for h, g in zip(host, got):
        assert g.is_cuda and g.dtype == h.dtype and torch.equal(g.cpu(), h)
    assert [a.cpu().tolist() for a in arrays] == [[4, 5, 6], list(range(7))]
    assert arrays[1].data_ptr() % 16 == 0  # each array on its own 16-byte boundary


def test_staging_slots_nest_without_sharing_bytes():
    """Batch n+1's plan uploads into the other staging slot while batch n's scope is open: both slots' copies
    land intact (a copy still queued from one slot is never overwritten by the other), the outer scope gets its
    slot back after the inner one, and a slot cannot be opened twice."""
    from cpkv.upload import staging, upload

    torch.cuda.synchronize()
    a, b, c = (torch.arange(1 << 20, dtype=torch.int64) * k for k in (3, 5, 7))
    torch.cuda.set_sync_debug_mode("error")
    try:
        with staging("cuda", 0):
            torch.cuda._sleep(50_000_000)  # the copies below queue behind this (nothing has run when they are made)
            ga = upload(a, "cuda")
            with staging("cuda", 1):
                gb = upload(b, "cuda")
            gc = upload(c, "cuda")  # back in slot 0, after a's bytes
            with pytest.raises(RuntimeError, match="already open"):
                with staging("cuda", 0):
                    pass
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(ga.cpu(), a) and torch.equal(gb.cpu(), b) and torch.equal(gc.cpu(), c)


def test_a_staging_slot_entered_again_waits_for_its_queued_copies_unless_kept():
    """Chained batches: a slot is reset only once the copies its last scope queued have run (else the new
    bytes would overwrite them in the pinned buffer); ``keep`` continues after them without waiting."""
    from cpkv.upload import staging, upload

    torch.cuda.synchronize()
    a, b, c = (torch.arange(1 << 20, dtype=torch.int64) * k for k in (3, 5, 7))
    with staging("cuda", 0):
        torch.cuda._sleep(50_000_000)  # a's copy queues behind this
        ga = upload(a, "cuda")
    with staging("cuda", 0, keep=True):
        gb = upload(b, "cuda")  # after a's bytes: no wait
    with staging("cuda", 0):
        gc = upload(c, "cuda")  # offset 0 again: entered only once a's and b's copies have run
    torch.cuda.synchronize()
    assert torch.equal(ga.cpu(), a) and torch.equal(gb.cpu(), b) and torch.equal(gc.cpu(), c)


def test_chained_chunks_run_without_a_host_sync_and_change_no_byte():
    """A long prompt's chunks chained (each next batch launched before the one before ends, its plan's copies
    queued behind it; the last chunk's logits copied to pinned memory behind it and read after the short
    prompt's batch is launched) at cp 2 under the sync check: the same logits bytes as batches that each drain
    the stream, every batch timed, the long prompt done before the short one. Profiled (one profiler over the
    run), the batches chain the same and each one gets its own kernels, timed from its start."""
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_jobs
    from cpkv.scheduler.trace import TraceRequest

    cfg = EngineConfig(model="tiny", cp=2, device="cuda", page_size=64, pages_per_rank=200, chunk_size=1024,
                       max_requests=1, warmup=True)
    trace = [TraceRequest("long", 0.0, 4000), TraceRequest("short", 0.0, 300)]
    chained, drained, profiled = run_jobs([(cfg, trace, SYNC),
                                           (dataclasses.replace(cfg, look_ahead=False), trace, SYNC),
                                           (cfg, trace, MeasureConfig(sync_check=True, profile=True))], timeout_s=500)
    assert chained.stats["chained"] == 4 and drained.stats["chained"] == 0  # chunks 1-4 of 4 chained on
    assert profiled.stats["chained"] == 4
    kernels, host_ops = profiled.stats["kernels"], profiled.stats["host_ops"]
    assert len(kernels) == len(host_ops) == len(profiled.stats["batch_log"]) == 5
    for ks in kernels:  # each batch: its own forward's kernels, from its start on
        assert ks and min(a for _, a, _ in ks) >= 0 and all(b >= a for _, a, b in ks)
    from cpkv.bench.breakdown import classify
    assert all({"gemm", "attention"} <= {classify(n) for n, _, _ in ks} for ks in kernels[:4])  # the long chunks
    assert all(host_ops)
    for res in (chained, drained, profiled):
        assert not res.rejected and len(res.stats["batch_s"]) == len(res.stats["batch_log"])
        assert all(t > 0 for t in res.stats["batch_s"])
    for a, b, c in zip(chained.requests, drained.requests, profiled.requests):
        assert a.id == b.id == c.id and torch.equal(a.logits, b.logits) and torch.equal(a.logits, c.logits), a.id
    ttft = {r.id: r.ttft_s for r in chained.requests}
    assert 0 < ttft["long"] < ttft["short"]
