"""A rank process's entry point for trace runs: its model (loaded once per model key, its expert block under expert
parallelism), then each job's ``TraceLoop`` in order (docs/design.md §8).

A job is ``(EngineConfig, trace)`` or ``(EngineConfig, trace, MeasureConfig | None)``: what a benchmark or a test
measures travels beside the engine's config, never in it.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Sequence, Union

import torch

from cpkv import envs
from cpkv.dist import RankContext
from cpkv.engine.config import EngineConfig
from cpkv.engine.instruments import MeasureConfig
from cpkv.engine.trace_loop import RankOutput, TraceLoop
from cpkv.model.model import DSAModel, load_model
from cpkv.scheduler.trace import TraceRequest

Job = Union[tuple[EngineConfig, Sequence[TraceRequest]],
            tuple[EngineConfig, Sequence[TraceRequest], "MeasureConfig | None"]]

__all__ = ["Job", "RankOutput", "batch_threads", "job_parts", "rank_main", "rank_model", "share_cores"]


def job_parts(job: Job) -> tuple[EngineConfig, Sequence[TraceRequest], MeasureConfig | None]:
    """(config, trace, measure or None) of a job given with or without its measure."""
    cfg, trace, *rest = job
    return cfg, trace, (rest[0] if rest else None)


def rank_main(ctx: RankContext, jobs: Sequence[Job]) -> list[RankOutput]:
    """Rank entry point (cpkv.dist.launch or torchrun): run each job in order."""
    share_cores(ctx)
    if ctx.device.type == "cuda":
        from cpkv.engine import memsites

        memsites.start_if_asked(ctx.rank)
    jobs = [job_parts(j) for j in jobs]
    models: dict[tuple, DSAModel] = {}
    outputs = []
    for cfg, trace, measure in jobs:
        key = (cfg.model, cfg.seed, cfg.num_layers, cfg.experts, cfg.precision, cfg.weights_dtype)
        load_s = 0.0
        if key not in models:
            models.clear()  # one model in memory at a time (a bench runs fp8 then bf16 weights of one model)
            model = None
            t0 = time.perf_counter()
            models[key] = rank_model(ctx, cfg)
            load_s = time.perf_counter() - t0
            plants = [m.plant for _, _, m in jobs if m is not None and m.plant]
            if plants or any(c.record for c, _, _ in jobs):  # before any graph is captured
                from cpkv.engine.taps import Recorder
                plant = plants[0] if plants else None
                models[key].set_tap(Recorder(models[key], max(c.chunk_size for c, _, _ in jobs), cfg.page_size,
                                             ctx.rank, plant))
        model = models[key]
        for layer in model.layers:
            layer.stats.update(dense=0, sparse=0)
        if cfg.warmup:  # untimed: JIT/autotune every kernel shape of this trace (and fill first-use caches)
            untimed = replace(measure, sync_check=False, profile=False) if measure is not None else None
            _run_once(ctx, cfg, model, trace, untimed)
            for layer in model.layers:
                layer.stats.update(dense=0, sparse=0)
        out = _run_once(ctx, cfg, model, trace, measure)
        out.stats["load_s"] = round(load_s, 3)
        if cfg.reference == "rank" and ctx.rank == 0:
            _verify_here(cfg, trace, out, model)
        outputs.append(out)
    return outputs


def _verify_here(cfg: EngineConfig, trace: Sequence[TraceRequest], out: RankOutput, model: DSAModel) -> None:
    """cp 1: verify this run on the rank's own model (one copy of the weights; the run's pools and graphs are gone
    with its loop) -> ``out.verify``, and its seconds in ``out.stats["verify_s"]``."""
    from cpkv.engine.verify import verify_on_rank

    if model.device.type == "cuda":
        import gc

        gc.collect()
        torch.cuda.empty_cache()  # the run's pool and graph memory, freed with its loop, back for the reference
    t0 = last = time.perf_counter()
    every = envs.get("CPKV_PROGRESS_S")

    def progress(n: int, total: int) -> None:  # the parent cannot see this work: rank 0 says how far it is
        nonlocal last
        now = time.perf_counter()
        if now - last >= every or n == total:
            last = now
            print(f"cpkv run: verifying on rank 0: {n} of {total} requests ({now - t0:.0f} s)", file=sys.stderr,
                  flush=True)

    out.verify = verify_on_rank(cfg, trace, out, model, on_request=progress)
    out.stats["verify_s"] = round(time.perf_counter() - t0, 3)


def share_cores(ctx: RankContext) -> None:
    """The ranks share the host's cores: no oversubscription (a CUDA rank's batches then run on one thread:
    ``batch_threads``)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))


def batch_threads(device: torch.device) -> None:
    """A CUDA rank's host work between model loads is its batch plans and launches: small CPU ops, on one
    thread (torch's intra-op pool would split a 100 KB copy over every thread, and the op waits for the
    slowest: a thread to wake, or one on a core that host load keeps busy)."""
    if device.type == "cuda":
        torch.set_num_threads(1)


def rank_model(ctx: RankContext, cfg: EngineConfig) -> DSAModel:
    """This rank's model: at cp > 1 only its block of the routed experts (expert parallelism), linear weights
    as ``cfg.weights_dtype`` says."""
    ep = (ctx.rank, ctx.world_size) if ctx.world_size > 1 else None
    share_cores(ctx)  # the load's CPU work (checkpoint reads, dequantisation) on the rank's share of the cores
    model = load_model(cfg.model, seed=cfg.seed, device=ctx.device, num_layers=cfg.num_layers,
                       precision=cfg.precision, weights=cfg.weights_dtype, ep=ep, routed_experts=cfg.experts)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # the load's transients (dense weights quantised at load) go back to the GPU
    batch_threads(ctx.device)
    return model


def _run_once(ctx: RankContext, cfg: EngineConfig, model: DSAModel, trace: Sequence[TraceRequest],
              measure: MeasureConfig | None) -> RankOutput:
    loop = TraceLoop(ctx, cfg, model, measure)
    try:
        return loop.run(trace)
    finally:
        loop.close()
