"""One rank's paged decode step: every running generation advances by one token, its KV read where it lies
(docs/design.md §11).

    DecodeStep (cpkv.scheduler.decode, the same on every rank): per generation its input token, position, owner
    and page table (owner, page id), the token's page last
    DecodePlan (``decode_plan``, once per step, every layer reuses it): the rank's own entries' token ids,
    positions, the pool rows their KV goes to, and the context map: (owner, row) of every key of every own
    entry, entry by entry -- the S rows the indexer scores, whose positions the top-k indexes
    per layer      project the new tokens -> write their token / index rows into this rank's pool (the tail
                   page of each entry is this rank's) -> indexer over the context's index rows read through the
                   map (every rank's pool through peer memory) -> top-k -> sparse MLA over the selected token rows
                   only, read the same way -> W_UV, o_proj, MLP / MoE (the expert exchange, every rank)
    logits         the LM head over the new tokens only

Nothing is composed: no dense buffer of the whole context, no barrier round (a step reads only rows written
before it: every context row but the token's own was stored by an earlier batch or step, and the token's own row
is written by this rank). A rank with no entry still takes part in every expert exchange. The reads go through
``paged_rows`` (its pure-torch reference here; on the GPU a paged indexer kernel and a paged sparse decode
kernel are to read the rows in place).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np
import torch

from cpkv.kernels.paged_rows.ref import paged_rows_ref
from cpkv.model.layer import AttnPlan, DSALayer, Projected
from cpkv.model.model import DSAModel
from cpkv.scheduler.decode import DecodeEntry, DecodeStep


def paged_rows(pools: list[torch.Tensor], owner: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """uint8 [n, row_bytes]: row ``row[i]`` of rank ``owner[i]``'s pool (``kernels.paged_rows``); zeros where < 0."""
    return paged_rows_ref(pools, owner, row)


@dataclass
class DecodePlan:
    """One step's plan on one rank (module docstring). B: the rank's entries; S: their context keys in all."""

    rids: tuple[Hashable, ...]
    ids: torch.Tensor        # int64 [B]
    positions: torch.Tensor  # int64 [B]
    write_rows: torch.Tensor  # int64 [B]: each token's row in this rank's pool (page * P + offset)
    ctx_owner: torch.Tensor  # int64 [S]
    ctx_row: torch.Tensor    # int64 [S]
    attn: AttnPlan           # query b's keys are the map's [ks[b], ke[b]); dense when each sees <= top-k keys
    ep: Any = None           # the step's expert exchange (cpkv.compose.dispatch.EPBatch), or None

    @property
    def num_tokens(self) -> int:
        return len(self.rids)


def context_rows(e: DecodeEntry, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(owner, row) int64 [e.context] of every key of entry ``e``, in position order."""
    owners = np.fromiter((o for o, _ in e.pages), np.int64, len(e.pages))
    pids = np.fromiter((p for _, p in e.pages), np.int64, len(e.pages))
    offs = np.arange(page_size, dtype=np.int64)
    rows = (pids[:, None] * page_size + offs[None, :]).reshape(-1)[: e.context]
    return np.repeat(owners, page_size)[: e.context], rows


def decode_plan(step: DecodeStep, rank: int, model: DSAModel, ep: Any = None) -> DecodePlan:
    """Rank ``rank``'s plan of ``step`` (module docstring); ``ep``: the rank's ExpertExchange, prepared with every
    rank's token count."""
    mine, P, dev = step.on(rank), step.page_size, model.device
    owners, rows, ks, ke = [], [], [], []
    at = 0
    for e in mine:
        o, r = context_rows(e, P)
        owners.append(o)
        rows.append(r)
        ks.append(at)
        at += e.context
        ke.append(at)
    cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64))  # noqa: E731
    host = [[e.token for e in mine], [e.position for e in mine],
            [e.pages[-1][1] * P + e.position % P for e in mine]]
    ids, pos, write = (torch.tensor(x, dtype=torch.int64).to(dev) for x in host)
    attn = AttnPlan.build(ks, ke, model.cfg.index_topk, dev)
    return DecodePlan(tuple(e.rid for e in mine), ids, pos, write, torch.from_numpy(cat(owners)).to(dev),
                      torch.from_numpy(cat(rows)).to(dev), attn,
                      ep.plan_batch(step.counts()) if ep is not None else None)


