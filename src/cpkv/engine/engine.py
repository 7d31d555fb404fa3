"""Run the CP engine over a trace (rank processes or torchrun) and verify it against one rank.

    result = run_engine(cfg, trace)                  # RunResult; launches cfg.cp rank processes
    report = verify_run(result, trace)               # VerifyReport: single-process reference prefill, no CP, no cache
    results = run_jobs([(cfg, trace), (cfg, trace)]) # several runs in one set of rank processes

A run's outcome per request: prompt and cached lengths, TTFT (time from its release into the queue to
the end of the batch that computed its last token; a conversation's next turn is released when the
previous one finishes), the first token (argmax of the last-token logits) and the logits themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from cpkv.engine.config import EngineConfig
from cpkv.engine.rank import RankOutput, rank_main
from cpkv.scheduler.trace import TraceRequest, materialize_tokens

# |logit difference| allowed against the single-rank reference: atol + rtol * max |reference logit|.
# float32 on CPU leaves only fp8 rounding flips of near-tie values; bf16 on CUDA, more.
TOLERANCE = {"cpu": (1e-2, 1e-2), "cuda": (5e-2, 5e-2)}


@dataclass
class RequestResult:
    id: Hashable
    prompt_len: int
    cached_len: int
    ttft_s: float
    first_token: int
    logits: torch.Tensor = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "prompt_len": self.prompt_len, "cached_len": self.cached_len,
                "ttft_s": round(self.ttft_s, 6), "first_token": self.first_token}


@dataclass
class RunResult:
    """Merged outcome of one run over every rank."""

    cfg: EngineConfig
    requests: list[RequestResult]
    rejected: list[dict[str, Any]]
    wall_s: float
    pages_used: list[int]
    stats: dict[str, Any]

    @property
    def summary(self) -> dict[str, Any]:
        prompt = sum(r.prompt_len for r in self.requests)
        cached = sum(r.cached_len for r in self.requests)
        return {
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round((prompt - cached) / self.wall_s, 1) if self.wall_s else 0.0,
            "prompt_tokens": prompt,
            "cache_hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
            "kv_pages_per_rank": self.pages_used,
            "kv_pages_replicated": sum(self.pages_used),
            "pages_spilled": self.stats.get("spilled", 0),
            "pages_reloaded": self.stats.get("reloaded", 0),
            "batches": self.stats.get("batches", 0),
            "rejected": len(self.rejected),
            "mode": self.stats.get("mode"),
            "attention_calls": self.stats.get("attention"),
        }


def merge(cfg: EngineConfig, trace: Sequence[TraceRequest], outs: Sequence[RankOutput]) -> RunResult:
    """Per-rank outputs of one run -> RunResult in trace order (TTFT and wall time from rank 0's clock)."""
    logits: dict[Hashable, torch.Tensor] = {}
    for o in outs:
        logits.update({k: torch.from_numpy(v) for k, v in o.logits.items()})
    zero = outs[0]
    reqs = []
    for r in trace:
        if r.id in zero.done_s and r.id in logits:
            lg = logits[r.id]
            reqs.append(RequestResult(r.id, r.prompt_len, zero.cached[r.id], zero.done_s[r.id], int(lg.argmax()), lg))
    rejected = [{"id": r.id, "prompt_len": r.prompt_len, "reason": zero.rejected[r.id]}
                for r in trace if r.id in zero.rejected]
    stats = dict(zero.stats)
    stats["attention"] = {k: sum(o.stats["attention"][k] for o in outs) for k in ("dense", "sparse")}
    return RunResult(cfg, reqs, rejected, zero.wall_s, zero.pages_used, stats)


def run_jobs(jobs: Sequence[tuple[EngineConfig, Sequence[TraceRequest]]], *, timeout_s: float = 600.0,
             grace_s: float = 2.0, on_progress=None) -> list[RunResult]:
    """Run several jobs (same cp and device) in one set of rank processes, one after the other.
    ``on_progress(requests_done, batches)`` follows rank 0 through the current job."""
    from cpkv.dist import launch

    cp, device = jobs[0][0].cp, jobs[0][0].device
    if any(c.cp != cp or c.device != device for c, _ in jobs):
        raise ValueError("run_jobs: every job must use the same cp and device")
    report = (lambda rank, msg: on_progress(*msg)) if on_progress else None
    per_rank = launch(rank_main, cp, device=device, args=(list(jobs),), timeout_s=timeout_s, grace_s=grace_s,
                      on_progress=report)
    return [merge(cfg, trace, [per_rank[r][i] for r in range(cp)]) for i, (cfg, trace) in enumerate(jobs)]


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


# -- verification ----------------------------------------------------------------------------------
@dataclass
class VerifyReport:
    ok: bool
    tokens_equal: bool
    max_logit_diff: float
    tolerance: float
    worst: Hashable | None
    checked: int

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "tokens_equal": self.tokens_equal, "max_logit_diff": self.max_logit_diff,
                "tolerance": self.tolerance, "worst_request": self.worst, "checked": self.checked}


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


def verify_run(result: RunResult, trace: Sequence[TraceRequest], model=None, on_request=None) -> VerifyReport:
    """Rerun every completed request on one process (no CP, no cache) and compare.

    ok = first tokens equal and every |logit difference| <= atol + rtol * max |reference logit|.
    ``on_request(n)`` is called after the n-th request is compared (progress).
    """
    from cpkv.model.model import load_model

    cfg = result.cfg
    device = "cuda" if cfg.device == "cuda" else "cpu"
    model = model or load_model(cfg.model, seed=cfg.seed, device=device, num_layers=cfg.num_layers,
                                precision=cfg.precision)
    tokens = materialize_tokens(trace, vocab_size=model.cfg.vocab_size)
    atol, rtol = TOLERANCE[device]
    equal, worst, worst_id, ok, tol_used = True, 0.0, None, True, atol
    for n, r in enumerate(result.requests, start=1):
        ref = model.reference_prefill(tokens[r.id]).cpu()
        diff = float((ref - r.logits).abs().max())
        tol = atol + rtol * float(ref.abs().max())
        equal &= int(ref.argmax()) == r.first_token
        ok &= diff <= tol
        if diff >= worst:
            worst, worst_id, tol_used = diff, r.id, tol
        if on_request is not None:
            on_request(n)
    return VerifyReport(ok and equal, equal, worst, tol_used, worst_id, len(result.requests))
