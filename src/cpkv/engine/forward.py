"""One rank's forward over a CP batch: its own query tokens through every layer, composing per layer.

    BatchSpec (same on every rank): layout, each request's sequence tokens, the pool page id of every
    current page on its writer.
    RankPlan (built once per batch by ``rank_plan`` from host data, passed in): the rank's token ids and
    positions, its query-token runs (whence the dense-buffer key ranges [ks, ke): a request's keys are
    contiguous from ``slot_start * page_size`` because prefixes are page-aligned), and where each request's
    last token sits when this rank holds it. Its device tensors are written straight into the pinned staging
    buffer and uploaded asynchronously in one copy, so neither the plan nor the forward pass waits on the
    device (``cpkv.upload``). The GPU starts on the batch (its embedding) right after that copy; the rotary
    tables are built behind the embedding, the compose plan (``run_batch``'s ``compose_plan``) after the first
    layer's projections, and the attention part (key ranges, the indexer's chunks and work items: most of the
    plan's host time) by ``RankPlan.complete`` after the first layer's compose is launched.

Per layer: project -> write own token/index rows (staging) -> compose both kinds -> attend (indexer top-k,
sparse MLA, MLP; a MoE layer under expert parallelism dispatches to and combines from the experts' ranks).
A rank with no query tokens still takes part in every compose and every expert exchange.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from cpkv.layout import BatchLayout
from cpkv.model.layer import AttnPlan
from cpkv.model.model import DSAModel
from cpkv.model.ops import Rotary
from cpkv.timeline import mark
from cpkv.upload import stage

if TYPE_CHECKING:
    from cpkv.compose.plan import ComposePlan
    from cpkv.compose.runtime import ComposeRuntime
    from cpkv.engine.graphs import LayerGraphs


@dataclass(frozen=True)
class BatchSpec:
    """A batch as every rank sees it. ``tokens[r]``: request r's tokens [0, seq_len) (int sequences: the engine
    passes int64 arrays);
    ``page_ids[c]``: the pool page (on its writer) of compact current page c."""

    layout: BatchLayout
    tokens: tuple[Sequence[int], ...]
    page_ids: tuple[int, ...]


@dataclass
class RankPlan:
    ids: torch.Tensor
    positions: torch.Tensor      # int64 [T] on the device: each token's position in its request
    last: list[tuple[int, int]]  # (request index, row in this rank's tokens)
    last_rows: torch.Tensor      # int64 [len(last)] on the device: those rows
    ep: Any = None               # the batch's expert-parallel exchange (cpkv.compose.dispatch.EPBatch), or None
    runs: tuple[tuple[int, int, int], ...] = ()  # per query-token run (start, end, first dense key row)
    topk: int = 0
    attn: AttnPlan | None = None
    rot: Rotary | None = None    # built by ``rotary`` (after the embedding is launched)
    reqs: tuple[int, ...] = ()   # per query-token run: its request's index in the batch

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def rotary(self, model: DSAModel) -> Rotary:
        """The batch's rotary tables (built once)."""
        if self.rot is None:
            self.rot = model.rotary(self.positions)
        return self.rot

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Host int64 [T] ks, ke: each query token's dense key range [ks, ke) (its request's keys up to itself)."""
        n = sum(e - s for s, e, _ in self.runs)
        ks, ke = np.empty(n, np.int64), np.empty(n, np.int64)
        at = 0
        for s, e, base in self.runs:
            ks[at: at + e - s] = base
            np.add(_arange(e - s), base + s + 1, out=ke[at: at + e - s])
            at += e - s
        return ks, ke

    def complete(self, model: DSAModel, chunks: int | None = 1) -> AttnPlan:
        """The attention plan from the host bounds (built once), with the indexer's work items of its first
        ``chunks`` logits chunks (None: all; the first full layer builds the others as it reaches them, behind
        the GPU's work on the chunks before: ``IndexerPlan.prepare_items``). A plan built ahead, while the GPU
        runs the batch before, takes them all."""
        if self.attn is None:
            self.attn = AttnPlan.build(*self.bounds(), self.topk, model.device)
            mark("attention bounds")
        self.attn.indexer.prepare_items(_logits_work_shape(model), self.topk, chunks=chunks)
        return self.attn


_ARANGE = [np.arange(0, dtype=np.int64)]


def _arange(n: int) -> np.ndarray:
    """np.arange(n) int64 as a view of one kept array (grown as needed): no fresh memory per batch."""
    if _ARANGE[0].size < n:
        _ARANGE[0] = np.arange(max(n, 2 * _ARANGE[0].size), dtype=np.int64)
    return _ARANGE[0][:n]


def rank_plan(spec: BatchSpec, rank: int, model: DSAModel, ep: Any = None) -> RankPlan:
    """Rank ``rank``'s RankPlan for ``spec``, built once per batch (every layer reuses it): token ids, positions
    and last-token rows written per query-token run (numpy, no per-token Python) straight into the staging
    buffer and uploaded in one copy; the GPU can start on the embedding right after it. The rotary tables
    (``RankPlan.rotary``) and the attention plan (``RankPlan.complete``) come later. ``ep``: the rank's
    ExpertExchange (expert parallelism), prepared here with every rank's query-token count."""
    lay, P = spec.layout, spec.layout.page_size
    runs: list[tuple[int, int, int, int]] = []
    last: list[tuple[int, int]] = []
    n = 0
    for req, s, e in lay.rank_query_ranges[rank]:
        r = lay.requests[req]
        assert r.prefix_len % P == 0, "the engine keeps prefixes page-aligned"
        if e == r.seq_len:
            last.append((req, n + e - s - 1))
        runs.append((req, s, e, r.slot_start * P))
        n += e - s
    staged = stage([n, n, len(last)], np.int64, model.device)
    ids_h, pos_h, last_h = staged.host
    at = 0
    for req, s, e, _ in runs:
        ids_h[at: at + e - s] = spec.tokens[req][s:e]
        np.add(_arange(e - s), s, out=pos_h[at: at + e - s])
        at += e - s
    last_h[:] = [row for _, row in last]
    ids_d, pos_d, last_d = staged.send()  # one copy
    mark("rank plan uploaded")
    counts = [sum(e - s for _, s, e in ranges) for ranges in lay.rank_query_ranges]
    return RankPlan(ids_d, pos_d, last, last_d, ep.plan_batch(counts) if ep is not None else None,
                    tuple((s, e, base) for _, s, e, base in runs), model.cfg.index_topk,
                    reqs=tuple(req for req, _, _, _ in runs))


def _logits_work_shape(model: DSAModel):
    """The WorkShape of the fp8 indexer logits kernel the layers will launch (None: no work items there)."""
    cfg = model.cfg
    if model.device.type != "cuda" or cfg.kv_dtype != "fp8" or "full" not in cfg.indexer_types:
        return None
    if not model.backends.triton:
        return None
    from cpkv.kernels.mqa_logits.triton import planned_work_shape
    return planned_work_shape(cfg.index_n_heads, cfg.index_head_dim, model.device)


def run_batch(model: DSAModel, rt: "ComposeRuntime", compose_plan: "Callable[[], ComposePlan] | ComposePlan",
              plan: RankPlan, graphs: "LayerGraphs | None" = None) -> dict[int, torch.Tensor]:
    """-> {request index: float32 [vocab] last-token logits} for the requests whose last token is here.

    ``compose_plan``: builds the batch's compose plan (``rt.plan_batch``: it persists current pages into the batch's
    page ids; the engine asks it for the first layer's compose launches alone, the others are prepared once the
    first layer is launched), called once the first layer's projections are launched, then ``plan.complete``;
    or the compose plan itself, built ahead (``plan`` completed then too);
    ``plan``: this rank's ``rank_plan`` of the batch;
    ``graphs``: the model's ``cpkv.engine.graphs.LayerGraphs``: a batch whose token count is in its buckets runs
    each layer's token-only pieces through it (captured CUDA graphs), the rest eagerly as without it.
    """
    # topk: the last full indexer layer's, reused by shared layers; delta: the last layer's MLP output, added by
    # the next layer's fused input norm (or before the final norm)
    mark("rank plan")
    t = plan.num_tokens
    tap = model.tap
    if tap is not None:
        tap.begin(plan)
    g = graphs if graphs is not None and graphs.bucket(t) is not None else None
    h, delta, topk = model.embed(plan.ids), None, None
    mark("embed")
    rot = plan.rotary(model)  # behind the embedding on the GPU
    if g is not None:
        g.begin(h, rot)

    def project(n: int, layer):
        p = None if not t else g.project(n, layer) if g is not None else layer.project(h, rot, delta)
        mark(f"L{n} project")
        return p

    p = project(0, model.layers[0]) if model.layers else None
    compose = compose_plan() if callable(compose_plan) else compose_plan  # the plan's host work while the GPU runs the first
    #                                                           projections (unless it was built ahead)
    mark("compose plan")
    attn = None
    rows_at = compose.query_rows
    for n, layer in enumerate(model.layers):
        if n:
            p = project(n, layer)
        for kind in model.cfg.kinds_at(n):  # shared indexer layers write and compose no index rows
            rows = rt.current_rows(compose, n, kind)
            if p is not None and tap is not None:
                tap.write_rows(n, kind, rows, rows_at, getattr(p, kind))
            elif p is not None:
                rows.index_copy_(0, rows_at, getattr(p, kind))
        dense = rt.compose_layer(compose, n)  # the layer's kinds: one barrier round and one gather call under symm
        mark(f"L{n} compose")
        if attn is None:  # the attention plan's host work behind the first compose (unless built ahead)
            attn = plan.complete(model)
            mark("attention plan")
        if p is not None and g is not None:
            latent, topk = layer.attention(p, dense, attn, topk)
            g.finish(n, layer, latent, plan.ep)
            mark(f"L{n} mlp")
        elif p is not None:
            h, delta, topk = layer.attend_split(p.h, p, dense, attn, topk, plan.ep)
        elif plan.ep is not None and layer.is_moe:
            layer.mlp(h, plan.ep)  # no tokens here: still serves its experts in the layer's exchange
        if n == 0:  # the other layers' prepared compose launches, behind the GPU's work on the first layer
            rt.build_launches(compose)
    if not plan.last:
        return {}
    if g is not None:
        h, delta = g.result()
    rows = plan.last_rows
    logits = model.logits(h.index_select(0, rows), None if delta is None else delta.index_select(0, rows))
    mark("logits")
    return {req: logits[i] for i, (req, _) in enumerate(plan.last)}
