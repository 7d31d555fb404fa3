"""The per-rank engine loop. Every rank runs it on the same inputs and takes the same decisions.

    setup      model, ComposeRuntime (pool + staging in peer memory), host tier, the KV-cache manager
               (one PageAllocator mirror per rank, the CP-wide prefix cache), the scheduler
    release    a request enters the queue once its parent finished (so the next turn of a conversation
               can hit it); requests without a parent are queued at the start
    reload     before admission, host-tier pages on a waiting request's cached chain come back into
               their owner's pool (the owner copies the bytes; every rank updates its mirror)
    batch      next_batch -> layout -> compose plan (current pages persist into the entries' pages)
               -> forward -> finish (full pages enter the prefix cache, owned by their writers)
    look ahead once a batch's forward is launched and no request waits on a parent, the batch is finished in
               the bookkeeping right away, the next batch formed and its whole plan built (uploads in the
               other staging slot) while the GPU still runs this one: the next batch's kernels start
               as soon as this one's end (a long prompt's chunks run back to back; cfg.look_ahead)
    chain      a batch planned ahead is launched without waiting for the one before to end: no synchronisation
               between them, so the GPU never idles at a batch start (a long prompt's chunks, the next request
               after one that finishes). A chained batch's logits are copied to pinned host memory behind it;
               its results (logits, finished requests and their end times, from a CUDA event at its end) are
               taken once the next batch is launched. The chain's batch times come from those events. The
               online engine looks ahead only after a batch that finishes no step (the next step needs its
               token), so its chains are a long prompt's chunks.

Only the owner of a page touches its bytes (spill, reload); the bookkeeping is replicated.
"""
from __future__ import annotations

import bisect
import contextlib
import os
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Hashable, Sequence

import numpy as np
import torch

from cpkv.dist import RankContext
from cpkv.engine.config import EngineConfig
from cpkv.engine.forward import BatchSpec, rank_plan, run_batch
from cpkv.engine.graphs import for_model
from cpkv.kvcache.allocator import PageAllocator
from cpkv.kvcache.manager import KVCacheManager
from cpkv.model.model import DSAModel, load_model
from cpkv.scheduler import Batch, Request, Scheduler
from cpkv.scheduler.trace import TraceRequest, materialize_tokens
from cpkv.timeline import mark, recording
from cpkv.upload import staging


@dataclass
class Ahead:
    """The next batch with its plan, built while the GPU ran the batch before (``RankEngine._plan_ahead``)."""

    batch: Batch
    plan: Any     # cpkv.engine.forward.RankPlan, completed (every logits chunk's work items)
    compose: Any  # cpkv.compose.plan.ComposePlan


@dataclass
class _Chain:
    """Batches launched since the last synchronisation, each without waiting for the one before to end."""

    start: float       # the host clock right after the synchronisation before the chain's first batch
    start_ev: Any      # a CUDA event recorded then (None on the CPU)
    ends: list = field(default_factory=list)  # per deferred batch: its end (a CUDA event; host seconds on CPU)
    recs: list = field(default_factory=list)  # per deferred batch: its timeline Recorder (cfg.marks) or None


@dataclass
class RankOutput:
    """What one rank returns for one run (plain picklable data: torch tensors would travel through shared
    memory that dies with the rank). ``logits``: float32 numpy [vocab], only for requests whose last
    token this rank held."""

    rank: int
    logits: dict[Hashable, Any] = field(default_factory=dict)
    done_s: dict[Hashable, float] = field(default_factory=dict)   # finish time - release time
    cached: dict[Hashable, int] = field(default_factory=dict)
    rejected: dict[Hashable, str] = field(default_factory=dict)
    wall_s: float = 0.0
    pages_used: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    decisions: list = field(default_factory=list)  # with cfg.record: per batch, cpkv.engine.taps.BatchDecisions


