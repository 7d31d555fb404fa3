"""One rank's forward over a CP batch: its own query tokens through every layer, composing per layer.

    BatchSpec (same on every rank): layout, each request's sequence tokens, the pool page id of every
    current page on its writer.
    RankPlan (built once per batch by ``rank_plan`` from host data, passed in): the rank's token ids and
    positions, its rotary tables, dense-buffer key ranges [ks, ke) (a request's keys are contiguous from
    ``slot_start * page_size`` because prefixes are page-aligned), and where each request's last
    token sits when this rank holds it. Its device tensors are uploaded asynchronously, so neither the
    plan nor the forward pass waits on the device (``cpkv.upload``). The attention part (key ranges, the
    indexer's chunks and work items: most of the plan's host time) is built by ``RankPlan.complete`` after
    the first layer's compose is launched, the compose plan (``run_batch``'s ``prepare``) after its
    projections: the GPU starts on the batch after the token ids and rotary tables alone.

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
from cpkv.upload import upload_arrays

if TYPE_CHECKING:
    from cpkv.compose.plan import ComposePlan
    from cpkv.compose.runtime import ComposeRuntime


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
    rot: Rotary
    last: list[tuple[int, int]]  # (request index, row in this rank's tokens)
    last_rows: torch.Tensor      # int64 [len(last)] on the device: those rows
    ep: Any = None               # the batch's expert-parallel exchange (cpkv.compose.dispatch.EPBatch), or None
    bounds: tuple[np.ndarray, np.ndarray] | None = None  # host int64 [T] ks, ke until ``complete`` builds attn
    topk: int = 0
    attn: AttnPlan | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def complete(self, model: DSAModel, chunks: int | None = 1) -> AttnPlan:
        """The attention plan from the host bounds (built once), with the indexer's work items of its first
        ``chunks`` logits chunks (None: all; the first full layer builds the others as it reaches them, behind
        the GPU's work on the chunks before: ``IndexerPlan.prepare_items``). A plan built ahead, while the GPU
        runs the batch before, takes them all."""
        if self.attn is None:
            ks, ke = self.bounds
            self.attn = AttnPlan.build(ks, ke, self.topk, model.device)
            mark("attention bounds")
        self.attn.indexer.prepare_items(_logits_work_shape(model), self.topk, chunks=chunks)
        return self.attn


def rank_plan(spec: BatchSpec, rank: int, model: DSAModel, ep: Any = None) -> RankPlan:
    """Rank ``rank``'s RankPlan for ``spec``, built once per batch (every layer reuses it): host arrays per
    query-token run (numpy, no per-token Python), uploaded once; the attention plan is left to
    ``RankPlan.complete``. ``ep``: the rank's ExpertExchange (expert parallelism), prepared here with every
    rank's query-token count."""
    lay, P = spec.layout, spec.layout.page_size
    ids, pos, base = [], [], []
    last: list[tuple[int, int]] = []
    n = 0
    for req, s, e in lay.rank_query_ranges[rank]:
        r = lay.requests[req]
        assert r.prefix_len % P == 0, "the engine keeps prefixes page-aligned"
        if e == r.seq_len:
            last.append((req, n + e - s - 1))
        ids.append(np.asarray(spec.tokens[req][s:e], dtype=np.int64))
        pos.append(np.arange(s, e, dtype=np.int64))
        base.append(np.full(e - s, r.slot_start * P, dtype=np.int64))
        n += e - s
    cat = (lambda x: np.concatenate(x) if x else np.zeros(0, np.int64))  # noqa: E731
    ids_h, pos_h, ks = cat(ids), cat(pos), cat(base)
    counts = [sum(e - s for _, s, e in ranges) for ranges in lay.rank_query_ranges]
    ids_d, pos_d, last_d = upload_arrays([ids_h, pos_h, np.asarray([row for _, row in last], np.int64)],
                                         model.device)  # one copy
    mark("rank plan uploaded")
    return RankPlan(ids_d, model.rotary(pos_d), last, last_d, ep.prepare(counts) if ep is not None else None,
                    (ks, ks + pos_h + 1), model.cfg.index_topk)


def _logits_work_shape(model: DSAModel):
    """The WorkShape of the fp8 indexer logits kernel the layers will launch (None: no work items there)."""
    cfg = model.cfg
    if model.device.type != "cuda" or cfg.kv_dtype != "fp8" or "full" not in cfg.indexer_types:
        return None
    from cpkv.kernels.platform import use_triton
    if not use_triton(model.device):
        return None
    from cpkv.kernels.mqa_logits.triton import planned_work_shape
    return planned_work_shape(cfg.index_n_heads, cfg.index_head_dim, model.device)


def run_batch(model: DSAModel, rt: "ComposeRuntime", prepare: "Callable[[], ComposePlan] | ComposePlan",
              plan: RankPlan) -> dict[int, torch.Tensor]:
    """-> {request index: float32 [vocab] last-token logits} for the requests whose last token is here.

    ``prepare``: builds the batch's compose plan (``rt.prepare``: it persists current pages into the batch's
    page ids; the engine asks it for the first layer's compose launches alone, the others are prepared once the
    first layer is launched), called once the first layer's projections are launched, then ``plan.complete``;
    or the compose plan itself, built ahead (``plan`` completed then too);
    ``plan``: this rank's ``rank_plan`` of the batch.
    """
    # topk: the last full indexer layer's, reused by shared layers; delta: the last layer's MLP output, added by
    # the next layer's fused input norm (or before the final norm)
    mark("rank plan")
    h, delta, topk = model.embed(plan.ids), None, None
    mark("embed")
    p = model.layers[0].project(h, plan.rot, delta) if plan.num_tokens and model.layers else None
    mark("L0 project")
    compose = prepare() if callable(prepare) else prepare  # the plan's host work while the GPU runs the first
    #                                                           projections (unless it was built ahead)
    mark("compose plan")
    attn = None
    rows_at = compose.query_rows
    for n, layer in enumerate(model.layers):
        if n:
            p = layer.project(h, plan.rot, delta) if plan.num_tokens else None
            mark(f"L{n} project")
        for kind in model.cfg.kinds_at(n):  # shared indexer layers write and compose no index rows
            rows = rt.current_rows(compose, n, kind)
            if p is not None:
                rows.index_copy_(0, rows_at, getattr(p, kind))
        dense = rt.compose_layer(compose, n)  # the layer's kinds: one barrier round and one gather launch under symm
        mark(f"L{n} compose")
        if attn is None:  # the attention plan's host work behind the first compose (unless built ahead)
            attn = plan.complete(model)
            mark("attention plan")
        if p is not None:
            h, delta, topk = layer.attend_split(p.h, p, dense, attn, topk, plan.ep)
        elif plan.ep is not None and layer.is_moe:
            layer.mlp(h, plan.ep)  # no tokens here: still serves its experts in the layer's exchange
        if n == 0:  # the other layers' prepared compose launches, behind the GPU's work on the first layer
            rt.prepare_launches(compose)
    if not plan.last:
        return {}
    rows = plan.last_rows
    logits = model.logits(h.index_select(0, rows), None if delta is None else delta.index_select(0, rows))
    mark("logits")
    return {req: logits[i] for i, (req, _) in enumerate(plan.last)}
