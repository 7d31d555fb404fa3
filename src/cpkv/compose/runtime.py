"""ComposeRuntime: one per rank; every layer it gives this rank the batch's dense KV (docs/design.md, compose).

Setup (collective, once)::

    rt = ComposeRuntime.create(ctx, model, num_pages=N, page_size=P, caps=caps, num_layers=L)
    # or: mem = PeerMemory.create(ctx); pool = KVPool(..., alloc=mem.alloc); rt = ComposeRuntime(ctx, pool, mem, caps)

Per batch and per (layer, kind), every rank, in the same order::

    plan = rt.prepare(layout, current_page_ids)        # once per batch; passed to every call below
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

Wrong batches, pools of another shape, unknown modes or a layout whose cp differs from the group
raise ComposeError; too many current pages raise StagingOverflow on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from cpkv import envs
from cpkv.compose.barrier import DeviceBarrier, make_barrier
from cpkv.compose.modes import Mode, get_mode
from cpkv.compose.peer import PeerMemory
from cpkv.compose.plan import ComposePlan, Entries
from cpkv.compose.staging import DenseArena, Staging, caps_arena_bytes
from cpkv.config import KINDS, AdmissionCaps, ModelConfig
from cpkv.dist import RankContext
from cpkv.errors import ComposeError
from cpkv.kernels.page_gather.ref import gather_group
from cpkv.kernels.page_gather.triton import gather_launcher, relaunch_with
from cpkv.kernels.platform import use_triton
from cpkv.kvcache.pool import KVPool
from cpkv.layout import BatchLayout


@dataclass
class _Pending:
    plan: ComposePlan
    layer: int
    half: int
    event: torch.cuda.Event | None


class ComposeRuntime:
    """Per-rank compose state: pools and staging registered in peer memory, barrier, arena, tables."""

    def __init__(self, ctx: RankContext, pool: KVPool, mem: PeerMemory, caps: AdmissionCaps,
                 mode: str | None = None) -> None:
        self.ctx, self.pool, self.mem, self.caps = ctx, pool, mem, caps
        self.rank, self.cp, self.device = ctx.rank, ctx.world_size, pool.device
        self.page_size, self.num_layers = pool.page_size, pool.num_layers
        self.page_bytes = {k: pool.page_size * pool.row_bytes(k) for k in KINDS}
        self._check_pool()
        self.staging = Staging(pool.model, pool.page_size, caps, mem.alloc)
        # what a plan must have been built for (checked on every compose call)
        self.signature = (self.cp, self.page_size, self.staging.capacity, tuple(self.page_bytes.items()))
        self.barrier = make_barrier(mem) if mem.available else None
        mem.exchange()
        self._check_group()
        if isinstance(self.barrier, DeviceBarrier):
            self.barrier.prepare()
        self.arena = DenseArena(caps_arena_bytes(self.page_bytes, self.page_size, caps), self.device)
        self.arena.register()
        self.use_triton = use_triton(self.device)
        self._tables()
        # per kind, per layer: the pool's page view (None where the layer keeps no rows of the kind); the pool
        # never moves, so the views serve every batch (no per-layer view op)
        self._pool_pages = {k: [pool.pages(n, k) if n in pool.slots[k] else None for n in range(self.num_layers)]
                            for k in KINDS}
        self.mode: Mode = get_mode(mode or envs.get("CPKV_COMPOSE_MODE"))
        self.uses = {k: 0 for k in KINDS}
        self._pending: dict[str, _Pending | None] = {k: None for k in KINDS}
        self.prefetch_hits = 0
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def create(cls, ctx: RankContext, model: ModelConfig, *, num_pages: int, page_size: int, caps: AdmissionCaps,
               num_layers: int | None = None, mode: str | None = None) -> ComposeRuntime:
        """Collective: probe peer memory, allocate this rank's pool in it, register everything."""
        mem = PeerMemory.create(ctx)
        pool = KVPool(model, num_pages, page_size, ctx.device, alloc=mem.alloc, num_layers=num_layers)
        return cls(ctx, pool, mem, caps, mode)

    @property
    def peer_available(self) -> bool:
        return self.mem.available

    # registration checks --------------------------------------------------------------------------

    def _check_pool(self) -> None:
        for k in KINDS:
            buf = self.pool.buffers[k]
            want = (len(self.pool.slots[k]), self.pool.num_pages, self.page_bytes[k])
            if buf.dtype != torch.uint8 or tuple(buf.shape) != want:
                raise ComposeError(f"pool {k!r} buffer must be uint8 {list(want)} (layers of kind, pages, page_size * "
                                   f"row_bytes {self.pool.row_bytes(k)}), got {buf.dtype} {list(buf.shape)}")
        if self.mem.available and not all(self.mem.has(f"pool.{k}") for k in KINDS):
            raise ComposeError("the pool was not allocated through PeerMemory.alloc (pass alloc=mem.alloc to KVPool)")
        if self.mem.ctx.world_size != self.ctx.world_size:
            raise ComposeError(f"peer memory spans {self.mem.ctx.world_size} ranks, the group has {self.ctx.world_size}")

    def _check_group(self) -> None:
        mine = (self.num_layers, self.pool.num_pages, self.page_size, tuple(self.page_bytes.items()),
                self.staging.capacity)
        everyone = self.ctx.all_gather_object(mine)
        if any(x != mine for x in everyone):
            raise ComposeError(f"ranks registered different pools/staging: expected the same (layers, pages, page "
                               f"size, page bytes, staging pages) on every rank, got {everyone}")

    # source tables --------------------------------------------------------------------------------

    def _tables(self) -> None:
        """Per kind: peers' pools [L, N, PB] and stagings [2, 1 + C, PB]; for Triton, int64 base addresses
        ``bases[table][kind]``: [layers, 2 halves, n_src] (global: cp pools + cp stagings; local: own pool,
        own staging)."""
        self.pools = {k: [self.pool.buffers[k]] for k in KINDS}
        self.stagings = {k: [self.staging.buffers[k]] for k in KINDS}
        if self.mem.available:
            self.pools = {k: self.mem.peers(f"pool.{k}") for k in KINDS}
            self.stagings = {k: self.mem.peers(f"staging.{k}") for k in KINDS}
        self.bases: dict[str, dict[str, list[list[torch.Tensor]]]] = {"global": {}, "local": {}}
        self.aligned16: dict[str, bool] = {}
        if not self.use_triton:
            return
        for k in KINDS:
            glob = self._base_rows(k, self.pools[k], self.stagings[k]) if self.mem.available else None
            loc = self._base_rows(k, [self.pool.buffers[k]], [self.staging.buffers[k]])
            addrs = [a for rows in (glob or []) + loc for a in rows]
            self.aligned16[k] = self.page_bytes[k] % 16 == 0 and all(a % 16 == 0 for a in addrs)
            if glob is not None:
                self.bases["global"][k] = self._base_views(k, glob)
            self.bases["local"][k] = self._base_views(k, loc)

    def _base_views(self, kind: str, rows: list[list[int]]) -> list[list[torch.Tensor] | None]:
        """[layer][half] -> int64 [n_src] device view (looked up per call with no torch op); None for a layer
        that keeps no rows of ``kind``."""
        t = torch.tensor(rows, dtype=torch.int64, device=self.device).view(len(self.pool.slots[kind]), 2, -1)
        slots = self.pool.slots[kind]
        return [[t[slots[layer], h] for h in (0, 1)] if layer in slots else None for layer in range(self.num_layers)]

    def _base_rows(self, kind: str, pools: Sequence[torch.Tensor], stagings: Sequence[torch.Tensor]) -> list[list[int]]:
        rows = []
        for slot in range(len(self.pool.slots[kind])):
            for half in (0, 1):
                rows.append([p[slot].data_ptr() for p in pools] + [s[half].data_ptr() for s in stagings])
        return rows

    def _sources(self, table: str, layer: int, kind: str, half: int) -> list[torch.Tensor]:
        slot = self.pool.slot(layer, kind)
        if table == "local":
            return [self.pool.buffers[kind][slot], self.staging.buffers[kind][half]]
        return [p[slot] for p in self.pools[kind]] + [s[half] for s in self.stagings[kind]]

    # plans ----------------------------------------------------------------------------------------

    def prepare(self, layout: BatchLayout, current_page_ids: Sequence[int] | None = None,
                launch_layers: int | None = None) -> ComposePlan:
        """Build this batch's plan (the caller passes it to every compose call of the batch), with the prepared
        compose launches of its first ``launch_layers`` layers (None: every layer; ``prepare_launches`` makes
        the others later, off the batch's critical path: ``engine.forward.run_batch`` after its first layer)."""
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
                self._rows_view(plan, k, h)
                self.dense(plan, k, h)
        self.prepare_launches(plan, layers=launch_layers)
        return plan

    def _checked(self, plan: ComposePlan) -> ComposePlan:
        if not isinstance(plan, ComposePlan):
            raise ComposeError(f"expected the batch's ComposePlan (from prepare), got {type(plan).__name__}")
        plan.check(self.rank, self.signature)
        return plan

    # the per-layer API ----------------------------------------------------------------------------

    def current_rows(self, plan: ComposePlan, layer: int, kind: str) -> torch.Tensor:
        """uint8 [n_own * P, row_bytes]: where this rank writes its current rows for the next compose of
        ``kind`` (see the module docstring). Tail rows of partial pages come zeroed."""
        plan = self._checked(plan)
        self._check_call(layer, kind)
        half = self.uses[kind] & 1
        rows = plan.views.get(("rows", kind, half))
        if rows is None:
            rows = self._rows_view(plan, kind, half)
        if plan.tail_rows.numel():
            rows.index_fill_(0, plan.tail_rows, 0)
        return rows

    def _rows_view(self, plan: ComposePlan, kind: str, half: int) -> torch.Tensor:
        """This rank's current-row block of staging half ``half`` (kept on the plan: the staging never moves)."""
        block = self.staging.buffers[kind][half][1: 1 + plan.num_own]
        rows = plan.views[("rows", kind, half)] = block.view(plan.num_own * self.page_size, self.pool.row_bytes(kind))
        return rows

    def compose(self, plan: ComposePlan, layer: int, kind: str, mode: str | None = None) -> torch.Tensor:
        """Dense KV of the batch for (layer, kind): uint8 [num_slots * P, row_bytes], slot-major."""
        plan = self._checked(plan)
        self._check_call(layer, kind)
        m = self._effective(mode)
        half = self.uses[kind] & 1
        if m.name != "prefetch" and self._pending[kind] is not None:
            self.settle_prefetch(kind)
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
            if self._pending[k] is not None:
                self.settle_prefetch(k)
        dense = m.run_layer(self, plan, layer, halves)
        for k in kinds:
            self.uses[k] += 1
        return dense

    def effective_mode(self, mode: str | None = None) -> str:
        """The mode that really runs for ``mode`` (``fused`` replaces peer modes without peer memory)."""
        return self._effective(mode).name

    def _effective(self, mode: str | None) -> Mode:
        m = self.mode if mode is None else get_mode(mode)
        return get_mode("fused") if m.needs_peer and not self.mem.available else m

    def _check_call(self, layer: int, kind: str) -> None:
        if kind not in self.page_bytes:
            raise ComposeError(f"unknown KV kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not (0 <= layer < self.num_layers):
            raise ComposeError(f"layer must be in [0, {self.num_layers}), got {layer}")
        self.pool.slot(layer, kind)  # ComposeError for index rows of a shared indexer layer

    # primitives used by the modes -----------------------------------------------------------------

    def dense(self, plan: ComposePlan, kind: str, half: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows uint8 [S * P, row_bytes], pages uint8 [S, page_bytes]) of the arena half ``half`` (views
        cached on the plan: the registered arena never moves)."""
        key = (kind, half)
        views = plan.views.get(key)
        if views is None:
            pb = self.page_bytes[kind]
            pages = self.arena.view(half, plan.dense_offset[kind], plan.num_slots, pb)
            views = plan.views[key] = (pages.view(plan.num_slots * self.page_size, pb // self.page_size), pages)
        return views

    def compact(self, plan: ComposePlan, kind: str, half: int) -> torch.Tensor:
        """uint8 [num_current, page_bytes] scratch for v2's compact current pages."""
        return self.arena.view(half, plan.compact_offset[kind], plan.num_current, self.page_bytes[kind])

    def gather(self, out: torch.Tensor, table: str, layer: int, kind: str, half: int, e: Entries) -> None:
        """``out[e.dest] = source[e.src][e.page]`` (zeros for -1) through the ``table`` sources."""
        if e.n == 0:
            return
        if self.use_triton:  # launches prepared once per (entries, target) and kept on the plan's entries
            self._prepared(out, table, layer, kind, half, e)()
            return
        groups, zero = e.groups()
        if zero.numel():
            out.index_fill_(0, zero, 0)
        sources = self._sources(table, layer, kind, half)
        for s, dest, page in groups:
            gather_group(out, sources[s], dest, page)

    def gather_kinds(self, table: str, layer: int, halves: dict[str, int],
                     targets: dict[str, tuple[torch.Tensor, Entries]]) -> None:
        """``gather`` for several kinds (``targets``: kind -> (out, entries)): a launch per kind (one kernel doing
        both kinds ran slower: ``cpkv.kernels.page_gather.triton``)."""
        for k, (out, e) in targets.items():
            self.gather(out, table, layer, k, halves[k], e)

    def _prepared(self, out: torch.Tensor, table: str, layer: int, kind: str, half: int, e: Entries):
        """The prepared launch of ``gather(out, table, layer, kind, half, e)`` (``e`` not empty), built on first
        use and kept on the entries. The first of a family (same entries, table and kind) on the plan is built in
        full and kept as its template; the others (other layers, halves, outputs) re-point the template's output
        and source table (``relaunch_with``: a few µs instead of a full build)."""
        key = (table, layer, kind, half, out.data_ptr(), out.shape[-1])
        launch = e.launchers.get(key)
        if launch is not None:
            return launch
        family, bases = ("one", table, kind), self.bases[table][kind][layer][half]
        template = e.launchers.get(family)
        launch = relaunch_with(template, out, bases) if template is not None else None
        if launch is None:
            launch = gather_launcher(out, bases, e.dest, e.src, e.page, aligned16=self.aligned16[kind])
            e.launchers.setdefault(family, launch)
        e.launchers[key] = launch
        return launch

    def prepare_launches(self, plan: ComposePlan, mode: str | None = None, layers: int | None = None) -> None:
        """Build every launch the batch's forward will make under ``symm`` (``compose_layer`` of each layer in
        order: a gather and a persist per kind and layer, with the staging halves the use counters will
        pick), and the dense views, so no layer builds host state on first use: the layers from the first not
        yet prepared (``plan.launch_layers``) up to ``layers`` (None: all), whenever it is called (the first call
        must come before the batch's first compose: it takes the batch's starting use counters). Other modes and
        CPU runs build theirs on first use."""
        stop = self.num_layers if layers is None else min(layers, self.num_layers)
        if not self.use_triton or self._effective(mode).name != "symm" or plan.launch_layers >= stop:
            return
        # the use counters as the first unprepared layer will find them: the batch's starting ones, or where the
        # last call's simulation left them (whatever the layers have composed since)
        uses = dict(plan.launch_uses if plan.launch_layers else self.uses)
        for n in range(plan.launch_layers, stop):
            kinds = self.pool.kinds_at(n)
            halves = {k: uses[k] & 1 for k in kinds}
            targets = {k: (self.dense(plan, k, h)[1], plan.all) for k, h in halves.items()}
            self._prebuild("global", n, halves, targets)
            if plan.persists and plan.num_own:
                self._prebuild("local", n, halves,
                               {k: (self._pool_pages[k][n], plan.persist_entries) for k in halves})
            for k in kinds:
                uses[k] += 1
        plan.launch_layers, plan.launch_uses = stop, uses

    def _prebuild(self, table: str, layer: int, halves: dict[str, int],
                  targets: dict[str, tuple[torch.Tensor, Entries]]) -> None:
        """Make ``gather_kinds(table, layer, halves, targets)``'s launches without running them."""
        for k, (out, e) in targets.items():
            if e.n:
                self._prepared(out, table, layer, k, halves[k], e)

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
        if plan.persists and plan.num_own:  # a gather over the local table: one prepared launch on GPU
            self.gather(self._pool_pages[kind][layer], "local", layer, kind, half, plan.persist_entries)

    def persist_kinds(self, plan: ComposePlan, layer: int, halves: dict[str, int]) -> None:
        """``persist`` for every kind of ``halves`` (kind -> staging half), through ``gather_kinds``."""
        if plan.persists and plan.num_own:
            self.gather_kinds("local", layer, halves,
                              {k: (self._pool_pages[k][layer], plan.persist_entries) for k in halves})

    def take_prefetch(self, plan: ComposePlan, layer: int, kind: str, half: int) -> bool:
        """True (and the prefetched pages are ready) when a prefetch of exactly this use is pending."""
        p = self.settle_prefetch(kind)
        if p is None or p.plan is not plan or p.layer != layer or p.half != half:
            return False
        self.prefetch_hits += 1
        return True

    def settle_prefetch(self, kind: str) -> _Pending | None:
        """Order the current stream after a pending prefetch of ``kind`` (hit or stale: it writes the arena)."""
        p, self._pending[kind] = self._pending[kind], None
        if p is not None and p.event is not None:
            torch.cuda.current_stream(self.device).wait_event(p.event)
        return p

    def issue_prefetch(self, plan: ComposePlan, layer: int, kind: str, half: int) -> None:
        """Gather ``layer``'s prefix pages into arena half ``half`` ahead of time (side stream on GPU)."""
        _, pages = self.dense(plan, kind, half)
        event = None
        if self.side_stream is not None:
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side_stream):
                self.gather(pages, "global", layer, kind, half, plan.prefix)
                event = torch.cuda.Event()
                event.record(self.side_stream)
        else:
            self.gather(pages, "global", layer, kind, half, plan.prefix)
        self._pending[kind] = _Pending(plan, layer, half, event)

    def close(self) -> None:
        self.mem.close()