class RankEngine:
    """One rank's engine for one run (see the module docstring)."""

    def __init__(self, ctx: RankContext, cfg: EngineConfig, model: DSAModel) -> None:
        from cpkv.compose.runtime import ComposeRuntime
        from cpkv.kvcache.host import HostTier

        self.ctx, self.cfg, self.model, self.rank = ctx, cfg, model, ctx.rank
        caps = cfg.caps()
        self.rt = ComposeRuntime.create(ctx, model.cfg, num_pages=cfg.pages_per_rank, page_size=cfg.page_size,
                                        caps=caps, mode=cfg.mode)
        self.ep = self._expert_exchange()
        self.tap = model.tap if cfg.record or cfg.plant else None  # installed by rank_main, before any capture
        if (cfg.record or cfg.plant) and self.tap is None:
            raise ValueError("a run that records decisions needs its model's tap (rank_main installs it)")
        if model.tap is not None:  # this run's planted fault (or none) may fire once
            model.tap.reset(cfg.plant, cfg.page_size)
        self.decisions: list = []  # per batch: its BatchDecisions (host copies, complete once the run ends)
        # small batches' layer pieces as CUDA graphs (captured once per model: later runs replay them)
        # (no rank's batch holds more new tokens than the chunk: buckets past it would never run)
        self.graphs = for_model(model, min(cfg.graph_tokens, cfg.chunk_size)) if cfg.graph_tokens else None
        if self.graphs is not None:
            self.graphs.warm()  # every bucket's pieces captured before the first batch (once per model)
        self._graph_counts = self.graphs.counts() if self.graphs is not None else None  # before this run's batches
        self.host = HostTier(self.rt.pool, cfg.host_pages) if cfg.host_pages else None
        allocators = [PageAllocator(cfg.pages_per_rank, f"rank {r} pool") for r in range(cfg.cp)]
        self.kv = KVCacheManager(cfg.page_size, allocators, cfg.host_pages,
                                 on_spill=self._spill if self.host is not None else None)
        self.sched = Scheduler(self.kv, caps, model=model.cfg, cp=cfg.cp_config, policy=cfg.policy,
                               staging_pages=self.rt.staging.capacity, full_hit=cfg.full_hit)
        self._reload_fenced = False  # this reload round has synchronised the group (_fence_reload)
        self.gpu_setup_bytes = self._gpu_mark()  # weights + pool + staging + buffers, before any batch
        self.out = RankOutput(self.rank)
        self.batches = 0
        self.batch_log: list[list[tuple]] = []  # per batch: (id, prefix_len, extend_len, chunked, last_chunk)
        self._keys: dict[Hashable, np.ndarray] = {}  # the running requests' tokens as arrays (_token_arrays)
        self.batch_s: list[float] = []           # per batch: seconds from plan to logits (device synced); a batch
        #                                          planned ahead: from the end of the batch before
        self.planned_ahead = 0                   # batches whose plan was built during the batch before
        self.batch_ahead: list[bool] = []        # per batch: was it one of those (its plan off its critical path)
        self.chained = 0                         # batches whose end the host did not wait for (module docstring)
        self._chain: _Chain | None = None        # those since the last synchronisation
        self._run_prof = None                    # with cfg.profile on CUDA (no trace_dir): one profiler over the run
        self.host_s: list[float] = []            # per batch: seconds from its start until the host has launched its
        #                                          whole forward (near batch_s: the GPU waited for the host)
        self.kernels: list[list[tuple[str, float, float]]] = []  # per batch, with cfg.profile: (name, start us,
        #                                                           end us) of every kernel, from the batch start
        self.host_ops: list[list[tuple[str, float, int]]] = []  # per batch, with cfg.profile: the top host ops
        #                                                           (name, self ms, calls)
        self.host_funcs: list[list[tuple[str, float, float, int]]] = []  # per batch, with cfg.host_profile:
        #                                                  (function, cumulative ms, own ms, calls) under cProfile
        self.marks: list[dict] = []  # per batch, with cfg.marks: {"unix_start": s, "gpu_start_ms": ms on the
        #                              process's GPU clock, "rows": [(label, host ms, GPU ms[, SM MHz])]}

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

    def _reload_waiting(self) -> None:
        """Bring host-tier pages of the waiting (not yet started) requests' cached chains back.

        The queue head may evict to make room; later requests only use free pages (no thrashing).
        When any page came back, the group synchronises: peers gather prefix pages straight from the
        owner's pool (``v2`` before any collective), so the bytes must have landed first. Before the first
        page comes back it synchronises too (``_fence_reload``): the page it lands in may have been a prefix
        page of the batch just finished (evicted here to make room), which a slower peer may still be
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
            self._sync_time()
            self.ctx.barrier()

    def _load(self, owner: int, slot: int, page_id: int) -> None:
        self._fence_reload()  # every rank loads the same pages in the same order: the first call fences
        if owner == self.rank and self.host is not None:
            self.host.load([slot], [page_id])

    def _fence_reload(self) -> None:
        """Once per ``_reload_waiting``, before its first pool write: every rank finished the last batch.
        Every rank reaches it at the same decision (the bookkeeping is replicated)."""
        if not self._reload_fenced:
            self._sync_time()
            self.ctx.barrier()
            self._reload_fenced = True

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, trace: Sequence[TraceRequest]) -> RankOutput:
        """The trace loop: requests released as their parents finish, batches until nothing is left."""
        tokens = materialize_tokens(trace, vocab_size=self.model.cfg.vocab_size)
        blocked, released, done = list(trace), {}, set()
        self.ctx.barrier()
        t0 = time.perf_counter()
        pending: list = []  # a chained batch's results: read once the next batch is launched (``_results``)
        with self._run_profiled() as self._run_prof:
            self._loop(blocked, tokens, released, done, t0, pending)
            self._drain()
            self._results(pending, done, released, t0)
        if self._run_prof is not None:  # every kernel recorded: each batch's share of the run's timeline
            self.kernels, self.host_ops = _batch_spans(self._run_prof)
            self._run_prof = None
        for r in blocked:
            self.out.rejected[r.id] = "parent: its parent never finished"
        self.out.decisions = [d.numpy() for d in self.decisions]  # every batch ended
        self.out.wall_s = time.perf_counter() - t0
        self._finish_stats()
        return self.out

    def _loop(self, blocked: list, tokens, released: dict, done: set, t0: float, pending: list) -> None:
        """Batches until nothing is left (``blocked`` is updated in place; ``pending``: the last batch's results
        when it was chained, taken by the caller)."""
        ahead: Ahead | None = None
        while True:
            blocked[:] = self._release(blocked, tokens, released, done, time.perf_counter() - t0)
            if ahead is None:
                self._reload_waiting()
                batch = self.sched.next_batch()
                self._note_rejections(done)
                if batch is None:
                    if not self.sched.has_work and not self._ready(blocked, done):
                        break
                    continue
            else:
                batch = ahead.batch
            finished, logits, ahead = self._run_batch(batch, ahead, look_ahead=lambda: self._may_look_ahead(blocked))
            self._note_rejections(done)
            self._results(pending, done, released, t0)  # the batch before's, when it was chained: it ended first
            pending.append((finished, logits, None if self._chain is None else (self._chain, self._chain.ends[-1])))
            if self._chain is None:  # synchronised: this batch's results now
                self._results(pending, done, released, t0)
            if self.rank == 0:
                self.ctx.report((len(done), self.batches))  # the launching parent's progress line

    def _results(self, pending: list, done: set, released: dict, t0: float) -> None:
        """Take a batch's results (emptying ``pending``): its logits and its finished requests' times. A chained
        batch (its chain given) ended when its end event did: waited for alone (the next batch may run), its
        logits already copied to pinned host memory before that event, its requests done at the event's time."""
        for finished, logits, chained in pending:
            if not chained:
                now = (self._sync_time() if finished else time.perf_counter()) - t0
            elif not (finished or logits):  # a middle chunk: nothing to wait for
                continue
            else:
                chain, end = chained
                if isinstance(end, float):  # (CPU: the host clock at its end)
                    now = end - t0
                else:
                    end.synchronize()
                    now = chain.start + chain.start_ev.elapsed_time(end) / 1e3 - t0
            self.out.logits.update({rid: v.cpu().numpy() for rid, v in logits.items()})
            for req in finished:
                self.out.done_s[req.rid] = now - released[req.rid]
                self.out.cached[req.rid] = req.cached
                done.add(req.rid)
        pending.clear()

    def _may_look_ahead(self, blocked: list[TraceRequest]) -> bool:
        """Form the next batch before this one ends: with cfg.look_ahead, no host tier (its spills and reloads
        synchronise between batches) and no request waiting on a parent (one finishing now must be able to join
        the next batch, as without look-ahead)."""
        return self.cfg.look_ahead and self.host is None and not blocked

    def _ready(self, blocked: list[TraceRequest], done: set) -> bool:
        return any(r.parent is None or r.parent in done for r in blocked)

    def _release(self, blocked, tokens, released, done, now: float) -> list[TraceRequest]:
        still = []
        for r in blocked:
            if r.parent is not None and r.parent not in done:
                still.append(r)
                continue
            released[r.id] = now
            why = self.sched.add(Request(r.id, tokens[r.id], r.prompt_len, r.arrival))
            if why is not None:
                self.out.rejected[r.id] = f"{why.reason}: {why.detail}"
                done.add(r.id)
        return still

    def _note_rejections(self, done: set) -> None:
        for req in self.sched.rejected:
            if req.rid not in self.out.rejected:
                self.out.rejected[req.rid] = req.reason
                done.add(req.rid)

    def _run_batch(self, batch: Batch, ahead: Ahead | None = None, look_ahead: Any = None):
        """Run one batch (the tokens are the requests' keys) -> (the requests whose last chunk this was,
        {request id: float32 [vocab] last-token logits} for those whose last token is here (on the device; in
        pinned host memory, valid once the batch ends, when it is chained: ``self._chain`` is then set),
        the next batch built ahead or None). ``ahead``: this batch with its plan, built during the batch before;
        ``look_ahead``: a function saying, once the forward is launched, whether to form and plan the next
        batch now (module docstring)."""
        slot, nxt, finished = self.batches & 1, None, None  # staging slot: batch n+1 plans while n's copies run
        if ahead is None:
            layout, page_ids, spec = self._spec(batch)
        chain = self._chain  # not None: the batch before is still on the GPU (chained)
        with self._profiled() as prof:
            launch = time.perf_counter() if chain is not None else self._sync_time()
            start_ev = self._event() if chain is None else None
            # the profiler's range of the batch: from its start (as timed), its plan, forward and logits copies (not
            # the barrier check after it)
            with _mark("cpkv.batch", prof or self._run_prof):
                # plan + forward: no device->host sync; a batch planned ahead continues the slot its plan was staged in
                with self._sync_checked(), staging(self.model.device, slot, keep=ahead is not None):
                    with _host_profiled(self.cfg.host_profile) as hp, \
                            recording(self.model.device, self.cfg.marks, self.cfg.mark_clocks,
                                      (launch, start_ev) if chain is None else (chain.start, chain.start_ev)) as rec:
                        if self.tap is not None:
                            self.tap.batch_ends({i for i, e in enumerate(batch.entries) if e.last_chunk})
                        if ahead is None:
                            first = lambda: self.rt.prepare(layout, page_ids, launch_layers=1)  # noqa: E731
                            plan = rank_plan(spec, self.rank, self.model, self.ep)
                            out = run_batch(self.model, self.rt, first, plan, self.graphs)
                        else:
                            plan = ahead.plan
                            out = run_batch(self.model, self.rt, ahead.compose, plan, self.graphs)
                        if self.tap is not None:  # host copies behind the forward
                            self.decisions.append(self.tap.collect(plan, [e.rid for e in batch.entries],
                                                                   self.batches))
                        self.host_s.append(time.perf_counter() - launch)  # every kernel of the forward launched
                        mark("launched")
                        if look_ahead is not None and look_ahead():
                            finished = self.sched.finish(batch)  # bookkeeping only: the next batch's kernels run
                            following = self._next_ahead()      # after this one's on the stream
                            if following is not None:
                                with staging(self.model.device, slot ^ 1):
                                    nxt = self._plan_ahead(following)
                                self.planned_ahead += 1
                                mark("next batch planned")
                logits = {i: out[i].detach().float() for i, e in enumerate(batch.entries) if e.last_chunk and i in out}
                # chain the next batch (planned ahead) on this one: no drain; the logits this batch finishes are
                # copied to host memory behind it, read once the next batch is launched (``run``'s ``_results``)
                defer = nxt is not None and prof is None and self.cfg.chain
                if defer:
                    logits = {i: _to_host(v) for i, v in logits.items()}
                    if chain is None:
                        chain = self._chain = _Chain(launch, start_ev)
                    ev = self._event()
                    chain.ends.append(ev if ev is not None else time.perf_counter())
                    chain.recs.append(rec)
                    self.chained += 1
                else:
                    self._end_batch(launch, self._sync_time(), rec)  # ... to the end of the batch
        if not defer:
            self.rt.check_barrier()  # a GPU barrier timeout of these batches -> ComposeTimeout naming the late ranks
        if prof is not None:  # trace_dir: the trace alone (torch's event parse fails after stacks)
            _export_trace(prof, os.path.join(self.cfg.trace_dir, f"rank{self.rank}_batch{self.batches}.json.gz"))
        if hp is not None:
            self.host_funcs.append(host_functions(hp))
        self.batches += 1
        self.batch_log.append([(e.rid, e.prefix_len, e.extend_len, e.chunked, e.last_chunk) for e in batch.entries])
        self.batch_ahead.append(ahead is not None)
        if self.cfg.fault == (self.rank, self.batches):
            os._exit(3)  # fault injection (tests): this rank dies mid-run
        if finished is None:
            finished = self.sched.finish(batch)
        return finished, {batch.entries[i].rid: v for i, v in logits.items()}, nxt

    def _event(self):
        """A CUDA event recorded now on the current stream (None on the CPU)."""
        if self.model.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _end_batch(self, launch: float, end: float | None, rec=None) -> None:
        """Batch times once the stream is synchronised at ``end`` (host clock): the open chain's batches (each
        from the one before's end, by its end event), then this batch, from ``launch`` (its start, unless it
        ends a chain) to ``end``; ``end`` None: no batch of its own (the chain drained)."""
        chain, self._chain = self._chain, None
        prev = launch
        if chain is not None:
            prev = chain.start
            for e, r in zip(chain.ends, chain.recs):
                at = e if isinstance(e, float) else chain.start + chain.start_ev.elapsed_time(e) / 1e3
                self.batch_s.append(at - prev)
                prev = at
                self._keep_marks(r)
        if end is not None:
            self.batch_s.append(end - prev)
            self._keep_marks(rec)

    def _keep_marks(self, rec) -> None:
        if rec is not None:
            self.marks.append({"unix_start": rec.unix_start, "gpu_start_ms": rec.gpu_start_ms(), "rows": rec.rows()})

    def _drain(self) -> None:
        """Wait for a chain still on the GPU (its batch times)."""
        if self._chain is not None:
            self._sync_time()
            self._end_batch(self._chain.start, None)
            self.rt.check_barrier()

    def _next_ahead(self) -> Batch | None:
        """The next batch, formed during look-ahead (the batch before is finished in the bookkeeping): the
        scheduler's next batch here; the online engine takes its messages first."""
        return self.sched.next_batch()

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
        compose = self.rt.prepare(layout, page_ids)
        plan.complete(self.model, chunks=None)
        return Ahead(batch, plan, compose)

    def _token_arrays(self, batch: Batch) -> tuple[np.ndarray, ...]:
        """Each entry's tokens [0, seq_len) as an int64 array view: one conversion per request, kept while its
        chunks run (a 128K-token prompt's key list converted per chunk cost milliseconds before the batch's
        first kernel); rebuilt when the request's keys grew (decode)."""
        arrays = {}
        for e in batch.entries:
            a = self._keys.get(e.rid)
            if a is None or a.size != len(e.request.keys):
                a = np.asarray(e.request.keys, dtype=np.int64)
            arrays[e.rid] = a
        self._keys = arrays  # only this batch's requests: bounded by the batch
        return tuple(arrays[e.rid][: e.seq_len] for e in batch.entries)

    def _sync_checked(self):
        """With cfg.sync_check on CUDA: one error naming every device->host synchronisation inside."""
        if not (self.cfg.sync_check and self.model.device.type == "cuda"):
            return contextlib.nullcontext()
        return _sync_debug_error()

    def _profiled(self):
        """With cfg.trace_dir (and cfg.profile): a torch profiler recording the batch (kernels on CUDA, with Python
        stacks unless cfg.trace_stacks is off; the CPU's trace holds host ops alone), else None: a batch so
        profiled is never chained. Without trace_dir, cfg.profile records the whole run (``_run_profiled``)."""
        if not (self.cfg.profile and self.cfg.trace_dir):
            return contextlib.nullcontext()
        return self._profiler()

    def _run_profiled(self):
        """With cfg.profile on CUDA and no trace_dir: one torch profiler over the whole run, so that batches chain
        as unprofiled (a profiler per batch would synchronise at each end); ``_batch_spans`` then splits its
        kernels by batch. Else None."""
        if not (self.cfg.profile and self.model.device.type == "cuda" and not self.cfg.trace_dir):
            return contextlib.nullcontext()
        return self._profiler()

    def _profiler(self):
        cuda = self.model.device.type == "cuda"
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        return profile(activities=acts, with_stack=bool(self.cfg.trace_dir) and self.cfg.trace_stacks)

    def _sync_time(self) -> float:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter()

    def _gpu_mark(self) -> int | None:
        """CUDA: the bytes allocated now, and the peak counter restarted from here (None elsewhere)."""
        if self.model.device.type != "cuda":
            return None
        torch.cuda.reset_peak_memory_stats(self.model.device)
        return int(torch.cuda.memory_allocated(self.model.device))

    def _gpu_memory(self) -> dict | None:
        """CUDA: what this rank holds before its first batch (``setup_bytes``) and at the peak of its batches
        (allocated and reserved by torch's caching allocator): the memory plan's items, measured."""
        if self.gpu_setup_bytes is None:
            return None
        dev = self.model.device
        return {"setup_bytes": self.gpu_setup_bytes, "peak_bytes": int(torch.cuda.max_memory_allocated(dev)),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(dev))}

    def _finish_stats(self) -> None:
        self.out.pages_used = self.kv.pages_used()
        self.out.stats = {
            "batches": self.batches, "spilled": self.kv.stats["spilled"],
            "reloaded": self.kv.stats["reloaded"], "evicted": self.kv.stats["evicted"],
            "mode": self.rt.effective_mode(), "peer_memory": self.rt.mem.kind,
            "barrier": type(self.rt.barrier).__name__ if self.rt.barrier is not None else None,
            "prefetch_hits": self.rt.prefetch_hits, "attention": self.model.layer_stats(),
            "weights_dtype": self.model.weights_dtype,
            "batch_log": self.batch_log, "batch_s": self.batch_s, "kernels": self.kernels,
            "host_ops": self.host_ops, "host_funcs": self.host_funcs, "experts": self._experts_held(),
            "gpu_memory": self._gpu_memory(), "planned_ahead": self.planned_ahead, "batch_ahead": self.batch_ahead,
            "host_s": self.host_s, "chained": self.chained,
            "marks": self.marks, "graphs": self._graph_stats(),
        }

    def _graph_stats(self) -> dict | None:
        """With cfg.graph_tokens: this run's batches through the graphs' buffers, pieces its batches captured and
        ran eagerly (first uses: none once warmed), the captures held,
        the buffers' bytes, the seconds ``LayerGraphs.warm`` took (capturing every bucket before any batch) and the
        device bytes the graphs hold (buffers and the captures' pool; CUDA)."""
        if self.graphs is None:
            return None
        now, then = self.graphs.counts(), self._graph_counts
        return {"max_tokens": self.graphs.max_tokens, "batches": now["batches"] - then["batches"],
                "captured": now["captured"] - then["captured"], "eager_pieces": now["eager_pieces"] -
                then["eager_pieces"], "graphs_held": now["captured"], "buffer_bytes": now["buffer_bytes"],
                "warm_s": now["warm_s"], "device_bytes": now["device_bytes"]}

    def _experts_held(self) -> int:
        """Routed experts this rank holds (0 for a model without MoE layers)."""
        return len(self.model.experts) if "sparse" in self.model.cfg.mlp_layer_types else 0

    def close(self) -> None:
        self.rt.close()