class PagedViews:
    """Every rank's pool rows per (layer, kind), as the compose runtime's peer memory maps them (views made once:
    the pools never move). ``own``: this rank's, where its tokens' rows are written."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self._views: dict[tuple[int, str], list[torch.Tensor]] = {}

    def rows(self, layer: int, kind: str) -> list[torch.Tensor]:
        """Per rank: uint8 [num_pages * page_size, row_bytes] of ``layer``'s ``kind`` rows."""
        got = self._views.get((layer, kind))
        if got is None:
            pool = self.rt.pool
            slot, shape = pool.slot(layer, kind), (pool.num_pages * pool.page_size, pool.row_bytes(kind))
            got = self._views[(layer, kind)] = [p[slot].view(shape) for p in self.rt.pools[kind]]
            if len(got) != self.rt.cp:
                raise ValueError(f"paged decode reads every rank's pool: peer memory maps {len(got)} of {self.rt.cp}")
        return got

    def own(self, layer: int, kind: str) -> torch.Tensor:
        return self.rt.pool.rows(layer, kind)


def run_decode(model: DSAModel, views: PagedViews, plan: DecodePlan) -> dict[Hashable, torch.Tensor]:
    """-> {rid: float32 [vocab]} next-token logits of the rank's entries (module docstring)."""
    h, delta, topk = model.embed(plan.ids), None, None
    rot = model.rotary(plan.positions)
    for n, layer in enumerate(model.layers):
        if not plan.num_tokens:
            if plan.ep is not None and layer.is_moe:
                layer.mlp(h, plan.ep)  # no tokens here: still serves its experts in the layer's exchange
            continue
        p = layer.project(h, rot, delta)
        for kind in model.cfg.kinds_at(n):
            views.own(n, kind).index_copy_(0, plan.write_rows, getattr(p, kind))
        latent, topk = paged_attention(layer, p, views, plan, topk)
        h, delta = layer.finish(p.h, latent, plan.ep)
    if not plan.num_tokens:
        return {}
    logits = model.logits(h, delta)
    return {rid: logits[i] for i, rid in enumerate(plan.rids)}


def paged_attention(layer: DSALayer, p: Projected, views: PagedViews, plan: DecodePlan,
                    topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``DSALayer.attention`` over paged rows -> (latent [B, H, kv_lora], topk int32 [B, k]: the selected keys as
    rows of the plan's context map, -1 none). A step whose every query sees <= top-k keys reads them all (the
    dense path, as a prefill batch does); else a full layer selects and a shared layer reuses the selection."""
    prec, attn, kr, n = layer.precision, plan.attn, layer.cfg.kv_lora_rank, layer.n
    token = views.rows(n, "token")
    if attn.dense:
        layer.stats["dense"] += 1
        kv = prec.dense_kv(paged_rows(token, plan.ctx_owner, plan.ctx_row))
        return prec.dense_mla(p.q, kv, attn.ks, attn.ke, layer.sm_scale, kr), topk
    if layer.full:
        topk = layer.select(p, paged_rows(views.rows(n, "index"), plan.ctx_owner, plan.ctx_row), attn)
    if topk is None:
        raise ValueError(f"layer {n} is a shared indexer layer with no earlier full layer's top-k")
    layer.stats["sparse"] += 1
    sel = topk.long()
    valid = sel >= 0
    at = sel.clamp(min=0).reshape(-1)
    rows = torch.where(valid.reshape(-1), plan.ctx_row[at], torch.full_like(at, -1))
    kv = prec.dense_kv(paged_rows(token, plan.ctx_owner[at], rows))  # [B * k, d]: the selected rows only
    ind = torch.arange(at.shape[0], dtype=torch.int32, device=at.device).view(sel.shape)
    return prec.sparse_mla(p.q, kv, torch.where(valid, ind, -1), layer.sm_scale, kr), topk


class DecodeRunner:
    """The paged decode step on one rank: ``run(step)`` -> {rid: float32 [vocab]} logits of its entries. Holds the
    pool views (made once) beside the executor's compose runtime and expert exchange."""

    def __init__(self, model: DSAModel, rt: Any, ep: Any, rank: int) -> None:
        self.model, self.ep, self.rank = model, ep, rank
        self.views = PagedViews(rt)
        self.steps = 0

    def run(self, step: DecodeStep) -> dict[Hashable, torch.Tensor]:
        out = run_decode(self.model, self.views, decode_plan(step, self.rank, self.model, self.ep))
        self.steps += 1
        return {rid: v.detach().float() for rid, v in out.items()}
