"""Every compose mode in real rank processes (gloo, shared-memory peer memory, counting barrier)."""
from __future__ import annotations

import pytest
import torch

from cpkv.bench.check import CheckConfig, draw_batch, run_check
from cpkv.compose.modes import MODES
from cpkv.compose.peer import PeerMemory
from cpkv.compose.runtime import ComposeRuntime
from cpkv.config import AdmissionCaps, preset
from cpkv.dist import launch
from cpkv.errors import ComposeError, StagingOverflow
from cpkv.kvcache.pool import KVPool
from cpkv.layout import build_layout

CASES = [  # (cp, page_size, batches, seed)
    (2, 16, 6, 0),
    (3, 4, 4, 1),
    (4, 8, 4, 2),
]


@pytest.mark.parametrize("cp,page_size,batches,seed", CASES)
def test_every_mode_matches_the_reference(cp, page_size, batches, seed):
    cfg = CheckConfig(cp=cp, page_size=page_size, batches=batches, seed=seed, layers=2)
    out = run_check(cfg)
    assert out["ok"], out["modes"]
    assert out["peer_memory"] == "shm"
    modes = out["modes"]
    for name in MODES:
        assert modes[name]["mismatches"] == 0 and modes[name]["bytes"] > 0 and modes[name]["effective"] == name
    assert len({modes[m]["digest"] for m in ("span-reduce", "batch-reduce", "prefix-gather", "symm")}) == 1
    assert modes["prefetch"]["batches"] == out["solo_batches"] > 0
    assert all(h > 0 for h in out["prefetch_hits"])  # the second layer consumed a prefetch


def test_check_batches_cover_the_corner_cases():
    cfg = CheckConfig(cp=3, page_size=4, batches=6, seed=1)
    layouts = [draw_batch(cfg, b)[0] for b in range(cfg.batches)]
    sizes = [len(lay.requests) for lay in layouts]
    assert 1 in sizes and max(sizes) > 1
    reqs = [r for lay in layouts for r in lay.requests]
    assert any(r.prefix_len == 0 for r in reqs) and any(r.prefix_len > 0 for r in reqs)
    assert any(r.seq_len % cfg.page_size for r in reqs)  # partial last pages
    assert any(r.prefix_len % cfg.page_size for r in reqs)  # a solo unaligned prefix
    owners = {p.rank for lay in layouts for p in lay.logical_pages if p.kind == "prefix"}
    assert owners == {0, 1, 2}


def test_without_peer_memory_every_mode_falls_back_to_batch_reduce(monkeypatch):
    monkeypatch.setenv("CPKV_DISABLE_PEER_MEMORY", "1")
    out = run_check(CheckConfig(cp=2, page_size=8, batches=2, seed=5, layers=2, corrupt_mode="prefix-gather"))
    assert out["peer_memory"] == "none"
    assert {v["effective"] for v in out["modes"].values()} == {"span-reduce", "batch-reduce"}
    # the injected one-byte fault is caught (by the comparison and by the ranks' digests), nothing else is
    assert not out["ok"] and out["modes"]["prefix-gather"]["mismatches"] >= 1 and not out["modes"]["prefix-gather"]["ranks_agree"]
    assert all(v["mismatches"] == 0 for m, v in out["modes"].items() if m != "prefix-gather")


def _misuse(ctx):
    """Bad input on every rank; returns {case: exception class name + message}."""
    out = {}
    model = preset("tiny")
    caps = AdmissionCaps(chunk_size=32, cached_tokens=64, max_requests=2)
    rt = ComposeRuntime.create(ctx, model, num_pages=32, page_size=4, caps=caps, num_layers=2)
    assert rt.staging.capacity == 32 // 4 + 2
    layout = build_layout([(8, 12), (4, 5)], page_size=4, cp=2)
    plan = rt.plan_batch(layout)
    cases = {
        "unknown_mode": lambda: rt.compose(plan, 0, "token", mode="ring"),
        "not_a_plan": lambda: rt.compose(layout, 0, "token"),
        "cp_mismatch": lambda: rt.plan_batch(build_layout([(0, 9)], page_size=4, cp=3)),
        "overflow": lambda: rt.plan_batch(build_layout([(0, 30), (0, 20)], page_size=4, cp=2)),
        "prefetch_bs2": lambda: rt.compose(plan, 0, "token", mode="prefetch"),
        "bad_layer": lambda: rt.compose(plan, 5, "token"),
        "bad_layer_all_kinds": lambda: rt.compose_layer(plan, -1),
        "layer_not_a_plan": lambda: rt.compose_layer(layout, 0),
        "layer_unknown_mode": lambda: rt.compose_layer(plan, 0, mode="nope"),
        "bad_page_ids": lambda: rt.plan_batch(layout, [1] * 3),
    }
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    mem = PeerMemory.create(ctx)
    pool = KVPool(model, 8, 4, alloc=mem.alloc, num_layers=2)
    pool.buffers["index"] = pool.buffers["index"][..., :-4]
    try:
        ComposeRuntime(ctx, pool, mem, caps)
        out["pool_row_size"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["pool_row_size"] = f"{type(exc).__name__}: {exc}"
    return out


def test_bad_input_raises_named_errors_on_every_rank():
    for out in launch(_misuse, 2, timeout_s=120):
        assert out["unknown_mode"].startswith("ComposeError") and "span-reduce, batch-reduce, prefix-gather, symm, prefetch" in out["unknown_mode"]
        assert out["not_a_plan"].startswith("ComposeError: expected the batch's ComposePlan")
        assert out["cp_mismatch"].startswith("ComposeError") and "cp=3" in out["cp_mismatch"]
        assert out["overflow"].startswith(StagingOverflow.__name__) and "staging holds 10" in out["overflow"]
        assert out["prefetch_bs2"].startswith("ComposeError") and "one request" in out["prefetch_bs2"]
        assert out["bad_layer"].startswith("ComposeError")
        assert out["bad_layer_all_kinds"].startswith("ComposeError") and "layer must be in [0," in out["bad_layer_all_kinds"]
        assert out["layer_not_a_plan"].startswith("ComposeError: expected the batch's ComposePlan")
        assert out["layer_unknown_mode"].startswith("ComposeError") and "supported" in out["layer_unknown_mode"]
        assert out["bad_page_ids"].startswith("ComposeError") and "current_page_ids" in out["bad_page_ids"]
        assert out["pool_row_size"].startswith(ComposeError.__name__) and "row_bytes" in out["pool_row_size"]


def test_cuda_ipc_handles_open_in_the_readers_device_context():
    """One GPU per rank: a peer's IPC handle must be opened on the reading rank's GPU (torch's rebuild would
    open it on the owner's, where the reader's kernels fault). Checked on the handle arguments, no GPU needed."""
    from types import SimpleNamespace

    seen = []

    def rebuild_cuda_tensor(*args):  # stands in for torch's, which takes the storage device as argument 6
        seen.append(args)
        return "mapped"

    ctx = SimpleNamespace(rank=1, world_size=2, device=torch.device("cuda", 1))
    mem = PeerMemory(ctx, "cuda-ipc", "tok")
    mem._own["pool.token"] = (torch.zeros(1), False)
    args = tuple(range(15))
    assert mem._map(0, "pool.token", ("ipc", (rebuild_cuda_tensor, args))) == "mapped"
    assert seen[-1][6] == 1 and seen[-1][:6] == args[:6] and seen[-1][7:] == args[7:]

    def other(*a):  # any other rebuild function is called as given
        seen.append(a)
        return "other"
    assert mem._map(0, "pool.token", ("ipc", (other, args))) == "other"
    assert seen[-1] == args
