"""The trace loop behind ``cpkv run`` and ``cpkv bench engine``: a trace's requests through a ``BatchExecutor`` until
none is left, each request's time to its last token measured.

    release    a request enters the queue once its parent finished (so the next turn of a conversation can hit
               it); requests without a parent are queued at the start
    step       reload host-tier pages -> the scheduler's next batch -> the executor runs it -> the batch before's
               results are taken (when it was chained: it ended first), then this one's when it was not chained
    look ahead only while no request waits on a parent (one finishing now must be able to join the next batch)
               and without a host tier (its spills and reloads synchronise between batches)

A request's time (``RankOutput.done_s``) runs from its release to the end of the batch that computed its last
token: the host clock after a synchronisation, or, chained, the CUDA event at that batch's end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from cpkv.dist import RankContext
from cpkv.engine.config import EngineConfig
from cpkv.engine.executor import Ahead, BatchExecutor, BatchResult
from cpkv.engine.instruments import Instruments, MeasureConfig
from cpkv.model.model import DSAModel
from cpkv.scheduler import Request
from cpkv.scheduler.trace import TraceRequest, materialize_tokens


@dataclass
class RankOutput:
    """What one rank returns for one run (plain picklable data: torch tensors would travel through shared
    memory that dies with the rank). ``logits``: float32 numpy [vocab], only for requests whose last
    token this rank held."""

    rank: int
    logits: dict[Hashable, Any] = field(default_factory=dict)
    done_s: dict[Hashable, float] = field(default_factory=dict)   # end of its last batch - release time
    cached: dict[Hashable, int] = field(default_factory=dict)
    rejected: dict[Hashable, str] = field(default_factory=dict)
    wall_s: float = 0.0
    pages_used: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    decisions: list = field(default_factory=list)  # with cfg.record: per batch, cpkv.engine.taps.BatchDecisions
    verify: Any = None  # cfg.reference "rank": the VerifyReport rank 0 made on its own model (cpkv.engine.verify)


class TraceLoop:
    """One rank's run of one trace: the executor, its instruments (always kept: the run reports every batch's time)
    and the trace's release bookkeeping."""

    def __init__(self, ctx: RankContext, cfg: EngineConfig, model: DSAModel,
                 measure: MeasureConfig | None = None) -> None:
        self.ctx, self.cfg, self.model, self.rank = ctx, cfg, model, ctx.rank
        self.inst = Instruments(measure or MeasureConfig(), ctx.rank, model.device)
        self.ex = BatchExecutor(ctx, cfg, model, self.inst)
        self.gpu_setup = gpu_mark(model.device)  # weights + pool + staging + buffers, before any batch
        self.out = RankOutput(self.rank)
        self.blocked: list[TraceRequest] = []  # requests whose parent has not finished
        self.released: dict[Hashable, float] = {}  # request id -> its release, seconds from the run's start
        self.done: set[Hashable] = set()  # requests finished or rejected
        self.pending: list[BatchResult] = []  # a chained batch's results: taken once the next batch is launched
        self.t0 = 0.0

    def run(self, trace: Sequence[TraceRequest]) -> RankOutput:
        """Requests released as their parents finish, batches until nothing is left -> this rank's output."""
        tokens = materialize_tokens(trace, vocab_size=self.model.cfg.vocab_size)
        self.blocked = list(trace)
        self.ctx.barrier()
        self.t0 = time.perf_counter()
        with self.inst.run_scope():
            ahead: Ahead | None = None
            while True:
                self._release(tokens)
                batch = ahead.batch if ahead is not None else self._schedule()
                if batch is None:
                    if not self.ex.sched.has_work and not self._ready():
                        break
                    continue
                res = self.ex.run(batch, ahead, then=self.ex.sched.next_batch if self._may_look_ahead() else None)
                ahead = res.ahead
                self._take(res)
            self.ex.drain()
            self._take_results()
        for r in self.blocked:
            self.out.rejected[r.id] = "parent: its parent never finished"
        self.out.decisions = [d.numpy() for d in self.ex.decisions]  # every batch ended
        self.out.wall_s = time.perf_counter() - self.t0
        self._collect_stats()
        return self.out

    def _schedule(self):
        """Reload, then the scheduler's next batch (None: nothing admissible now); its rejections noted."""
        self.ex.reload_waiting()
        batch = self.ex.sched.next_batch()
        self._note_rejections()
        return batch

    def _take(self, res: BatchResult) -> None:
        """After a batch's launch: the batch before's results (when chained: it ended first), then this one's
        unless it is chained itself; rank 0 reports progress."""
        self._note_rejections()
        self._take_results()
        self.pending.append(res)
        if res.chained is None:  # synchronised: this batch's results now
            self._take_results()
        if self.rank == 0:
            self.ctx.report((len(self.done), self.ex.batches))  # the launching parent's progress line

    def _take_results(self) -> None:
        """The pending batches' logits and their finished requests' times (emptying ``pending``)."""
        for res in self.pending:
            end = self.ex.end_time(res)
            if end is None:  # a middle chunk: nothing to wait for
                continue
            self.out.logits.update({rid: v.cpu().numpy() for rid, v in res.logits.items()})
            for req in res.finished:
                self.out.done_s[req.rid] = end - self.t0 - self.released[req.rid]
                self.out.cached[req.rid] = req.cached
                self.done.add(req.rid)
        self.pending.clear()

    def _may_look_ahead(self) -> bool:
        """Form the next batch before this one ends: with cfg.look_ahead, no host tier and no request waiting on a
        parent (module docstring)."""
        return self.cfg.look_ahead and self.ex.host is None and not self.blocked

    def _ready(self) -> bool:
        return any(r.parent is None or r.parent in self.done for r in self.blocked)

    def _release(self, tokens: dict) -> None:
        """Queue the blocked requests whose parent is done (or that have none)."""
        now, still = time.perf_counter() - self.t0, []
        for r in self.blocked:
            if r.parent is not None and r.parent not in self.done:
                still.append(r)
                continue
            self.released[r.id] = now
            why = self.ex.sched.add(Request(r.id, tokens[r.id], r.prompt_len, r.arrival))
            if why is not None:
                self.out.rejected[r.id] = f"{why.reason}: {why.detail}"
                self.done.add(r.id)
        self.blocked = still

    def _note_rejections(self) -> None:
        for req in self.ex.sched.rejected:
            if req.rid not in self.out.rejected:
                self.out.rejected[req.rid] = req.reason
                self.done.add(req.rid)

    def _collect_stats(self) -> None:
        ex, model = self.ex, self.model
        self.out.pages_used = ex.kv.pages_used()
        self.out.stats = {
            "batches": ex.batches, "spilled": ex.kv.stats["spilled"], "reloaded": ex.kv.stats["reloaded"],
            "evicted": ex.kv.stats["evicted"], "mode": ex.rt.effective_mode(), "peer_memory": ex.rt.mem.kind,
            "barrier": type(ex.rt.barrier).__name__ if ex.rt.barrier is not None else None,
            "prefetch_hits": ex.rt.prefetch_hits, "attention": model.layer_stats(),
            "weights_dtype": model.weights_dtype, "experts": experts_held(model),
            "gpu_memory": gpu_memory(model.device, self.gpu_setup), "planned_ahead": ex.planned_ahead,
            "chained": ex.chained, "graphs": graph_stats(ex.graphs, ex.graph_counts), **self.inst.stats(),
        }

    def close(self) -> None:
        self.ex.close()


