"""ComposeBuffers: where one rank's compose bytes live (docs/design.md §4), and how a gather reaches them.

    pool      uint8 [layers of kind, N, PB] per kind       this rank's KV pages (``cpkv.kvcache.pool.KVPool``)
    staging   uint8 [2, 1 + C, PB] per kind                this rank's current pages, two parity halves
    arena     uint8 [2, H]                                 dense buffers and scratch, two parity halves

Source tables. A gather reads page ``page`` of source ``src`` of a table (``cpkv.compose.plan.Entries``):

    global    sources [0, cp): every rank's pool slot of the layer; [cp, 2 cp): every rank's staging half
              (peer memory; absent without it)
    local     source 0: this rank's pool slot of the layer; source 1: this rank's staging half

With Triton the sources are int64 base addresses, ``bases[table][kind][layer][half]``: int64 [n_src] device
views made once (the pools, stagings and arena never move, so the views serve every batch); without it
``sources`` gives the tensors.
"""
from __future__ import annotations

from typing import Sequence

import torch

from cpkv.compose.peer import PeerMemory
from cpkv.compose.plan import ComposePlan
from cpkv.compose.staging import DenseArena, Staging, caps_arena_bytes
from cpkv.config import KINDS, AdmissionCaps
from cpkv.errors import ComposeError
from cpkv.kvcache.pool import KVPool


def pool_page_bytes(pool: KVPool) -> dict[str, int]:
    """Per kind: bytes of one page of ``pool`` (page_size * row_bytes)."""
    return {k: pool.page_size * pool.row_bytes(k) for k in KINDS}


def check_pool(pool: KVPool, mem: PeerMemory, world_size: int) -> None:
    """ComposeError unless ``pool`` is uint8 pages of its model's rows, in ``mem`` where peer memory is on, and
    ``mem`` spans the group."""
    page_bytes = pool_page_bytes(pool)
    for k in KINDS:
        buf = pool.buffers[k]
        want = (len(pool.slots[k]), pool.num_pages, page_bytes[k])
        if buf.dtype != torch.uint8 or tuple(buf.shape) != want:
            raise ComposeError(f"pool {k!r} buffer must be uint8 {list(want)} (layers of kind, pages, page_size * "
                               f"row_bytes {pool.row_bytes(k)}), got {buf.dtype} {list(buf.shape)}")
    if mem.available and not all(mem.has(f"pool.{k}") for k in KINDS):
        raise ComposeError("the pool was not allocated through PeerMemory.alloc (pass alloc=mem.alloc to KVPool)")
    if mem.ctx.world_size != world_size:
        raise ComposeError(f"peer memory spans {mem.ctx.world_size} ranks, the group has {world_size}")


class ComposeBuffers:
    """This rank's pool, staging and dense arena, every rank's pools and stagings as peer memory maps them, the
    source tables over them, and the per-plan views of the arena and staging (module docstring). Build after
    ``mem.exchange()``."""

    def __init__(self, pool: KVPool, staging: Staging, mem: PeerMemory, caps: AdmissionCaps,
                 use_triton: bool) -> None:
        self.pool, self.staging, self.mem = pool, staging, mem
        self.device, self.page_size, self.num_layers = pool.device, pool.page_size, pool.num_layers
        self.page_bytes = pool_page_bytes(pool)
        self.arena = DenseArena(caps_arena_bytes(self.page_bytes, self.page_size, caps), self.device)
        self.arena.register()
        self.build_tables(use_triton)
        # per kind, per layer: the pool's page view (None where the layer keeps no rows of the kind); the pool
        # never moves, so the views serve every batch (no per-layer view op)
        self.pool_pages = {k: [pool.pages(n, k) if n in pool.slots[k] else None for n in range(self.num_layers)]
                           for k in KINDS}

    # source tables --------------------------------------------------------------------------------

    def build_tables(self, use_triton: bool) -> None:
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
        if not use_triton:
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

    def sources(self, table: str, layer: int, kind: str, half: int) -> list[torch.Tensor]:
        """The ``table``'s sources of (layer, kind, staging half) as tensors [pages, PB] (the pure-torch gather)."""
        slot = self.pool.slot(layer, kind)
        if table == "local":
            return [self.pool.buffers[kind][slot], self.staging.buffers[kind][half]]
        return [p[slot] for p in self.pools[kind]] + [s[half] for s in self.stagings[kind]]

    # per-plan views -------------------------------------------------------------------------------

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
        """uint8 [num_current, page_bytes] scratch for ``prefix-gather``'s compact current pages."""
        return self.arena.view(half, plan.compact_offset[kind], plan.num_current, self.page_bytes[kind])

    def rows(self, plan: ComposePlan, kind: str, half: int) -> torch.Tensor:
        """uint8 [n_own * P, row_bytes]: this rank's current-row block of staging half ``half`` (kept on the plan:
        the staging never moves)."""
        rows = plan.views.get(("rows", kind, half))
        if rows is None:
            block = self.staging.buffers[kind][half][1: 1 + plan.num_own]
            rows = plan.views[("rows", kind, half)] = block.view(plan.num_own * self.page_size,
                                                                 self.pool.row_bytes(kind))
        return rows