def rank_main(ctx: RankContext, jobs: Sequence[tuple[EngineConfig, Sequence[TraceRequest]]]) -> list[RankOutput]:
    """Rank entry point (cpkv.dist.launch or torchrun): run each (config, trace) job in order."""
    share_cores(ctx)
    models: dict[tuple, DSAModel] = {}
    outputs = []
    for cfg, trace in jobs:
        key = (cfg.model, cfg.seed, cfg.num_layers, cfg.precision, cfg.weights_dtype)
        if key not in models:
            models.clear()  # one model in memory at a time (a bench runs fp8 then bf16 weights of one model)
            model = None
            models[key] = rank_model(ctx, cfg)
            if any(c.record or c.plant for c, _ in jobs):  # before any graph is captured
                from cpkv.engine.taps import Recorder
                plant = next((c.plant for c, _ in jobs if c.plant), None)
                models[key].set_tap(Recorder(models[key], max(c.chunk_size for c, _ in jobs), cfg.page_size,
                                             ctx.rank, plant))
        model = models[key]
        for layer in model.layers:
            layer.stats.update(dense=0, sparse=0)
        if cfg.warmup:  # untimed: JIT/autotune every kernel shape of this trace (and fill first-use caches)
            _run_once(ctx, replace(cfg, sync_check=False, profile=False), model, trace)
            for layer in model.layers:
                layer.stats.update(dense=0, sparse=0)
        outputs.append(_run_once(ctx, cfg, model, trace))
    return outputs


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
                       precision=cfg.precision, weights=cfg.weights_dtype, ep=ep)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # the load's transients (dense weights quantised at load) go back to the GPU
    batch_threads(ctx.device)
    return model