def graph_stats(graphs, then: dict | None) -> dict | None:
    """With graphs: this run's batches through the graphs' buffers, pieces its batches captured and ran eagerly
    (first uses: none once warmed), the captures held, the buffers' bytes, the seconds ``LayerGraphs.warm`` took
    (capturing every bucket before any batch) and the device bytes the graphs hold (buffers and the captures'
    pool; CUDA)."""
    if graphs is None:
        return None
    now = graphs.counts()
    return {"max_tokens": graphs.max_tokens, "batches": now["batches"] - then["batches"],
            "captured": now["captured"] - then["captured"], "eager_pieces": now["eager_pieces"] -
            then["eager_pieces"], "graphs_held": now["captured"], "buffer_bytes": now["buffer_bytes"],
            "warm_s": now["warm_s"], "device_bytes": now["device_bytes"]}


def experts_held(model: DSAModel) -> int:
    """Routed experts this rank holds (0 for a model without MoE layers)."""
    return len(model.experts) if "sparse" in model.cfg.mlp_layer_types else 0


def gpu_mark(device: torch.device) -> int | None:
    """CUDA: the bytes allocated now, and the peak counter restarted from here (None elsewhere). With
    CPKV_MEMORY_SITES set, the live memory by allocation site is written first (``cpkv.engine.memsites``)."""
    if device.type != "cuda":
        return None
    from cpkv.engine import memsites

    memsites.write_if_asked(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def gpu_memory(device: torch.device, setup_bytes: int | None) -> dict | None:
    """CUDA: what this rank holds before its first batch (``setup_bytes``) and at the peak of its batches
    (allocated and reserved by torch's caching allocator): the memory plan's items, measured."""
    if setup_bytes is None:
        return None
    return {"setup_bytes": setup_bytes, "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
