"""GatherLaunches: compose's Triton gather launches, built once per plan and replayed per layer (docs/design.md §4).

A launch is kept on the ``Entries`` it gathers (``Entries.launchers``), keyed by (table, layer, kind, half,
output address, output width). The first launch of a family (same entries, table and kind) is built in full
(``gather_launcher``) and kept as the family's template; the others (other layers, halves, outputs) re-point
the template's output and source table (``relaunch_with``: a few µs instead of a full build). ``build`` makes
every launch a batch's ``symm`` forward will run ahead of time, so no layer builds host state on first use.
"""
from __future__ import annotations

from typing import Callable

import torch

from cpkv.compose.buffers import ComposeBuffers
from cpkv.compose.plan import ComposePlan, Entries
from cpkv.kernels.page_gather.triton import gather_launcher, relaunch_with


class GatherLaunches:
    """The launch cache of one rank's gathers over ``buffers``' source tables (module docstring)."""

    def __init__(self, buffers: ComposeBuffers) -> None:
        self.buffers = buffers

    def launch(self, out: torch.Tensor, table: str, layer: int, kind: str, half: int,
               e: Entries) -> Callable[[], None]:
        """The launch of ``out[e.dest] = source[e.src][e.page]`` through the ``table`` sources of (layer, kind,
        half) (``e`` not empty), built on first use and kept on the entries."""
        key = (table, layer, kind, half, out.data_ptr(), out.shape[-1])
        launch = e.launchers.get(key)
        if launch is not None:
            return launch
        family, bases = ("one", table, kind), self.buffers.bases[table][kind][layer][half]
        template = e.launchers.get(family)
        launch = relaunch_with(template, out, bases) if template is not None else None
        if launch is None:
            launch = gather_launcher(out, bases, e.dest, e.src, e.page, aligned16=self.buffers.aligned16[kind])
            e.launchers.setdefault(family, launch)
        e.launchers[key] = launch
        return launch

    def build(self, plan: ComposePlan, uses: dict[str, int], stop: int) -> None:
        """Build the launches of ``symm``'s ``compose_layer`` for layers [plan.launch_layers, stop): a gather and
        a persist per kind and layer, with the staging halves the use counters will pick (``uses``: the counters
        as the first of those layers will find them), and the dense views; record how far the plan got."""
        uses = dict(uses)
        pool_pages = self.buffers.pool_pages
        for n in range(plan.launch_layers, stop):
            kinds = self.buffers.pool.kinds_at(n)
            halves = {k: uses[k] & 1 for k in kinds}
            self._build_layer("global", n, halves, {k: (self.buffers.dense(plan, k, h)[1], plan.all)
                                                    for k, h in halves.items()})
            if plan.persists and plan.num_own:
                self._build_layer("local", n, halves, {k: (pool_pages[k][n], plan.persist_entries) for k in halves})
            for k in kinds:
                uses[k] += 1
        plan.launch_layers, plan.launch_uses = stop, uses

    def _build_layer(self, table: str, layer: int, halves: dict[str, int],
                     targets: dict[str, tuple[torch.Tensor, Entries]]) -> None:
        """Make the launches of ``ComposeRuntime.gather_kinds(table, layer, halves, targets)`` without running
        them."""
        for k, (out, e) in targets.items():
            if e.n:
                self.launch(out, table, layer, k, halves[k], e)
