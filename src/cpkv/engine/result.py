"""A run's merged outcome: per request its prompt and cached lengths, TTFT (time from its release into the queue to
the end of the batch that computed its last token; a conversation's next turn is released when the previous one
finishes), the first token (argmax of the last-token logits) and the logits themselves; ``merge`` builds it from
the ranks' outputs. No launching here: the parent (``cpkv.engine.engine``) and a cp-1 rank that verifies its own
run (``cpkv.engine.verify``) both merge.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from cpkv.engine.config import EngineConfig
from cpkv.engine.trace_loop import RankOutput
from cpkv.scheduler.trace import TraceRequest


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

    @property
    def finite(self) -> bool:
        return bool(torch.isfinite(self.logits).all())


@dataclass
class RunResult:
    """Merged outcome of one run over every rank."""

    cfg: EngineConfig
    requests: list[RequestResult]
    rejected: list[dict[str, Any]]
    wall_s: float
    pages_used: list[int]
    stats: dict[str, Any]
    decisions: list = field(default_factory=list)  # cfg.record: every rank's BatchDecisions (cpkv.engine.taps)
    verify: Any = None  # cfg.reference "rank": rank 0's VerifyReport of this run (None: verify in the parent)

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
            "weights_dtype": self.stats.get("weights_dtype"),
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
    stats["experts_per_rank"] = [o.stats.get("experts", 0) for o in outs]  # routed experts each rank holds
    stats["gpu_memory_per_rank"] = [o.stats.get("gpu_memory") for o in outs]  # CUDA: setup and peak bytes
    stats["load_s_per_rank"] = [o.stats.get("load_s") for o in outs]  # the model's load (0.0: loaded for a job before)
    stats["graphs_per_rank"] = [o.stats.get("graphs") for o in outs]  # graph_tokens: each rank's graph counts
    decisions = [d for o in outs for d in o.decisions]
    return RunResult(cfg, reqs, rejected, zero.wall_s, zero.pages_used, stats, decisions, zero.verify)
