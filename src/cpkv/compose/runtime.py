"""ComposeRuntime: one per rank; every layer it gives this rank the batch's dense KV (docs/design.md §4).

Setup (collective, once)::

    rt = ComposeRuntime.create(ctx, model, num_pages=N, page_size=P, caps=caps, num_layers=L)
    # or: mem = PeerMemory.create(ctx); pool = KVPool(..., alloc=mem.alloc); rt = ComposeRuntime(ctx, pool, mem, caps)

Per batch and per (layer, kind), every rank, in the same order::

    plan = rt.plan_batch(layout, current_page_ids)     # once per batch; passed to every call below
    rows = rt.current_rows(plan, layer, kind)          # uint8 [n_own * P, row_bytes], writable
    rows.index_copy_(0, plan.query_rows, kv_rows)      # the writer's KV rows of its query tokens
    dense = rt.compose(plan, layer, kind)              # uint8 [num_slots * P, row_bytes]

or, with the rows of every kind written first, ``dense = rt.compose_layer(plan, layer)`` ({kind: dense};
under ``symm`` one barrier round and one gather call for all kinds, a launch per kind).

Contract:

- ``current_rows`` is this rank's block of its staging half: row ``j * P + t`` holds token t of the
  rank's j-th own current page (compact order restricted to the rank); ``plan.query_rows`` maps the
  rank's query tokens (``layout.rank_query_ranges[rank]`` order) to rows. Rows past a partial page's
  end are zeroed by ``current_rows``; write only the query rows. Under ``symm``/``prefetch`` peers
  read this block directly (the writer writes straight into staging); other modes read it locally.
- ``compose`` returns a view into the parity arena: valid until the next ``compose`` of the same kind.
- Persistence: when the plan has ``current_page_ids`` (one writer-side pool page id per current page,
  compact order, allocated by the caller from each writer's allocator), every mode also stores the
  rank's current pages into those pages of its pool (layer, kind), so later batches can use them as
  prefix pages. Page bytes are copied whole: a partial page's tail rows are zeros.
- Every rank must make the same sequence of ``current_rows``/``compose`` calls (kinds alternate
  freely); a per-kind use counter picks the staging and arena half (use n -> half n % 2).

Barrier rounds (``symm``, ``prefetch``): on CUDA with Triton a kernel on this rank's stream
(``cpkv.compose.barrier.DeviceBarrier``): nothing waits on the host, and a round that times out surfaces as
ComposeTimeout at ``check_barrier`` (the engine calls it once per batch, after the batch's synchronisation);
on the CPU a host-waited round that raises at once. A group of one rank takes no rounds.

Parts: ``buffers`` (``compose.buffers.ComposeBuffers``: pool, staging, arena and the source tables over every
rank's), ``launches`` (``compose.launches.GatherLaunches``: the Triton gathers built once per plan),
``prefetcher`` (``compose.prefetch.Prefetcher``), ``barrier`` (``compose.barrier``); the modes
(``compose.modes``) run against this object's primitives: ``dense``, ``gather``, ``gather_kinds``, ``all_reduce``,
``barrier_round``, ``persist``, ``persist_kinds``.

Wrong batches, pools of another shape, unknown modes or a layout whose cp differs from the group
raise ComposeError; too many current pages raise StagingOverflow on every rank.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from cpkv import envs
from cpkv.compose.barrier import DeviceBarrier, make_barrier
from cpkv.compose.buffers import ComposeBuffers, check_pool, pool_page_bytes
from cpkv.compose.launches import GatherLaunches
from cpkv.compose.modes import Mode, get_mode
from cpkv.compose.peer import PeerMemory
from cpkv.compose.plan import ComposePlan, Entries
from cpkv.compose.prefetch import Prefetcher
from cpkv.compose.staging import Staging
from cpkv.config import KINDS, AdmissionCaps, ModelConfig
from cpkv.dist import RankContext
from cpkv.errors import ComposeError
from cpkv.kernels.page_gather.ref import gather_group
from cpkv.kernels.platform import use_triton
from cpkv.kvcache.pool import KVPool
from cpkv.layout import BatchLayout


class ComposeRuntime:
    """Per-rank compose: the batch's plan, the per-layer calls in every mode, the barrier and the use counters
    over the parts that hold the bytes, the launches and the prefetches (module docstring)."""

    def __init__(self, ctx: RankContext, pool: KVPool, mem: PeerMemory, caps: AdmissionCaps,
                 mode: str | None = None) -> None:
        self.ctx, self.pool, self.mem, self.caps = ctx, pool, mem, caps
        self.rank, self.cp, self.device = ctx.rank, ctx.world_size, pool.device
        self.page_size, self.num_layers = pool.page_size, pool.num_layers
        self.page_bytes = pool_page_bytes(pool)
        check_pool(pool, mem, ctx.world_size)
        self.staging = Staging(pool.model, pool.page_size, caps, mem.alloc)
        # what a plan must have been built for (checked on every compose call)
        self.signature = (self.cp, self.page_size, self.staging.capacity, tuple(self.page_bytes.items()))
        self.barrier = make_barrier(mem) if mem.available else None
        mem.exchange()
        self._check_group()
        if isinstance(self.barrier, DeviceBarrier):
            self.barrier.bind()
        self.use_triton = use_triton(self.device)
        self.buffers = ComposeBuffers(pool, self.staging, mem, caps, self.use_triton)
        self.arena = self.buffers.arena
        self.launches = GatherLaunches(self.buffers)
        self.prefetcher = Prefetcher(self.device)
        self.mode: Mode = get_mode(mode or envs.get("CPKV_COMPOSE_MODE"))
        self.uses = {k: 0 for k in KINDS}

    @classmethod
    def create(cls, ctx: RankContext, model: ModelConfig, *, num_pages: int, page_size: int, caps: AdmissionCaps,
               num_layers: int | None = None, mode: str | None = None) -> ComposeRuntime:
        """Collective: probe peer memory, allocate this rank's pool in it, register everything."""
        mem = PeerMemory.create(ctx)
        pool = KVPool(model, num_pages, page_size, ctx.device, alloc=mem.alloc, num_layers=num_layers)
        return cls(ctx, pool, mem, caps, mode)

    def _check_group(self) -> None:
        mine = (self.num_layers, self.pool.num_pages, self.page_size, tuple(self.page_bytes.items()),
                self.staging.capacity)
        everyone = self.ctx.all_gather_object(mine)
        if any(x != mine for x in everyone):
            raise ComposeError(f"ranks registered different pools/staging: expected the same (layers, pages, page "
                               f"size, page bytes, staging pages) on every rank, got {everyone}")

    @property
    def pools(self) -> dict[str, list[torch.Tensor]]:
        """Per kind: every rank's pool (this rank's alone without peer memory)."""
        return self.buffers.pools

    @property
    def prefetch_hits(self) -> int:
        return self.prefetcher.hits

    # plans ----------------------------------------------------------------------------------------

    def plan_batch(self, layout: BatchLayout, current_page_ids: Sequence[int] | None = None,
                   launch_layers: int | None = None) -> ComposePlan:
        """Build this batch's plan (the caller passes it to every compose call of the batch), with the compose
        launches of its first ``launch_layers`` layers built (None: every layer; ``build_launches`` makes the
        others later, off the batch's critical path: ``engine.forward.run_batch`` after its first layer)."""
        if layout.cp != self.cp:
            raise ComposeError(f"the batch was laid out for cp={layout.cp}; this group has {self.cp} ranks")
        if layout.page_size != self.page_size:
            raise ComposeError(f"the batch uses page_size {layout.page_size}; the pools use {self.page_size}")
        self.staging.check(layout.num_current, len(layout.requests))
        plan = ComposePlan(layout, self.rank, self.staging.capacity, self.page_bytes, self.device, current_page_ids)
        if plan.persists and plan.max_own_pool_page >= self.pool.num_pages:
            raise ComposeError(f"rank {self.rank}: current page ids must be < {self.pool.num_pages} (pool pages)")
        self.arena.reserve(plan.arena_bytes)
        for k in KINDS:  # the views every layer uses, made now (none on first use inside the forward)
            for h in (0, 1):
                self.buffers.rows(plan, k, h)
                self.buffers.dense(plan, k, h)
        self.build_launches(plan, layers=launch_layers)
        return plan


    def build_launches(self, plan: ComposePlan, mode: str | None = None, layers: int | None = None) -> None:
        """Build every launch the batch's forward will make under ``symm`` (``GatherLaunches.build``) for the
        layers from the first not yet built (``plan.launch_layers``) up to ``layers`` (None: all), whenever it is
        called (the first call must come before the batch's first compose: it takes the batch's starting use
        counters). Other modes and CPU runs build theirs on first use."""
        stop = self.num_layers if layers is None else min(layers, self.num_layers)
        if not self.use_triton or self._effective(mode).name != "symm" or plan.launch_layers >= stop:
            return
        # the use counters as the first unbuilt layer will find them: the batch's starting ones, or where the
        # last call's simulation left them (whatever the layers have composed since)
        self.launches.build(plan, plan.launch_uses if plan.launch_layers else self.uses, stop)


    def _checked(self, plan: ComposePlan) -> ComposePlan:
        if not isinstance(plan, ComposePlan):
            raise ComposeError(f"expected the batch's ComposePlan (from plan_batch), got {type(plan).__name__}")
        plan.check(self.rank, self.signature)
        return plan

    # the per-layer API ----------------------------------------------------------------------------

    def current_rows(self, plan: ComposePlan, layer: int, kind: str) -> torch.Tensor:
        """uint8 [n_own * P, row_bytes]: where this rank writes its current rows for the next compose of
        ``kind`` (see the module docstring). Tail rows of partial pages come zeroed."""
        plan = self._checked(plan)
        self._check_call(layer, kind)
        rows = self.buffers.rows(plan, kind, self.uses[kind] & 1)
        if plan.tail_rows.numel():
            rows.index_fill_(0, plan.tail_rows, 0)
        return rows

    def compose(self, plan: ComposePlan, layer: int, kind: str, mode: str | None = None) -> torch.Tensor:
        """Dense KV of the batch for (layer, kind): uint8 [num_slots * P, row_bytes], slot-major."""
        plan = self._checked(plan)
        self._check_call(layer, kind)
        m = self._effective(mode)
        half = self.uses[kind] & 1
        if m.name != "prefetch":
            self.prefetcher.settle(kind)
        dense = m.run(self, plan, layer, kind, half)
        self.uses[kind] += 1
        return dense

    def compose_layer(self, plan: ComposePlan, layer: int, mode: str | None = None) -> dict[str, torch.Tensor]:
        """Dense KV of every kind ``layer`` keeps (token and index rows on a full indexer layer, token rows on a
        shared one): ``{kind: compose(plan, layer, kind)}``, with the current rows of those kinds written first.
        Byte-identical to composing kind by kind; under ``symm`` it takes one barrier round for all kinds (half
        the synchronisation), then a gather and a persist launch per kind. Every rank must use the same call
        (``compose_layer`` or per-kind ``compose``) for a layer."""
        plan = self._checked(plan)
        kinds = self.pool.kinds_at(layer) if 0 <= layer < self.num_layers else KINDS
        for k in kinds:
            self._check_call(layer, k)
        m = self._effective(mode)
        if m.run_layer is None:
            return {k: self.compose(plan, layer, k, mode=m.name) for k in kinds}
        halves = {k: self.uses[k] & 1 for k in kinds}
        for k in kinds:
            self.prefetcher.settle(k)
        dense = m.run_layer(self, plan, layer, halves)
        for k in kinds:
            self.uses[k] += 1
        return dense

    def effective_mode(self, mode: str | None = None) -> str:
        """The mode that really runs for ``mode`` (``batch-reduce`` replaces peer modes without peer memory)."""
        return self._effective(mode).name

    def _effective(self, mode: str | None) -> Mode:
        m = self.mode if mode is None else get_mode(mode)
        return get_mode("batch-reduce") if m.needs_peer and not self.mem.available else m

    def _check_call(self, layer: int, kind: str) -> None:
        if kind not in self.page_bytes:
            raise ComposeError(f"unknown KV kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not (0 <= layer < self.num_layers):
            raise ComposeError(f"layer must be in [0, {self.num_layers}), got {layer}")
        self.pool.slot(layer, kind)  # ComposeError for index rows of a shared indexer layer

    # primitives used by the modes -----------------------------------------------------------------

    def dense(self, plan: ComposePlan, kind: str, half: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows uint8 [S * P, row_bytes], pages uint8 [S, page_bytes]) of arena half ``half``
        (``ComposeBuffers.dense``)."""
        return self.buffers.dense(plan, kind, half)

    def gather(self, out: torch.Tensor, table: str, layer: int, kind: str, half: int, e: Entries) -> None:
        """``out[e.dest] = source[e.src][e.page]`` (zeros for -1) through the ``table`` sources: with Triton the
        launch built once per plan (``GatherLaunches``), else the pure-torch gather group by group."""
        if e.n == 0:
            return
        if self.use_triton:
            self.launches.launch(out, table, layer, kind, half, e)()
            return
        groups, zero = e.groups()
        if zero.numel():
            out.index_fill_(0, zero, 0)
        sources = self.buffers.sources(table, layer, kind, half)
        for s, dest, page in groups:
            gather_group(out, sources[s], dest, page)

    def gather_kinds(self, table: str, layer: int, halves: dict[str, int],
                     targets: dict[str, tuple[torch.Tensor, Entries]]) -> None:
        """``gather`` for several kinds (``targets``: kind -> (out, entries)): a launch per kind (one kernel doing
        both kinds ran slower: ``cpkv.kernels.page_gather.triton``)."""
        for k, (out, e) in targets.items():
            self.gather(out, table, layer, k, halves[k], e)

    def all_reduce(self, t: torch.Tensor) -> None:
        if self.cp > 1 and t.numel():
            dist.all_reduce(t, group=self.ctx.group)

    def barrier_round(self) -> None:
        """One counting-barrier round: a kernel on this rank's stream where the GPU barrier runs (no host
        wait; a timeout surfaces at ``check_barrier``), else a host round (on CUDA after draining the
        stream). A group of one rank has nothing to wait for: stream order already covers its own writes."""
        if self.cp == 1:
            return
        if isinstance(self.barrier, DeviceBarrier):
            self.barrier()
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.barrier()

    def check_barrier(self) -> None:
        """Raise ComposeTimeout if a GPU barrier round timed out (reads its status: call once per batch,
        after the batch's synchronisation, never inside a forward pass). Host rounds raise on their own."""
        if isinstance(self.barrier, DeviceBarrier):
            self.barrier.check()

    def persist(self, plan: ComposePlan, layer: int, kind: str, half: int) -> None:
        """Store this rank's current pages (staging half) into its pool pages ``current_page_ids``."""
        if plan.persists and plan.num_own:  # a gather over the local table: one launch on GPU
            self.gather(self.buffers.pool_pages[kind][layer], "local", layer, kind, half, plan.persist_entries)

    def persist_kinds(self, plan: ComposePlan, layer: int, halves: dict[str, int]) -> None:
        """``persist`` for every kind of ``halves`` (kind -> staging half), through ``gather_kinds``."""
        if plan.persists and plan.num_own:
            self.gather_kinds("local", layer, halves,
                              {k: (self.buffers.pool_pages[k][layer], plan.persist_entries) for k in halves})

    def close(self) -> None:
        self.mem.close()
