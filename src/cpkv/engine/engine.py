"""Run the CP engine over a trace (rank processes or torchrun) and verify it against one rank.

    result = run_engine(cfg, trace)                  # RunResult; launches cfg.cp rank processes
    report = verify_run(result, trace)               # VerifyReport: single-process reference prefill, no CP, no cache
    results = run_jobs([(cfg, trace), (cfg, trace, measure)])  # several runs in one set of rank processes
                                                     # (measure: a MeasureConfig, what a benchmark or test asks)

The outcome (``RunResult``, ``merge``) lives in ``cpkv.engine.result``, verification (``verify_run``,
``nonfinite_failure``, ...) in ``cpkv.engine.verify``; both are re-exported here.
"""
from __future__ import annotations

from typing import Sequence

from cpkv.engine.config import EngineConfig
from cpkv.errors import ConfigError
from cpkv.engine.rank import Job, job_parts, rank_main
from cpkv.engine.result import RequestResult, RunResult, merge  # noqa: F401  (re-exported)
from cpkv.engine.verify import (TOLERANCE, FirstNonFinite, VerifyReport, _check_request, _reference_model,  # noqa: F401
                                check_finite, describe_nonfinite, first_nonfinite, nonfinite_failure, numerics_floor,
                                verify_run)
from cpkv.scheduler.trace import TraceRequest


def run_jobs(jobs: Sequence[Job], *, timeout_s: float = 600.0, grace_s: float = 2.0,
             on_progress=None) -> list[RunResult]:
    """Run several jobs (same cp and device) in one set of rank processes, one after the other. A job is
    (EngineConfig, trace) or (EngineConfig, trace, MeasureConfig | None) (``cpkv.engine.rank.Job``).
    ``on_progress(requests_done, batches)`` follows rank 0 through the current job."""
    from cpkv.dist import launch

    jobs = [job_parts(j) for j in jobs]
    if any(m is not None and m.plant and c.graph_tokens for c, _, m in jobs):
        raise ConfigError("a planted fault runs eagerly: graph_tokens must be 0")
    cp, device = jobs[0][0].cp, jobs[0][0].device
    if any(c.cp != cp or c.device != device for c, _, _ in jobs):
        raise ValueError("run_jobs: every job must use the same cp and device")
    report = (lambda rank, msg: on_progress(*msg)) if on_progress else None
    per_rank = launch(rank_main, cp, device=device, args=(list(jobs),), timeout_s=timeout_s, grace_s=grace_s,
                      on_progress=report)
    return [merge(cfg, trace, [per_rank[r][i] for r in range(cp)]) for i, (cfg, trace, _) in enumerate(jobs)]


def run_engine(cfg: EngineConfig, trace: Sequence[TraceRequest], *, timeout_s: float = 600.0,
               on_progress=None) -> RunResult:
    return run_jobs([(cfg, trace)], timeout_s=timeout_s, on_progress=on_progress)[0]


def run_under_torchrun(cfg: EngineConfig, trace: Sequence[TraceRequest]) -> RunResult | None:
    """This process is one rank of a torchrun group (cp = WORLD_SIZE): rank 0 gets the merged result."""
    from cpkv.dist import context_from_env

    ctx = context_from_env(cfg.device)
    outs = rank_main(ctx, [(cfg, trace)])
    every = ctx.all_gather_object(outs[0])
    ctx.barrier()
    return merge(cfg, trace, every) if ctx.rank == 0 else None


def write_logits(path: str, result: RunResult) -> None:
    """Each finished request's last-token logits, float32 [vocab], into a safetensors file keyed by request id
    (``str(id)``: ids that become one key, ``1`` and ``"1"``, are a ConfigError naming both; written under the
    output policy of ``cpkv.files``: beside ``path``, renamed onto it, no partial output)."""
    from safetensors.torch import save_file

    from cpkv.files import atomic_path, string_keys

    keys = string_keys([r.id for r in result.requests], f"logits file {path!r}")
    tensors = {k: r.logits.float().contiguous() for k, r in zip(keys, result.requests)}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={"model": str(result.cfg.model), "precision": result.cfg.precision})