def _run_once(ctx: RankContext, cfg: EngineConfig, model: DSAModel, trace: Sequence[TraceRequest]) -> RankOutput:
    engine = RankEngine(ctx, cfg, model)
    try:
        return engine.run(trace)
    finally:
        engine.close()


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's sync-debug message


@contextlib.contextmanager
def _sync_debug_error():
    """Inside: every device->host synchronisation is recorded with the cpkv frames that reached it (torch's
    sync debug mode "warn", each warning caught with its stack); on exit one error lists them all, so one
    GPU run names every site rather than the first. A canary sync on entry proves the warnings arrive; where
    they would not, torch's "error" mode stops at the first sync instead (never a silent pass)."""
    sites: dict[str, int] = {}

    def seen(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return shown(message, category, filename, lineno, file, line)
        site = sync_site(traceback.extract_stack()[:-1])
        sites[site] = sites.get(site, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, seen
        torch.cuda.set_sync_debug_mode("warn")
        _canary()  # one known sync: if its warning does not reach ``seen``, fall back to stopping at the first
        if not sites:
            torch.cuda.set_sync_debug_mode("error")
        sites.clear()
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if sites:
        raise RuntimeError(f"{sum(sites.values())} device->host synchronisations in a batch's plan + forward: "
                           + "; ".join(f"{n}x {s}" for s, n in sites.items()))


def _canary() -> None:
    """A synchronisation known to trigger torch's sync debug check (the stream is idle at a batch's start)."""
    torch.cuda.current_stream().synchronize()


def sync_site(stack: traceback.StackSummary) -> str:
    """``a.py:12 f < b.py:40 g``: the cpkv frames of a stack, innermost first (the whole stack's last three
    frames when none is cpkv's)."""
    stack = [f for f in stack if os.path.basename(f.filename) != "warnings.py"]
    mine = [f for f in stack if f"{os.sep}cpkv{os.sep}" in f.filename]
    frames = (mine or stack[-3:])[::-1][:6]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """x's bytes into pinned host memory, queued on the stream (no wait); valid once the stream passes here."""
    if x.device.type != "cuda":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return out.copy_(x, non_blocking=True)


def _mark(name: str, prof):
    """A profiler range around the batch's plan, forward and logits copies (anchors its kernels: ``split_spans``);
    nothing unprofiled."""
    if prof is None:
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


HOST_TOP = 12
HOST_FUNCS_TOP = 40


@contextlib.contextmanager
def _host_profiled(on: bool):
    """With ``on``: a cProfile.Profile enabled inside (yielded; disabled on exit), else None."""
    if not on:
        yield None
        return
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield prof
    finally:
        prof.disable()


def host_functions(prof, top: int = HOST_FUNCS_TOP) -> list[tuple[str, float, float, int]]:
    """The functions with the most cumulative time in a cProfile'd batch: (``file.py:line name``, cumulative
    ms, own ms, calls), cumulative-descending (the batch's host time, inclusive of what each function called),
    then those of the ``top // 2`` with the most own time not among them (where leaf time goes: launchers, aten)."""
    import pstats

    st = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(st.items(), key=lambda kv: -kv[1][3])[:top]
    seen = {k for k, _ in rows}
    rows += [kv for kv in sorted(st.items(), key=lambda kv: -kv[1][2])[: top // 2] if kv[0] not in seen]
    return [(f"{os.path.basename(f)}:{ln} {name}"[:100], round(ct * 1e3, 3), round(tt * 1e3, 3), nc)
            for (f, ln, name), (_, nc, tt, ct, _) in rows]


def _export_trace(prof, path: str) -> None:
    """The profiled batch as a gzipped Chrome trace (chrome://tracing, Perfetto) at ``path``."""
    import gzip
    import shutil
    import tempfile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)


def _batch_spans(prof) -> tuple[list[list[tuple[str, float, float]]], list[list[tuple[str, float, int]]]]:
    """A run's profiler (``_run_profiled``) -> per batch, in order: its kernels (:func:`split_spans`: name, start
    us, end us from the batch's start) and its host ops with the most self time (name, self ms, calls) inside
    its ``cpkv.batch`` range."""
    from torch.autograd import DeviceType

    events = prof.events()
    ranges = sorted((e for e in events if e.name == "cpkv.batch" and e.device_type == DeviceType.CPU),
                    key=lambda e: e.time_range.start)
    # each range's GPU-side annotation (the profiler's): from the first kernel launched inside it to the end of the
    # last one
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.name == "cpkv.batch" and e.device_type == DeviceType.CUDA)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
               if e.device_type == DeviceType.CUDA and e.name != "cpkv.batch"]
    spans = split_spans(kernels, [e.time_range.start for e in ranges], gpu if len(gpu) == len(ranges) else None)
    host = []
    for r in ranges:
        own: dict[str, list] = {}
        for e in events:
            if (e.device_type == DeviceType.CPU and e is not r and r.time_range.start <= e.time_range.start
                    and e.time_range.end <= r.time_range.end):
                row = own.setdefault(e.name[:100], [0.0, 0])
                row[0] += e.self_cpu_time_total
                row[1] += 1
        top = sorted(own.items(), key=lambda kv: -kv[1][0])[:HOST_TOP]
        host.append([(name, round(us / 1e3, 3), n) for name, (us, n) in top])
    return spans, host


def split_spans(kernels: Sequence[tuple[str, float, float]], host_starts: Sequence[float],
                gpu_ranges: Sequence[tuple[float, float]] | None) -> list[list[tuple[str, float, float]]]:
    """One profiled run's kernels split by batch.

    ``kernels``: (name, start us, end us), on the profiler's clock (the host's: CUPTI converts); ``host_starts``:
    each batch's ``cpkv.batch`` range start on the host, in batch order; ``gpu_ranges``: each range's GPU-side
    annotation (from the first kernel launched inside it to the end of the last), or None where the profiler
    gave none. A batch holds the kernels starting inside its GPU range (one stream runs a batch's kernels, then
    its logits copies, then the next batch's: a chained batch's kernels are launched while the one before still
    runs, so launch time would not tell them apart); without GPU ranges, those starting from its host start
    until the next batch's. Kernels before the first batch or between two batches' GPU ranges (the host's work
    after a batch has ended, such as reading its logits or the barrier's state) are left out. Times are from the
    batch's start: its host start, or, chained (the batch before still running then), the end of the batch
    before's last kernel, where its own GPU time begins: what is idle from there is the GPU waiting for this
    batch's host work.
    -> per batch [(name, start, end)], start-sorted."""
    bounds = [g[0] for g in gpu_ranges] if gpu_ranges is not None else list(host_starts)
    ends = [g[1] for g in gpu_ranges] if gpu_ranges is not None else [float("inf")] * len(bounds)
    out: list[list[tuple[str, float, float]]] = [[] for _ in bounds]
    for name, a, b in sorted(kernels, key=lambda k: k[1]):
        i = bisect.bisect_right(bounds, a) - 1
        if i >= 0 and a < ends[i]:
            out[i].append((name, a, b))
    spans, prev_end = [], float("-inf")
    for host, ks in zip(host_starts, out):
        t0 = max(host, prev_end)
        spans.append([(n, a - t0, b - t0) for n, a, b in ks])
        prev_end = max((b for _, _, b in ks), default=prev_end)
    return spans
