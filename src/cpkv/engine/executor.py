"""The batch executor: one rank's resident state and one batch at a time through it. Every rank runs it on the same
batches and takes the same decisions; a driver (``trace_loop``, ``online``) decides what runs next.

    setup      model, ComposeRuntime (pool + staging in peer memory), host tier, the KV-cache manager
               (one PageAllocator mirror per rank, the CP-wide prefix cache), the scheduler, the layers' graphs
    reload     before admission, host-tier pages on a waiting request's cached chain come back into
               their owner's pool (the owner copies the bytes; every rank updates its mirror)
    batch      layout -> compose plan (current pages persist into the entries' pages) -> forward -> the batch
               done in the bookkeeping (full pages enter the prefix cache, owned by their writers)
    look ahead once a batch's forward is launched and its driver says so, the batch is done in the bookkeeping
               right away, the next batch formed and its whole plan built (uploads in the other staging slot) while
               the GPU still runs this one: the next batch's kernels start as soon as this one's end (a long
               prompt's chunks run back to back; cfg.look_ahead)
    chain      a batch planned ahead is launched without waiting for the one before to end: no synchronisation
               between them, so the GPU never idles at a batch start. A chained batch's logits are copied to
               pinned host memory behind it; its results are taken once the next batch is launched, its end time
               from a CUDA event at its end (``end_time``).

Only the owner of a page touches its bytes (spill, reload); the bookkeeping is replicated. Nothing between a
batch's plan and its forward's last launch waits on the device.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np
import torch

from cpkv.dist import RankContext
from cpkv.engine.config import EngineConfig
from cpkv.engine.forward import BatchSpec, rank_plan, run_batch
from cpkv.engine.graphs import for_model
from cpkv.kvcache.allocator import PageAllocator
from cpkv.kvcache.manager import KVCacheManager
from cpkv.model.model import DSAModel
from cpkv.scheduler import Batch, Request, Scheduler
from cpkv.timeline import mark
from cpkv.upload import staging


@dataclass
class Ahead:
    """The next batch with its plan, built while the GPU ran the batch before (``BatchExecutor._plan_ahead``)."""

    batch: Batch
    plan: Any     # cpkv.engine.forward.RankPlan, completed (every logits chunk's work items)
    compose: Any  # cpkv.compose.plan.ComposePlan


@dataclass
class Chain:
    """Batches launched since the last synchronisation, each without waiting for the one before to end."""

    start: float       # the host clock right after the synchronisation before the chain's first batch
    start_ev: Any      # a CUDA event recorded then (None on the CPU)
    ends: list = field(default_factory=list)  # per deferred batch: its end (a CUDA event; host seconds on CPU)
    recs: list = field(default_factory=list)  # per deferred batch: its timeline Recorder or None

    def at(self, end: Any) -> float:
        """The host clock at a deferred batch's ``end`` (waits for a CUDA event: that batch alone)."""
        if isinstance(end, float):
            return end
        end.synchronize()
        return self.start + self.start_ev.elapsed_time(end) / 1e3


@dataclass
class BatchResult:
    """One batch's results. ``logits``: {request id: float32 [vocab]} for the requests whose last token is on this
    rank (on the device; in pinned host memory, valid once the batch ends, when chained); ``finished``: the requests
    whose last chunk this was; ``ahead``: the next batch planned ahead, or None; ``chained``: (its chain, its end)
    when the host did not wait for its end."""

    finished: list[Request]
    logits: dict[Hashable, torch.Tensor]
    ahead: Ahead | None
    chained: tuple[Chain, Any] | None = None


