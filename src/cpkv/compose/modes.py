"""Compose modes (docs/design.md §4), chosen by name. Every mode gives byte-identical dense buffers.

    span-reduce    per request span: own pages (others zero) + sum all-reduce of the span    bs collectives
    batch-reduce   own pages (others zero) + one whole-buffer sum all-reduce                 one collective
    prefix-gather  peer gather of every prefix page (current slots zero), sum all-reduce of the
                   compact current pages, then those pages into their slots                one small collective
    symm           counting barrier, then one gather of prefix pages (pools) and current pages
                   (stagings) through a 2·cp source table                                     none
    prefetch       (bs = 1) the next layer's prefix pages are gathered ahead (side stream on GPU);
                   consuming adds the current pages after the barrier; one barrier round per
                   (layer, kind) whether the prefetch hit or missed                          none

A sum all-reduce over bytes is exact: every byte has one producer and the others contribute zeros.
Modes that need peer memory fall back to ``batch-reduce`` when the group agreed it is unavailable.
Every mode stores the rank's current pages into its pool pages when the plan has ``current_page_ids``.
The earlier spellings ``legacy``, ``fused`` and ``v2`` name the first three (``config.COMPOSE_MODE_ALIASES``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from cpkv.config import COMPOSE_MODES, compose_mode
from cpkv.errors import ComposeError

# A mode is written against the runtime's primitives (dense, gather, all_reduce, barrier_round, persist, and the
# prefetcher for ``prefetch``);
# the runtime imports this table, so the mode functions take it untyped (no import back: no cycle).
RunFn = Callable[[Any, Any, int, str, int], torch.Tensor]   # (runtime, plan, layer, kind, half)
LayerFn = Callable[[Any, Any, int, dict], dict]                          # (runtime, plan, layer, {kind: half})


@dataclass(frozen=True)
class Mode:
    """A compose mode: ``run(rt, plan, layer, kind, half) -> dense uint8 [slots * P, row_bytes]``;
    ``run_layer(rt, plan, layer, {kind: half}) -> {kind: dense}``, where set, composes every kind of a layer
    at once (``ComposeRuntime.compose_layer``; otherwise that runs ``run`` per kind)."""

    name: str
    needs_peer: bool
    run: RunFn
    help: str
    run_layer: LayerFn | None = None


def _span_reduce(rt, plan, layer, kind, half):
    dense, pages = rt.dense(plan, kind, half)
    for span in plan.spans:
        rt.gather(pages, "local", layer, kind, half, span.own)
        rt.all_reduce(pages[span.start: span.end])
    rt.persist(plan, layer, kind, half)
    return dense


def _batch_reduce(rt, plan, layer, kind, half):
    dense, pages = rt.dense(plan, kind, half)
    rt.gather(pages, "local", layer, kind, half, plan.own)
    rt.all_reduce(pages)
    rt.persist(plan, layer, kind, half)
    return dense


def _prefix_gather(rt, plan, layer, kind, half):
    dense, pages = rt.dense(plan, kind, half)
    rt.gather(pages, "global", layer, kind, half, plan.prefix)
    if plan.num_current:
        compact = rt.buffers.compact(plan, kind, half)
        rt.gather(compact, "local", layer, kind, half, plan.compact)
        rt.all_reduce(compact)
        pages.index_copy_(0, plan.current_slots_t, compact)
    rt.persist(plan, layer, kind, half)
    return dense


def _symm(rt, plan, layer, kind, half):
    dense, pages = rt.dense(plan, kind, half)
    rt.barrier_round()
    rt.gather(pages, "global", layer, kind, half, plan.all)
    rt.persist(plan, layer, kind, half)
    return dense


def _symm_layer(rt, plan, layer, halves):
    """symm for every kind of a layer: one barrier round and one gather call for all kinds (a launch per kind)."""
    views = {k: rt.dense(plan, k, h) for k, h in halves.items()}
    rt.barrier_round()
    rt.gather_kinds("global", layer, halves, {k: (v[1], plan.all) for k, v in views.items()})
    rt.persist_kinds(plan, layer, halves)  # both kinds' current pages into the pool: one more launch
    return {k: v[0] for k, v in views.items()}


def _prefetch(rt, plan, layer, kind, half):
    if plan.num_requests != 1:
        raise ComposeError(f"compose mode 'prefetch' takes batches of one request; this batch has "
                           f"{plan.num_requests} (use 'symm')")
    dense, pages = rt.dense(plan, kind, half)
    if not rt.prefetcher.take(plan, layer, kind, half):
        rt.gather(pages, "global", layer, kind, half, plan.prefix)
    rt.barrier_round()  # exactly one round per (layer, kind), hit or miss
    rt.gather(pages, "global", layer, kind, half, plan.current)
    rt.persist(plan, layer, kind, half)
    nxt = rt.pool.next_layer[kind][layer]  # for index rows: the next full indexer layer
    if nxt is not None:  # its prefix pages into the other arena half, ahead of time
        ahead = rt.dense(plan, kind, half ^ 1)[1]
        with rt.prefetcher.ahead(plan, nxt, kind, half ^ 1):
            rt.gather(ahead, "global", nxt, kind, half ^ 1, plan.prefix)
    return dense


# name -> (needs peer memory, run, run_layer); the names and their one-line help come from cpkv.config
_RUN = {"span-reduce": (False, _span_reduce, None), "batch-reduce": (False, _batch_reduce, None),
        "prefix-gather": (True, _prefix_gather, None), "symm": (True, _symm, _symm_layer),
        "prefetch": (True, _prefetch, None)}
assert tuple(_RUN) == tuple(COMPOSE_MODES), "every mode of cpkv.config.COMPOSE_MODES runs here, in that order"
MODES: dict[str, Mode] = {name: Mode(name, peer, run, COMPOSE_MODES[name], layer)
                          for name, (peer, run, layer) in _RUN.items()}


def get_mode(name: str) -> Mode:
    """The mode called ``name`` (or an earlier spelling of it); ComposeError listing the supported names otherwise."""
    try:
        return MODES[compose_mode(name)]
    except (KeyError, TypeError):
        raise ComposeError(f"unknown compose mode {name!r}; supported: {', '.join(MODES)}") from None


def parse_modes(spec: str) -> list[str]:
    """``"all"`` or a comma-separated list of mode names -> names (validated; earlier spellings become the names)."""
    if spec.strip() == "all":
        return list(MODES)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    names = [get_mode(n).name for n in names]
    if not names:
        raise ComposeError(f"no compose mode given; supported: {', '.join(MODES)} or all")
    return names
