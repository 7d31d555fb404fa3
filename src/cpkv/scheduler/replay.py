"""Event-driven replay of a trace through the real prefix cache and the real admission code. No torch.

Requests join the scheduler's queue at their arrival time; one batch runs at a time and lasts what the
cost model says; a request's time to first token (TTFT) ends with the batch holding its last chunk.
KV capacity: ``shared`` gives each of the cp ranks its own pool (every page stored once in the group);
``replicated`` stores every page on every rank, modelled as one pool of one rank's size (the group
caches 1/cp as many distinct tokens). The prefix cache is fed one key per page (``PageKeys``): the same
tree, LRU and eviction code as the engine's, at page granularity.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cpkv.config import DEFAULT_PAGE_SIZE, MODEL_SIZES, AdmissionCaps, CPConfig, ModelConfig, check_batch_sizes, preset
from cpkv.errors import ConfigError
from cpkv.kvcache.allocator import PageAllocator
from cpkv.kvcache.manager import KVCacheManager
from cpkv.scheduler.batch import Batch
from cpkv.scheduler.costs import CostModel
from cpkv.scheduler.request import Request
from cpkv.scheduler.scheduler import Scheduler
from cpkv.scheduler.trace import PageKeys, TraceRequest

KV_MODES = ("shared", "replicated")


@dataclass(frozen=True)
class ReplayConfig:
    policy: str = "solo"
    kv: str = "shared"
    cp: int = MODEL_SIZES.cp
    page_size: int = DEFAULT_PAGE_SIZE
    chunk_size: int = MODEL_SIZES.chunk_size
    max_requests: int = MODEL_SIZES.max_requests
    kv_tokens_per_rank: int | None = None  # default: the cost model's memory budget
    model: str = "glm5"

    def __post_init__(self) -> None:
        from cpkv.scheduler.admission import POLICIES

        if self.policy not in POLICIES:
            raise ConfigError(f"unknown admission policy {self.policy!r}; expected one of {', '.join(POLICIES)}")
        if self.kv not in KV_MODES:
            raise ConfigError(f"unknown kv mode {self.kv!r}; expected one of {', '.join(KV_MODES)}")
        CPConfig(self.cp, self.page_size)  # validates cp and page_size
        check_batch_sizes(self.page_size, self.chunk_size, self.max_requests)
        if self.kv_tokens_per_rank is not None and self.kv_tokens_per_rank < self.page_size:
            raise ConfigError(f"kv_tokens_per_rank must hold at least one page ({self.page_size} tokens), "
                              f"got {self.kv_tokens_per_rank}")
        preset(self.model)  # validates the preset name

    def caps(self) -> AdmissionCaps:
        return AdmissionCaps(chunk_size=self.chunk_size, max_requests=self.max_requests)


@dataclass
class ReplayResult:
    policy: str
    kv: str
    requests: int
    ttft: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    prompt_tokens: int = 0
    batches: int = 0
    batch_entries: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    kv_tokens_per_rank: int = 0
    sim_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The ``--json`` entry of one (policy, kv) run."""
        t = sorted(self.ttft)
        return {
            "policy": self.policy, "kv": self.kv, "requests": self.requests,
            "ttft_s": ({"p50": percentile(t, 50), "p90": percentile(t, 90), "p99": percentile(t, 99), "max": t[-1]}
                       if t else {"p50": None, "p90": None, "p99": None, "max": None}),  # none completed
            "cache_hit_ratio": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "batches": self.batches,
            "mean_batch_requests": self.batch_entries / self.batches if self.batches else 0.0,
            "mean_queue_s": sum(self.queue) / len(self.queue) if self.queue else 0.0,
            "completed": len(self.ttft), "rejected": sum(self.rejected.values()),
            "rejected_by_reason": dict(sorted(self.rejected.items())),
            "kv_tokens_per_rank": self.kv_tokens_per_rank, "simulated_s": self.sim_seconds,
        }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of an ascending list; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


BatchLog = Callable[[Batch, float, float], None]


def build_scheduler(cfg: ReplayConfig, model: ModelConfig, costs: CostModel) -> tuple[Scheduler, int]:
    """A scheduler over fresh pools sized for ``cfg.kv``; returns it and the KV tokens per rank."""
    tokens = cfg.kv_tokens_per_rank if cfg.kv_tokens_per_rank is not None else costs.kv_tokens_per_rank(cfg.cp)
    pages = max(2, tokens // cfg.page_size + 1)  # + the reserved page 0
    ranks = 1 if cfg.kv == "replicated" else cfg.cp
    kv = KVCacheManager(1, [PageAllocator(pages, f"rank{r}") for r in range(ranks)])
    sched = Scheduler(kv, cfg.caps(), model=model, cp=CPConfig(cfg.cp, cfg.page_size), policy=cfg.policy,
                      key_unit=cfg.page_size, replicated=cfg.kv == "replicated")
    return sched, (pages - 1) * cfg.page_size


def replay(trace: Sequence[TraceRequest], cfg: ReplayConfig, costs: CostModel | None = None,
           log: BatchLog | None = None, progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Simulate ``trace`` (arrival order) under ``cfg``; deterministic: same inputs, same result."""
    costs = costs or CostModel()
    model = preset(cfg.model)
    sched, kv_tokens = build_scheduler(cfg, model, costs)
    res = ReplayResult(cfg.policy, cfg.kv, len(trace), kv_tokens_per_rank=kv_tokens)
    keys = PageKeys(trace, cfg.page_size)
    t, i, n = 0.0, 0, len(trace)
    while i < n or sched.has_work:
        while i < n and trace[i].arrival <= t:
            _arrive(sched, trace[i], keys, res, progress)
            i += 1
        batch = sched.next_batch()
        _count_rejected(sched, res, progress)
        if batch is None:
            if i < n:
                t = max(t, trace[i].arrival)
            continue
        t = _run_batch(sched, batch, t, costs, cfg.kv == "replicated", res, log, progress)
    res.sim_seconds = t
    return res


def _arrive(sched: Scheduler, tr: TraceRequest, keys: PageKeys, res: ReplayResult, progress) -> None:
    sched.add(Request(tr.id, keys(tr), tr.prompt_len, tr.arrival))
    _count_rejected(sched, res, progress)


def _count_rejected(sched: Scheduler, res: ReplayResult, progress) -> None:
    for r in sched.rejected:
        reason = r.reason.split(":", 1)[0]
        res.rejected[reason] = res.rejected.get(reason, 0) + 1
        if progress:
            progress(1)
    sched.rejected.clear()


def _run_batch(sched: Scheduler, batch: Batch, t: float, costs: CostModel, replicated: bool, res: ReplayResult,
               log: BatchLog | None, progress) -> float:
    t_end = t + costs.batch_seconds(batch, replicated)
    for e in batch.entries:
        e.request.meta.setdefault("start", t)
    done = sched.postprocess(batch)
    res.batches += 1
    res.batch_entries += len(batch.entries)
    for r in done:
        res.ttft.append(t_end - r.arrival)
        res.queue.append(r.meta["start"] - r.arrival)
        res.hit_tokens += r.cached
        res.prompt_tokens += r.prompt_len
    if log is not None:
        log(batch, t, t_end)
    if progress and done:
        progress(len(done))
    return t_end