class BatchExecutor:
    """One rank's resident engine state and the batch step (module docstring). ``inst``: the instruments its batches
    report to (``cpkv.engine.instruments``: ``Instruments``, or ``NoInstruments`` when nothing is measured)."""

    def __init__(self, ctx: RankContext, cfg: EngineConfig, model: DSAModel, inst: Any) -> None:
        from cpkv.compose.runtime import ComposeRuntime
        from cpkv.kvcache.host import HostTier

        self.ctx, self.cfg, self.model, self.rank, self.inst = ctx, cfg, model, ctx.rank, inst
        caps = cfg.caps()
        self.rt = ComposeRuntime.create(ctx, model.cfg, num_pages=cfg.pages_per_rank, page_size=cfg.page_size,
                                        caps=caps, mode=cfg.mode)
        self.ep = self._expert_exchange()
        self.tap = model.tap if cfg.record or inst.plant else None  # installed by rank_main, before any capture
        if (cfg.record or inst.plant) and self.tap is None:
            raise ValueError("a run that records decisions needs its model's tap (rank_main installs it)")
        if model.tap is not None:  # this run's planted fault (or none) may fire once
            model.tap.reset(inst.plant, cfg.page_size)
        self.decisions: list = []  # per batch: its BatchDecisions (host copies, complete once the run ends)
        # small batches' layer pieces as CUDA graphs, captured once per model (later runs replay them); no rank's
        # batch holds more new tokens than the chunk: buckets past it would never run
        self.graphs = for_model(model, min(cfg.graph_tokens, cfg.chunk_size)) if cfg.graph_tokens else None
        if self.graphs is not None:
            self.graphs.warm()  # every bucket's pieces captured before the first batch
        self.graph_counts = self.graphs.counts() if self.graphs is not None else None  # before this run's batches
        self.host = HostTier(self.rt.pool, cfg.host_pages) if cfg.host_pages else None
        allocators = [PageAllocator(cfg.pages_per_rank, f"rank {r} pool") for r in range(cfg.cp)]
        self.kv = KVCacheManager(cfg.page_size, allocators, cfg.host_pages,
                                 on_spill=self._spill if self.host is not None else None)
        self.sched = Scheduler(self.kv, caps, model=model.cfg, cp=cfg.cp_config, policy=cfg.policy,
                               staging_pages=self.rt.staging.capacity, full_hit=cfg.full_hit)
        self._reload_fenced = False  # this reload round has synchronised the group (_fence_reload)
        self._keys: dict[Hashable, np.ndarray] = {}  # the running requests' tokens as arrays (_token_arrays)
        self.chain: Chain | None = None  # batches launched since the last synchronisation
        self.batches = 0        # batches run
        self.planned_ahead = 0  # batches whose plan was built during the batch before
        self.chained = 0        # batches whose end the host did not wait for

    def _expert_exchange(self):
        """The expert-parallel regions beside the compose runtime (collective), when this rank holds only a
        block of the routed experts; else None."""
        if not self.model.expert_parallel:
            return None
        from cpkv.compose.dispatch import ExpertExchange

        m = self.model.cfg
        return ExpertExchange(self.rt, hidden=m.hidden_size, top_k=m.num_experts_per_tok,
                              num_experts=m.n_routed_experts, dtype=self.model.dtype)

    # -- host tier ---------------------------------------------------------------------------------
    def _spill(self, owner: int, page_id: int, slot: int) -> None:
        if owner == self.rank and self.host is not None:
            self.host.offload([page_id], [slot])

    def reload_waiting(self) -> None:
        """Bring host-tier pages of the waiting (not yet started) requests' cached chains back.

        The queue head may evict to make room; later requests only use free pages (no thrashing).
        When any page came back, the group synchronises: peers gather prefix pages straight from the
        owner's pool (``prefix-gather`` before any collective), so the bytes must have landed first. Before the first
        page comes back it synchronises too (``_fence_reload``): the page it lands in may have been a prefix
        page of the batch just done (evicted here to make room), which a slower peer may still be
        gathering (``symm``/``prefetch`` gather after the batch's last barrier round, which this rank has passed
        as well).
        """
        if self.host is None:
            return
        reloaded = 0
        self._reload_fenced = False
        for i, req in enumerate(self.sched.queued[: self.cfg.caps().max_requests]):
            if not req.started:
                reloaded += self.kv.reload(req.keys, self._load, may_evict=i == 0)
        if reloaded:  # same count on every rank
            self.sync_time()
            self.ctx.barrier()

    def _load(self, owner: int, slot: int, page_id: int) -> None:
        self._fence_reload()  # every rank loads the same pages in the same order: the first call fences
        if owner == self.rank and self.host is not None:
            self.host.load([slot], [page_id])

    def _fence_reload(self) -> None:
        """Once per ``reload_waiting``, before its first pool write: every rank finished the last batch.
        Every rank reaches it at the same decision (the bookkeeping is replicated)."""
        if not self._reload_fenced:
            self.sync_time()
            self.ctx.barrier()
            self._reload_fenced = True

    # -- one batch ---------------------------------------------------------------------------------
    def run(self, batch: Batch, ahead: Ahead | None = None,
            then: Callable[[], Batch | None] | None = None) -> BatchResult:
        """Run one batch (the tokens are the requests' keys) -> its results. ``ahead``: this batch with its plan,
        built during the batch before; ``then``: when given, once the forward is launched the batch is done in the
        bookkeeping and ``then()`` forms the next batch, whose whole plan is built now (module docstring)."""
        slot, inst, chain = self.batches & 1, self.inst, self.chain  # chain: the batch before is still on the GPU
        nxt = finished = None
        with contextlib.ExitStack() as scope:
            prof = scope.enter_context(inst.batch_profiler())  # trace_dir: this batch alone, never chained
            launch = time.perf_counter() if chain is not None else self.sync_time()
            start_ev = self._event() if chain is None else None
            # the profiler's range of the batch: its plan, forward and logits copies (not the barrier check after it)
            scope.enter_context(inst.batch_range(prof))
            with contextlib.ExitStack() as fwd:  # plan + forward: no device->host sync
                fwd.enter_context(inst.sync_checked())
                fwd.enter_context(staging(self.model.device, slot, keep=ahead is not None))  # slot of its plan
                host_prof = fwd.enter_context(inst.host_profiled())
                rec = fwd.enter_context(inst.recording((launch, start_ev) if chain is None
                                                       else (chain.start, chain.start_ev)))
                out = self._forward(batch, ahead)
                inst.launched(launch)  # every kernel of the forward launched
                mark("launched")
                if then is not None:
                    finished = self.sched.postprocess(batch)  # bookkeeping only: the next batch's kernels run after
                    nxt = self._plan_next(then, slot)    # this one's on the stream
            logits = {i: out[i].detach().float() for i, e in enumerate(batch.entries) if e.last_chunk and i in out}
            chained = self._chain_on(launch, start_ev, rec, logits) if nxt is not None and prof is None and \
                self.cfg.chain else None
            if chained is None:
                self._end_chain(launch, self.sync_time(), rec)  # ... to the end of the batch
        if chained is None:
            self.rt.check_barrier()  # a GPU barrier timeout of these batches -> ComposeTimeout naming the late ranks
        self.batches += 1
        inst.after_batch(batch, self.batches, ahead is not None, prof, host_prof)
        if finished is None:
            finished = self.sched.postprocess(batch)
        return BatchResult(finished, {batch.entries[i].rid: v for i, v in logits.items()}, nxt, chained)

    def _forward(self, batch: Batch, ahead: Ahead | None) -> dict[int, torch.Tensor]:
        """Plan (unless planned ahead) and launch the batch's forward -> {entry: last-token logits}; with a tap, the
        layers' decisions are collected behind it."""
        if self.tap is not None:
            self.tap.batch_ends({i for i, e in enumerate(batch.entries) if e.last_chunk})
        if ahead is None:
            layout, page_ids, spec = self._spec(batch)
            first = lambda: self.rt.plan_batch(layout, page_ids, launch_layers=1)  # noqa: E731
            plan = rank_plan(spec, self.rank, self.model, self.ep)
            out = run_batch(self.model, self.rt, first, plan, self.graphs)
        else:
            plan = ahead.plan
            out = run_batch(self.model, self.rt, ahead.compose, plan, self.graphs)
        if self.tap is not None:  # host copies behind the forward
            self.decisions.append(self.tap.collect(plan, [e.rid for e in batch.entries], self.batches))
        return out

    def _plan_next(self, then: Callable[[], Batch | None], slot: int) -> Ahead | None:
        """The next batch (``then()``) with its whole plan, staged in the other slot; None when there is none."""
        following = then()
        if following is None:
            return None
        with staging(self.model.device, slot ^ 1):
            nxt = self._plan_ahead(following)
        self.planned_ahead += 1
        mark("next batch planned")
        return nxt

    def _chain_on(self, launch: float, start_ev: Any, rec: Any, logits: dict) -> tuple[Chain, Any]:
        """Chain the next batch (planned ahead) on this one: no drain; the logits this batch finishes are copied to
        host memory behind it (``logits`` updated in place), read once the next batch is launched."""
        for i, v in logits.items():
            logits[i] = _to_host(v)
        if self.chain is None:
            self.chain = Chain(launch, start_ev)
        ev = self._event()
        self.chain.ends.append(ev if ev is not None else time.perf_counter())
        self.chain.recs.append(rec)
        self.chained += 1
        return self.chain, self.chain.ends[-1]

    def _end_chain(self, launch: float, end: float | None, rec: Any = None) -> None:
        """Batch times once the stream is synchronised at ``end`` (host clock), to the instruments: the open chain's
        batches (each from the one before's end, by its end event), then this batch, from ``launch`` (its start,
        unless it ends a chain) to ``end``; ``end`` None: no batch of its own (the chain drained)."""
        chain, self.chain = self.chain, None
        spans, prev = [], launch
        if chain is not None:
            prev = chain.start
            for e, r in zip(chain.ends, chain.recs):
                at = chain.at(e)
                spans.append((at - prev, r))
                prev = at
        if end is not None:
            spans.append((end - prev, rec))
        self.inst.ended(spans)

    def drain(self) -> None:
        """Wait for a chain still on the GPU (its batch times)."""
        if self.chain is not None:
            self.sync_time()
            self._end_chain(self.chain.start, None)
            self.rt.check_barrier()

    def end_time(self, res: BatchResult) -> float | None:
        """The host clock at the batch's end: now (after a synchronisation when it finished a request) unless it was
        chained; chained, its end event's time (that batch alone waited for), or None when it finished nothing and
        returned no logits (nothing to wait for)."""
        if res.chained is None:
            return self.sync_time() if res.finished else time.perf_counter()
        if not (res.finished or res.logits):
            return None
        chain, end = res.chained
        return chain.at(end)

    # -- plans -------------------------------------------------------------------------------------
    def _spec(self, batch: Batch) -> tuple[Any, tuple[int, ...], BatchSpec]:
        """(layout, the current pages' pool ids, BatchSpec) of ``batch``."""
        layout = batch.layout(self.model.cfg.max_context)
        page_ids = tuple(pid for e in batch.entries for _, pid in e.pages)
        assert [o for e in batch.entries for o, _ in e.pages] == [c.writer for c in layout.current_pages]
        return layout, page_ids, BatchSpec(layout, self._token_arrays(batch), page_ids)

    def _plan_ahead(self, batch: Batch) -> Ahead:
        """``batch``'s whole plan now (the batch before still on the GPU): rank plan and rotary tables, compose
        plan, attention plan with every logits chunk's work items. Its uploads and device work queue behind the
        running batch."""
        layout, page_ids, spec = self._spec(batch)
        plan = rank_plan(spec, self.rank, self.model, self.ep)
        plan.rotary(self.model)
        compose = self.rt.plan_batch(layout, page_ids)
        plan.complete(self.model, chunks=None)
        return Ahead(batch, plan, compose)

    def _token_arrays(self, batch: Batch) -> tuple[np.ndarray, ...]:
        """Each entry's tokens [0, seq_len) as an int64 array view: one conversion per request, kept while its
        chunks run (converting a long prompt's key list per chunk would delay the batch's first kernel); rebuilt
        when the request's keys grew (decode)."""
        arrays = {}
        for e in batch.entries:
            a = self._keys.get(e.rid)
            if a is None or a.size != len(e.request.keys):
                a = np.asarray(e.request.keys, dtype=np.int64)
            arrays[e.rid] = a
        self._keys = arrays  # only this batch's requests: bounded by the batch
        return tuple(arrays[e.rid][: e.seq_len] for e in batch.entries)

    # -- the device --------------------------------------------------------------------------------
    def _event(self):
        """A CUDA event recorded now on the current stream (None on the CPU)."""
        if self.model.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def sync_time(self) -> float:
        """The host clock once the device has finished its queued work."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter()

    def close(self) -> None:
        self.rt.close()


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """x's bytes into pinned host memory, queued on the stream (no wait); valid once the stream passes here."""
    if x.device.type != "cuda":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return out.copy_(x, non_blocking=True)
