"""One rank's paged decode step: every running generation advances by one token, its KV read where it lies
(docs/design.md §11).

    DecodeStep (cpkv.scheduler.decode, the same on every rank): per generation its input token, position, owner,
    tail page, page-table slot and the table entries that changed since its last step
    DecodeTable (every rank, the same): owner and page id of every page of every running generation, int64
    [slots, max pages] on the device, written only where a step says it changed (a page per P tokens)
    DecodePlan (``decode_plan``, once per step, every layer reuses it): the rank's own entries' token ids,
    positions, the pool rows their KV goes to (O(B) host work, one asynchronous upload: no host sync), and the
    context map made on the
    device from the table: (owner, row) of every key of every own entry, entry by entry -- the S rows the indexer
    scores, whose positions the top-k indexes
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
from typing import TYPE_CHECKING, Any, Hashable

import numpy as np
import torch

from cpkv.engine.paged import DecodeTable, PagedViews, RowMap
from cpkv.model.layer import AttnPlan, DSALayer, Projected
from cpkv.model.model import DSAModel
from cpkv.scheduler.decode import DecodeStep
from cpkv.upload import staging, upload_arrays

if TYPE_CHECKING:
    from cpkv.engine.graphs import LayerGraphs


@dataclass
class DecodePlan:
    """One step's plan on one rank (module docstring). B: the rank's entries; S: their context keys in all."""

    rids: tuple[Hashable, ...]
    ids: torch.Tensor        # int64 [B]
    positions: torch.Tensor  # int64 [B]
    write_rows: torch.Tensor  # int64 [B]: each token's row in this rank's pool (page * P + offset)
    ctx: RowMap | None       # (owner, row) int64 [S] of every key of every entry, entry by entry (None in place)
    attn: AttnPlan | None    # query b's keys are the map's [ks[b], ke[b]); dense when each sees <= top-k keys
    ep: Any = None           # the step's expert exchange (cpkv.compose.dispatch.EPBatch), or None
    inputs: Any = None       # in place: the entries' StepInputs (engine.decode_graph: ids ... ctx on the device, L)

    @property
    def num_tokens(self) -> int:
        return len(self.rids)


def entry_rows(mine, page_size: int) -> np.ndarray:
    """int64 [5, B]: the entries' token ids, positions, the pool rows their KV goes to, page-table slots and
    contexts (``engine.decode_graph.FIELDS``' order)."""
    P = page_size
    return np.asarray([[e.token for e in mine], [e.position for e in mine],
                       [e.page * P + e.position % P for e in mine], [e.slot for e in mine],
                       [e.context for e in mine]], dtype=np.int64).reshape(5, -1)


def draw_rows(mine, draw: dict) -> np.ndarray:
    """int64 [5, B]: the entries' sampling rows (``engine.decode_graph.DRAW_FIELDS``): top_k and key as integers,
    temperature, top_p and min_p as float64 bit patterns; ``draw``: {rid: (top_k, key, temperature, top_p,
    min_p)}, a greedy entry's temperature 0."""
    rows = [draw[e.rid] for e in mine]
    ints = np.asarray([[r[0] for r in rows], [r[1] for r in rows]], dtype=np.int64).reshape(2, -1)
    floats = np.asarray([[r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows]],
                        dtype=np.float64).reshape(3, -1)
    return np.concatenate([ints, floats.view(np.int64)])


def decode_plan(step: DecodeStep, rank: int, model: DSAModel, table: DecodeTable, ep: Any = None,
                in_place: bool = False) -> DecodePlan:
    """Rank ``rank``'s plan of ``step`` (module docstring) over ``table`` (the step's changes applied); ``ep``: the
    rank's ExpertExchange, prepared with every rank's token count. Host work O(own entries). ``in_place``: the
    attention reads the rows in place (``engine.decode_graph.attend_in_place``): no context map, no AttnPlan, the
    entries' StepInputs instead."""
    mine, P, dev = step.on(rank), step.page_size, model.device
    entries = entry_rows(mine, P)
    ke = np.cumsum(entries[4], dtype=np.int64)
    up = upload_arrays([np.concatenate([entries, (ke - entries[4])[None]])], dev)[0]
    ids, pos, write, slot, ctx, start = up.unbind(0)
    exchange = ep.plan_batch(step.counts()) if ep is not None else None
    rids = tuple(e.rid for e in mine)
    if in_place:
        from cpkv.engine.decode_graph import StepInputs, context_bucket

        L = context_bucket(max((e.context for e in mine), default=1), model.cfg.index_topk)
        return DecodePlan(rids, ids, pos, write, None, None, exchange, StepInputs(up[:5], L))
    s, ks = (int(ke[-1]) if len(mine) else 0), ke - entries[4]
    seq = torch.repeat_interleave(torch.arange(len(mine), device=dev), ctx, output_size=s)  # each key's entry
    at = torch.arange(s, device=dev) - start[seq]                                           # its position
    row, col = slot[seq], at // P
    attn = AttnPlan.build(ks.tolist(), ke.tolist(), model.cfg.index_topk, dev)
    return DecodePlan(rids, ids, pos, write, RowMap(table.owner[row, col], table.page[row, col] * P + at % P), attn,
                      exchange)


def run_decode(model: DSAModel, views: PagedViews, plan: DecodePlan, graphs: "LayerGraphs | None" = None,
               in_place: Any = None, table: DecodeTable | None = None) -> dict[Hashable, torch.Tensor]:
    """-> {rid: float32 [vocab]} next-token logits of the rank's entries (module docstring). ``graphs``: the model's
    ``LayerGraphs``: a step whose token count is in its buckets runs each layer's token-only pieces (A: project, C:
    finish) through them, as a prefill batch does (``engine.forward.run_batch``); the paged attention between stays
    eager: over gathered rows, or in place through ``table`` with ``in_place`` (the step's StepKernels; the plan made
    ``in_place``)."""
    t = plan.num_tokens
    g = graphs if graphs is not None and graphs.bucket(t) is not None else None
    h, delta, sel = model.embed(plan.ids), None, None
    bounds = plan.inputs.bounds() if in_place is not None and t else None
    rot = model.rotary(plan.positions)
    if g is not None:
        g.begin(h, rot)
    for n, layer in enumerate(model.layers):
        if not t:
            if plan.ep is not None and layer.is_moe:
                layer.mlp(h, plan.ep)  # no tokens here: still serves its experts in the layer's exchange
            continue
        p = g.project(n, layer) if g is not None else layer.project(h, rot, delta)
        for kind in model.cfg.kinds_at(n):
            views.own(n, kind).index_copy_(0, plan.write_rows, getattr(p, kind))
        if in_place is not None:
            from cpkv.engine.decode_graph import attend_in_place

            latent, sel = attend_in_place(model, n, layer, p, in_place, table, plan.inputs, bounds, sel)
        else:
            latent, sel = paged_attention(layer, p, views, plan, sel)
        if g is not None:
            g.finish(n, layer, latent, plan.ep)
        else:
            h, delta = layer.finish(p.h, latent, plan.ep)
    if not t:
        return {}
    if g is not None:
        h, delta = g.result()
    logits = model.logits(h, delta)
    return {rid: logits[i] for i, rid in enumerate(plan.rids)}


def paged_attention(layer: DSALayer, p: Projected, views: PagedViews, plan: DecodePlan,
                    sel: "Selection | None") -> tuple[torch.Tensor, "Selection | None"]:
    """``DSALayer.attention`` over paged rows -> (latent [B, H, kv_lora], the selection it read: None on the dense
    path). A step whose every query sees <= top-k keys reads them all (the dense path, as a prefill batch does);
    else a full layer selects and a shared layer reuses the selection (its rows' map made once)."""
    prec, attn, kr, n = layer.precision, plan.attn, layer.cfg.kv_lora_rank, layer.n
    if attn.dense:
        layer.stats["dense"] += 1
        kv = prec.dense_kv(views.read(n, "token", plan.ctx))
        return prec.dense_mla(p.q, kv, attn.ks, attn.ke, layer.sm_scale, kr), sel
    if layer.full:
        sel = Selection(layer.select(p, views.read(n, "index", plan.ctx), attn), plan.ctx)
    if sel is None:
        raise ValueError(f"layer {n} is a shared indexer layer with no earlier full layer's top-k")
    layer.stats["sparse"] += 1
    kv = prec.dense_kv(views.read(n, "token", sel.rows))  # [B * k, d]: the selected rows only
    return prec.sparse_mla(p.q, kv, sel.ind, layer.sm_scale, kr), sel


class Selection:
    """A full layer's top-k (int32 [B, k]: rows of the step's context map, -1 none) as the rows it names across the
    group (``rows``: B * k of them, -1 where none) and their indices into those rows in order (``ind``, -1 none)."""

    def __init__(self, topk: torch.Tensor, ctx: RowMap) -> None:
        self.topk = topk
        sel = topk.long()
        valid = sel >= 0
        at = sel.clamp(min=0).reshape(-1)
        self.rows = RowMap(ctx.owner[at], torch.where(valid.reshape(-1), ctx.row[at], -1))
        ind = torch.arange(at.shape[0], dtype=torch.int32, device=at.device).view(sel.shape)
        self.ind = torch.where(valid, ind, -1)


class Launched:
    """A pipelined step in flight (``DecodeRunner.launch``): its entries and their tokens on their way to
    the host. ``tokens()`` waits for them (that step's end) -> {rid: token}."""

    def __init__(self, rids: tuple[Hashable, ...], host: torch.Tensor, done: "torch.cuda.Event | None") -> None:
        self.rids, self.host, self.done = rids, host, done
        self._tokens: dict[Hashable, int] | None = None

    def tokens(self) -> dict[Hashable, int]:
        if self._tokens is None:
            if self.done is not None:
                self.done.synchronize()
            self._tokens = dict(zip(self.rids, self.host[: len(self.rids)].tolist()))
        return self._tokens


class DecodeRunner:
    """The paged decode step on one rank: ``run(step)`` -> {rid: float32 [vocab]} logits of its entries. Holds the
    pool views (made once) and the page table beside the executor's compose runtime, expert exchange and layer
    graphs (the prefill's buckets serve the gather step's token-only pieces).

    ``form`` (default CPKV_DECODE_STEP): "gather" (``run_decode``: the rows gathered, the prefill's kernels),
    "static" (``run_decode`` with the attention read in place by the paged kernels, ``engine.decode_graph``; the
    token-only pieces through the layer graphs as in "gather"), "graphs" (every layer of the step in one CUDA graph
    per (batch, context) bucket; a step with an expert exchange runs static), "auto": graphs on CUDA where cpkv's
    kernels run at fp8 precision with no expert exchange, static where they run with one, else gather
    (docs/design.md §11, measured in BENCHMARKS.md).

    ``launch(step, draw)`` (where ``pipelined``: the graphs form at cp 1) enqueues the step and returns at once with
    its tokens (greedy, or sampled in the graph) on their way to the host (``Launched``): the next step is planned and launched while this one
    runs, its pending input tokens read on the device (``scheduler.decode``'s pipelined loop). At most two launched
    steps are unread at a time. ``keep_decisions``: the graphs hold each step's selections and router choices for a
    check to read (``StepGraphs.decisions``; ``cpkv bench decode``), memory a server does not spend."""

    def __init__(self, model: DSAModel, rt: Any, ep: Any, rank: int, graphs: "LayerGraphs | None" = None,
                 form: str | None = None, max_batch: int = 256, keep_decisions: bool = False) -> None:
        from cpkv import envs

        self.model, self.ep, self.rank, self.graphs, self.cp = model, ep, rank, graphs, rt.cp
        self.views = PagedViews(rt, model.backends.triton)
        # rows for 64 generations at once from the start (50 KB each at GLM-5's context): a table that grows
        # drops the step's graphs made over it
        self.table = DecodeTable(-(-model.cfg.max_context // rt.page_size), model.device, slots=64)
        self.steps = self.launched = 0  # steps run; of them launched pipelined
        self.form = resolve_form(form or envs.get("CPKV_DECODE_STEP"), model, ep)
        self.static = self.step_graphs = None
        if self.form in ("static", "graphs"):
            from cpkv.engine.decode_graph import StepGraphs, StepKernels

            self.static = StepKernels(model, self.views)
            if self.form == "graphs":
                self.step_graphs = StepGraphs(model, self.static, self.table, max_batch,
                                              lambda a: upload_arrays([a], model.device)[0], keep_decisions)
        pin = model.device.type == "cuda"
        self._host = [torch.empty(max_batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._unread: list[Launched] = []

    @property
    def pipelined(self) -> bool:
        """``launch`` runs here: the graphs form with no expert exchange at cp 1 (a generation's next step may run
        on another rank at cp > 1, which would need its token on the host first)."""
        return self.step_graphs is not None and self.ep is None and self.cp == 1

    def run(self, step: DecodeStep) -> dict[Hashable, torch.Tensor]:
        mine, out = step.on(self.rank), None
        graphed = self.step_graphs is not None and self.ep is None and self.step_graphs.fits(len(mine))
        if not graphed and any(e.token < 0 for e in mine):
            raise ValueError(f"decode step {step.index}: an input token is pending on the device; only the graphs "
                             f"form reads it there (this runner: {self.form})")
        # the step's uploads from a reused pinned buffer (pinning per call cost ~40 us each on the H200's host)
        with staging(self.model.device, self.steps % 2):
            self.table.apply(step)  # every rank: any rank may compute a generation's later steps
            if graphed:
                logits = self.step_graphs.replay(*self._rows(mine, step.page_size))[0][: len(mine)].clone()
                out = {e.rid: logits[i] for i, e in enumerate(mine)}
            else:
                plan = decode_plan(step, self.rank, self.model, self.table, self.ep, in_place=self.static is not None)
        if out is None:
            out = run_decode(self.model, self.views, plan, self.graphs, self.static, self.table)
        self.steps += 1
        return {rid: v.detach().float() for rid, v in out.items()}

    def launch(self, step: DecodeStep, draw: dict | None = None) -> Launched:
        """Enqueue ``step`` (the pipelined loop: class docstring) -> its tokens in flight; no host sync. ``draw``:
        {rid: (top_k, key, temperature, top_p, min_p)} (``draw_rows``): its tokens sampled in the graph
        (``sampling.sample_rows``), else each entry's argmax."""
        mine = step.on(self.rank)
        if not (self.pipelined and step.cp == 1 and self.step_graphs.fits(len(mine))):
            raise ValueError(f"decode step {step.index} cannot be launched pipelined (form {self.form}, cp {step.cp}, "
                             f"{len(mine)} generations of at most {self.step_graphs.max_batch if self.step_graphs else 0})")
        self._unread = [x for x in self._unread if x._tokens is None]
        if len(self._unread) >= 2:
            raise RuntimeError("two launched decode steps are unread: read the older one's tokens first")
        buf = self._host[self.steps % 2]
        with staging(self.model.device, self.steps % 2):
            self.table.apply(step)
            host, t, L = self._rows(mine, step.page_size)
            if draw is not None:
                host = np.concatenate([host, draw_rows(mine, draw)])
            tokens = self.step_graphs.replay(host, t, L)[1]
            buf[: len(mine)].copy_(tokens[: len(mine)], non_blocking=True)
            done = None
            if self.model.device.type == "cuda":
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.model.device))
        self.steps += 1
        self.launched += 1
        got = Launched(tuple(e.rid for e in mine), buf, done)
        self._unread.append(got)
        return got

    def _rows(self, mine, page_size: int) -> tuple[np.ndarray, int, int]:
        """The graphed step's arguments: (entry rows, entries, context bucket)."""
        from cpkv.engine.decode_graph import context_bucket

        host = entry_rows(mine, page_size)
        return host, len(mine), context_bucket(int(host[4].max()), self.model.cfg.index_topk)


def resolve_form(form: str, model: DSAModel, ep: Any) -> str:
    """CPKV_DECODE_STEP's "auto" made concrete for this model and exchange (``DecodeRunner``); ConfigError for an
    in-place form ("static", "graphs") on a model whose KV rows are not fp8 (``--precision exact``)."""
    from cpkv.errors import ConfigError
    from cpkv.model.precision import FP8Precision

    fp8 = bool(model.layers) and isinstance(model.layers[0].precision, FP8Precision)
    if form in ("static", "graphs") and not fp8:
        raise ConfigError(f"decode step {form!r} (CPKV_DECODE_STEP) reads fp8 KV rows in place; this model keeps "
                          "exact rows (--precision exact): use gather or auto")
    if form != "auto":
        return form
    if not (fp8 and model.backends.triton):
        return "gather"
    return "graphs" if model.device.type == "cuda" and ep is None else "static"
