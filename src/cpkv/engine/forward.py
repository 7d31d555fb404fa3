"""One rank's forward over a CP batch: its own query tokens through every layer, composing per layer.

    BatchSpec (same on every rank): layout, each request's sequence tokens, the pool page id of every
    current page on its writer.
    RankPlan (built once per batch by ``rank_plan``, passed in): the rank's token ids and positions, its
    rotary tables, dense-buffer key ranges [ks, ke) (a request's keys are contiguous from
    ``slot_start * page_size`` because prefixes are page-aligned), and where each request's last
    token sits when this rank holds it.

Per layer: project -> write own token/index rows (staging) -> compose both kinds -> attend (indexer top-k,
sparse MLA, MLP). A rank with no query tokens still takes part in every compose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cpkv.config import KINDS
from cpkv.layout import BatchLayout
from cpkv.model.layer import AttnPlan
from cpkv.model.model import DSAModel
from cpkv.model.ops import Rotary

if TYPE_CHECKING:
    from cpkv.compose.plan import ComposePlan
    from cpkv.compose.runtime import ComposeRuntime


@dataclass(frozen=True)
class BatchSpec:
    """A batch as every rank sees it. ``tokens[r]``: request r's tokens [0, seq_len);
    ``page_ids[c]``: the pool page (on its writer) of compact current page c."""

    layout: BatchLayout
    tokens: tuple[tuple[int, ...], ...]
    page_ids: tuple[int, ...]


@dataclass
class RankPlan:
    ids: torch.Tensor
    rot: Rotary
    attn: AttnPlan
    last: list[tuple[int, int]]  # (request index, row in this rank's tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])


def rank_plan(spec: BatchSpec, rank: int, model: DSAModel) -> RankPlan:
    """Rank ``rank``'s RankPlan for ``spec`` (built once per batch; every layer reuses it)."""
    lay, P = spec.layout, spec.layout.page_size
    ids: list[int] = []
    pos: list[int] = []
    ks: list[int] = []
    ke: list[int] = []
    last: list[tuple[int, int]] = []
    for req, s, e in lay.rank_query_ranges[rank]:
        r = lay.requests[req]
        assert r.prefix_len % P == 0, "the engine keeps prefixes page-aligned"
        base = r.slot_start * P
        if e == r.seq_len:
            last.append((req, len(ids) + e - s - 1))
        ids.extend(spec.tokens[req][s:e])
        pos.extend(range(s, e))
        ks.extend([base] * (e - s))
        ke.extend(base + p + 1 for p in range(s, e))
    dev = model.device
    positions = torch.tensor(pos, dtype=torch.int64, device=dev)
    return RankPlan(torch.tensor(ids, dtype=torch.int64, device=dev), model.rotary(positions),
                    AttnPlan.build(ks, ke, model.cfg.index_topk, dev), last)


def run_batch(model: DSAModel, rt: "ComposeRuntime", compose: "ComposePlan", plan: RankPlan) -> dict[int, torch.Tensor]:
    """-> {request index: float32 [vocab] last-token logits} for the requests whose last token is here.

    ``compose``: the batch's plan from ``rt.prepare`` (it persists current pages into the batch's page ids);
    ``plan``: this rank's ``rank_plan`` of the batch.
    """
    rows_at = compose.query_rows
    h = model.embed(plan.ids)
    for n, layer in enumerate(model.layers):
        p = layer.project(h, plan.rot) if plan.num_tokens else None
        for kind in KINDS:
            rows = rt.current_rows(compose, n, kind)
            if p is not None:
                rows.index_copy_(0, rows_at, getattr(p, kind))
        dense = rt.compose_layer(compose, n)  # both kinds: one barrier round and one gather launch under symm
        if p is not None:
            h = layer.attend(h, p, dense["token"], dense["index"], plan.attn)
    if not plan.last:
        return {}
    logits = model.logits(h[[row for _, row in plan.last]])
    return {req: logits[i] for i, (req, _) in enumerate(plan.last)}
