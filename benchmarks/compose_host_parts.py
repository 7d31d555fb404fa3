"""Host µs of each piece of a symm ``compose_layer`` (2026-12-01, issue 14; updated 2026-12-02): the GPU barrier
round, the gathers (a prepared launch per kind), the persists, and the whole call, every rank at once, back to back,
the plan cached.

    PYTHONPATH=src python3 benchmarks/compose_host_parts.py [cp] [device]   (device: cuda, the default, or cpu)
"""
from __future__ import annotations

import sys
import time

import torch

from cpkv.compose.runtime import ComposeRuntime
from cpkv.config import KINDS, AdmissionCaps, preset
from cpkv.dist import launch
from cpkv.layout import build_layout

N = 200


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _us(ctx, rt, fn) -> float:
    fn(0)
    _sync()
    ctx.barrier()
    t0 = time.perf_counter()
    for i in range(N):
        fn(i)
    us = (time.perf_counter() - t0) / N * 1e6
    _sync()
    ctx.barrier()
    return us


def worker(ctx) -> dict:
    caps = AdmissionCaps(chunk_size=8192, cached_tokens=65536, max_requests=4)
    rt = ComposeRuntime.create(ctx, preset("glm5"), num_pages=1200, page_size=64, caps=caps, num_layers=4)
    layout = build_layout([(16384, 4096), (8192, 2048)], page_size=64, cp=ctx.world_size)
    ids = list(range(1, layout.num_current + 1))
    plan = rt.plan_batch(layout, ids)
    halves = {k: 0 for k in KINDS}
    out = {"barrier": type(rt.barrier).__name__}
    out["barrier_us"] = _us(ctx, rt, lambda i: rt.barrier_round())
    out["gather_us"] = _us(ctx, rt, lambda i: rt.gather_kinds("global", 0, halves,
                                                                {k: (rt.dense(plan, k, 0)[1], plan.all) for k in KINDS}))
    out["persist_us"] = _us(ctx, rt, lambda i: rt.persist_kinds(plan, 0, halves))  # what symm runs
    out["compose_layer_us"] = _us(ctx, rt, lambda i: rt.compose_layer(plan, i % 4, mode="symm"))
    out["direct"] = getattr(rt.barrier, "direct", None)
    rt.check_barrier()
    rt.close()
    return out


if __name__ == "__main__":
    cp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    for r, o in enumerate(launch(worker, cp, device=device, timeout_s=300)):
        print(f"rank {r}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in o.items()))
