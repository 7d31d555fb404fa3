"""The layers' discrete decisions made visible: recorded by a run, forced on the reference that verifies it.

A DSA layer takes two kinds of discrete decisions, and either can flip on rounding noise: the router's top-k
experts of each token in a MoE layer (``cpkv.model.moe``), and the indexer's top-k keys of each query in a full
layer (``DSALayer.select``). Two runs whose hidden states differ by one bf16 ulp can pick a different 8th expert
when the 8th and 9th scores nearly tie, and their logits then differ by far more than rounding. A verification
that compares logits alone cannot tell such a flip from a defect, so (docs/design.md, "Verification"):

    Recorder   set on a rank's model (``DSAModel.set_tap``) when a run is verified: every MoE layer's expert ids
               (written into a fixed buffer of ``max_tokens`` rows, inside the CUDA graphs too) and every full
               layer's selected keys, copied to host memory behind each batch (no device -> host sync in the
               forward) -> per batch a ``BatchDecisions`` (rows -> request and position, in the rank's token order)
    Forced     set on the single-process reference for one request: it makes its own decisions, compares them
               with the run's, then uses the run's, so that the logits compare numerics only. Each differing
               decision has a margin, the gap in the reference's own scores between what it would pick and what
               the run picked: a flip rounding can explain has a small one, a defect (a wrong expert, a stale
               key) a large one. ``summary()`` counts them.

Tests plant faults through the Recorder (``PLANTS``, ``MeasureConfig.plant``; eager runs only): one expert's
contribution dropped for one token, one MoE output row zeroed, one indexer selection replaced by the query's
lowest-scored key, one KV page of one rank left stale (its rows not written). Each must fail verification.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np
import torch

from cpkv.model.moe import group_scores, kept_groups, pick_experts, route_scores, route_weights

PLANTS = ("expert", "combine", "index", "page")

# A differing decision is explained by rounding when its margin is at most twice the score noise measured in its
# layer (docs/design.md, "Verification") plus this floor: for the router's choice values (sigmoid scores + bias, in
# [0, 2)) absolutely, for the indexer's scores relative to the largest |score| the query sees.
ROUTE_MARGIN = {"cpu": 1e-4, "cuda": 1e-3}
INDEX_MARGIN = {"cpu": 1e-4, "cuda": 1e-3}


def _router(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.w["mlp.gate.weight"], layer.w["mlp.gate.e_score_correction_bias"]


# -- the run's side ------------------------------------------------------------------------------------------
@dataclass
class BatchDecisions:
    """One batch's decisions on one rank, in the rank's token order: ``runs`` (request id, start, end, first dense
    row) per query-token run; ``route`` {layer: int64 [T, k] expert ids}; ``select`` {layer: int32 [T, topk]
    dense rows, -1 none}. Host tensors (pinned on CUDA, valid once the batch ended) until ``numpy``."""

    batch: int
    runs: tuple[tuple[Hashable, int, int, int], ...]
    route: dict[int, Any]
    select: dict[int, Any]
    route_values: dict[int, Any] = field(default_factory=dict)  # {layer: float32 [T, k]}: the run's choice values
    select_values: dict[int, Any] = field(default_factory=dict)  # {layer: float32 [T, topk]}: its keys' scores

    def numpy(self) -> "BatchDecisions":
        """Plain numpy arrays (picklable), selections as positions in their request (dense row - first row)."""
        base = np.concatenate([np.full(e - s, b, np.int64) for _, s, e, b in self.runs]) if self.runs else \
            np.zeros(0, np.int64)
        select = {}
        for n, rows in self.select.items():
            a = rows.numpy().astype(np.int64)
            select[n] = np.where(a >= 0, a - base[:, None], -1).astype(np.int32)
        return BatchDecisions(self.batch, self.runs, {n: r.numpy().astype(np.int16) for n, r in self.route.items()},
                              select, {n: r.numpy() for n, r in self.route_values.items()},
                              {n: r.numpy() for n, r in self.select_values.items()})


class Recorder:
    """The run's tap (module docstring). ``max_tokens``: the most query tokens a rank's batch holds (the chunk);
    ``plant``: one of PLANTS or None, which fires once per run (the page and index faults on rank 0); ``rank``:
    this rank."""

    def __init__(self, model, max_tokens: int, page_size: int, rank: int, plant: str | None = None) -> None:
        if plant is not None and plant not in PLANTS:
            raise ValueError(f"unknown planted fault {plant!r}; expected one of {', '.join(PLANTS)}")
        self.cfg, self.device = model.cfg, model.device
        self.max_tokens, self.page_size, self.rank, self.plant = max_tokens, page_size, rank, plant
        self.moe_layers = [n for n, kind in enumerate(self.cfg.mlp_layer_types) if kind == "sparse"]
        self.route_buf: dict[int, torch.Tensor] = {}  # fixed: the captured graphs write these addresses
        self.score_buf: dict[int, torch.Tensor] = {}  # the choice values of those experts (float32)
        self.selected: dict[int, torch.Tensor] = {}
        self.plan: Any = None
        self.final: set[int] = set()  # the batch's requests (indices) whose prompt ends in it (``batch_ends``)
        self.fired = False
        self.stale = False

    def reset(self, plant: str | None, page_size: int) -> None:
        """A new run, with its planted fault (or none), which may fire once."""
        self.plant, self.page_size = plant, page_size
        self.fired = self.stale = False

    def batch_ends(self, requests: set[int]) -> None:
        """The next batch's requests (indices) whose last chunk it is (the engine says, before its forward)."""
        self.final = requests

    def begin(self, plan) -> None:
        """A batch's forward starts (``cpkv.engine.forward.run_batch``)."""
        self.plan, self.selected = plan, {}
        if self.plant == "page" and self._may_fire() and plan.num_tokens:
            self.fired = self.stale = True
        else:
            self.stale = False

    def _may_fire(self) -> bool:
        return self.rank == 0 and not self.fired

    def route(self, layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, choice = route_scores(x, *_router(layer), fused=not layer.exact, backends=layer.backends)
        idx = pick_experts(choice, self.cfg)
        buf = self.route_buf.get(layer.n)
        if buf is None:
            buf = self.route_buf[layer.n] = torch.full((self.max_tokens, idx.shape[1]), -1, dtype=torch.int64,
                                                       device=idx.device)
        buf[: idx.shape[0]].copy_(idx)
        vals = self.score_buf.get(layer.n)
        if vals is None:
            vals = self.score_buf[layer.n] = torch.zeros((self.max_tokens, idx.shape[1]), dtype=torch.float32,
                                                         device=idx.device)
        torch.gather(choice, 1, idx, out=vals[: idx.shape[0]])
        w = route_weights(scores, idx, self.cfg)
        row = self._fault_row("expert", layer)
        if row is not None:
            w[row, 0] = 0.0  # the token's first expert contributes nothing
        return idx, w

    def _fault_row(self, kind: str, layer) -> int | None:
        """The row a token fault hits now: the last token of the first request whose prompt ends in the first such
        batch (its logits are verified), in the first MoE layer, on the rank holding it. Every rank takes the same
        decision (``final`` is the replicated bookkeeping's; a rank without tokens still routes its empty rows in a
        MoE layer), so exactly one token is hit per run."""
        if self.plant != kind or self.fired or layer.n != self.moe_layers[0] or not self.final:
            return None
        self.fired = True
        first = min(self.final)
        rows = [row for req, row in self.plan.last if req == first]
        return rows[0] if rows else None

    def moe_out(self, layer, y: torch.Tensor) -> torch.Tensor:
        row = self._fault_row("combine", layer)
        if row is not None:
            y[row].zero_()
        return y

    def select(self, layer, p, index_dense: torch.Tensor, plan, topk: torch.Tensor) -> torch.Tensor:
        if self.plant == "index" and self._may_fire():
            topk = self._replace_best(layer, p, index_dense, plan, topk)
        rows = torch.arange(topk.shape[0], device=topk.device)
        self.selected[layer.n] = (topk, scores_at(layer, p, index_dense, rows, topk))
        return topk

    def _replace_best(self, layer, p, index_dense, plan, topk: torch.Tensor) -> torch.Tensor:
        """The planted index fault: the query seeing the most keys has its best key replaced by its worst."""
        ks, ke = plan.ks.cpu().long(), plan.ke.cpu().long()
        i = int((ke - ks).argmax())
        if int(ke[i] - ks[i]) <= topk.shape[1]:
            return topk  # every key selected: nothing to replace (tried again next batch)
        self.fired = True
        s = index_scores(layer, p, index_dense, plan.ks, plan.ke, [i])[0]
        sel = topk[i].long()
        sel = sel[sel >= 0]
        best = sel[s[sel].argmax()]
        free = torch.ones_like(s, dtype=torch.bool)
        free[sel] = False
        free[: int(ks[i])] = False
        free[int(ke[i]):] = False
        worst = torch.where(free, s, torch.full_like(s, float("inf"))).argmin()
        topk = topk.clone()
        topk[i] = torch.where(topk[i] == best, worst.to(topk.dtype), topk[i])
        return topk

    def write_rows(self, n: int, kind: str, rows: torch.Tensor, at: torch.Tensor, values: torch.Tensor) -> None:
        """The rank's own KV rows of layer ``n`` into the compose runtime's current rows (``rows[at] = values``);
        the planted page fault leaves the rank's first page of the batch unwritten (stale) in every layer."""
        if self.stale:
            skip = min(self.page_size, at.shape[0])
            at, values = at[skip:], values[skip:]
        rows.index_copy_(0, at, values)

    def collect(self, plan, rids: Sequence[Hashable], batch: int) -> BatchDecisions:
        """This batch's decisions copied to host memory behind its forward (call once it is launched)."""
        t = plan.num_tokens
        runs = tuple((rids[req], s, e, base) for req, (s, e, base) in zip(plan.reqs, plan.runs))
        route = {n: _host(buf[:t]) for n, buf in self.route_buf.items()} if t else {}
        scores = {n: _host(buf[:t]) for n, buf in self.score_buf.items()} if t else {}
        select = {n: _host(v) for n, (v, _) in self.selected.items()}
        values = {n: _host(v) for n, (_, v) in self.selected.items()}
        self.selected = {}  # the device copies go (stream-ordered: the host copies above run first)
        return BatchDecisions(batch, runs, route, select, scores, values)


def _host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of x, enqueued on the stream (pinned, non-blocking, on CUDA)."""
    if x.device.type != "cuda":
        return x.clone()
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return out.copy_(x, non_blocking=True)


ROW_BLOCK_BYTES = 1 << 27  # bounds the gathered keys of ``scores_at``


def _index_keys(layer, index_dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(keys [S, Di] as stored, their per-key scale float32 [S] or None, the dot's factor) of a full layer's dense
    index rows: fp8 keys with scales (``cpkv.indexer.ref``'s formula), or exact keys times Di^-1/2."""
    if layer.exact:
        from cpkv.model.exact import unpack_rows
        return unpack_rows(index_dense, layer.cfg.index_format), None, layer.cfg.index_head_dim ** -0.5
    from cpkv.indexer import dequantize_index_rows
    k, scale = dequantize_index_rows(index_dense)
    return k, scale, 1.0


def scores_at(layer, p, index_dense: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The indexer's scores of query ``rows`` int64 [t] at dense ``keys`` int [t, n] (-1: none) -> float32 [t, n]
    (NaN where -1): sum_h w_h relu(q_h . k) (times the key's scale, fp8; Di^-1/2 inside, exact), float32 sums."""
    k, scale, factor = _index_keys(layer, index_dense)
    out = torch.full(keys.shape, float("nan"), dtype=torch.float32, device=keys.device)
    step = max(1, ROW_BLOCK_BYTES // max(1, 4 * keys.shape[1] * k.shape[1]))
    for r0 in range(0, rows.shape[0], step):
        r, kk = rows[r0:r0 + step], keys[r0:r0 + step].long()
        safe = kk.clamp(min=0)
        dots = torch.einsum("thd,tnd->thn", p.iq.index_select(0, r).float(), k[safe].float()) * factor
        s = torch.einsum("th,thn->tn", p.iw.index_select(0, r).float(), dots.relu_())
        if scale is not None:
            s = s * scale[safe]
        out[r0:r0 + step] = torch.where(kk >= 0, s, float("nan"))
    return out


def index_scores(layer, p, index_dense: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor,
                 rows: Sequence[int]) -> torch.Tensor:
    """The indexer's scores of query ``rows`` over every dense key -> float32 [len(rows), S], -inf outside each
    row's [ks, ke) (``scores_at`` over all keys)."""
    r = torch.as_tensor(list(rows), dtype=torch.long, device=index_dense.device)
    n = index_dense.shape[0]
    j = torch.arange(n, device=r.device)[None, :]
    visible = (j >= ks[r].long()[:, None]) & (j < ke[r].long()[:, None])
    s = scores_at(layer, p, index_dense, r, torch.where(visible, j, -1))
    return s.masked_fill(~visible, float("-inf"))


# -- the reference's side ------------------------------------------------------------------------------------
@dataclass
class DecisionCount:
    """The decisions of one kind compared on the reference: how many, how many differed, the largest margin, how
    many had a margin over the tolerance (unexplained), and (layer, position, margin) of the largest few."""

    compared: int = 0
    differed: int = 0
    unexplained: int = 0
    max_margin: float = 0.0
    max_allowed: float = 0.0  # the largest margin allowed to a differing decision
    unforced: int = 0  # decisions the run did not record (the reference kept its own)
    noise: float = 0.0  # route: the largest |run's choice value - reference's| of the run's experts
    worst: list = field(default_factory=list)

    def add(self, layer: int, pos: int, margin: float, tol: float) -> None:
        self.differed += 1
        self.unexplained += margin > tol
        self.max_margin = max(self.max_margin, margin)
        self.max_allowed = max(self.max_allowed, tol)
        self.worst = sorted(self.worst + [(layer, pos, margin, tol)], key=lambda x: -x[2] / x[3])[:3]

    def merge(self, other: "DecisionCount") -> None:
        self.compared += other.compared
        self.unforced += other.unforced
        self.noise = max(self.noise, other.noise)
        self.max_allowed = max(self.max_allowed, other.max_allowed)
        self.worst = sorted(self.worst + other.worst, key=lambda x: -x[2] / x[3])[:3]
        self.differed += other.differed
        self.unexplained += other.unexplained
        self.max_margin = max(self.max_margin, other.max_margin)

    def to_json(self, tol: float) -> dict[str, Any]:
        """``tol``: the kind's floor (route) or relative tolerance (index)."""
        return {"compared": self.compared, "differed": self.differed, "unexplained": self.unexplained,
                "max_margin": round(self.max_margin, 6), "tolerance": tol, "unforced": self.unforced,
                "score_noise": round(self.noise, 6), "largest_allowed": round(self.max_allowed, 6),
                "closest": [{"layer": n, "position": p, "margin": round(m, 6), "allowed": round(a, 6)}
                            for n, p, m, a in self.worst]}


class Forced:
    """The reference's tap for one request (module docstring): ``route`` {layer: (int64 [L, k] expert ids, -1 rows
    unknown; float32 [L, k] the run's choice values of them)}, ``select`` {layer: (int32 [L, topk] positions,
    bool [L] known)}; ``device``: "cpu" or "cuda" (tolerances).

    A differing expert choice is explained by rounding when its margin is at most twice the layer's score noise
    (the largest |run's choice value - reference's| over the request's tokens and their chosen experts: both
    scores of a flipped pair moved by at most that much) plus ROUTE_MARGIN's floor; a differing indexer
    selection when its margin is at most INDEX_MARGIN of the query's largest |score|."""

    def __init__(self, route: dict[int, tuple[np.ndarray, np.ndarray]],
                 select: dict[int, tuple[np.ndarray, np.ndarray]], device: str) -> None:
        self.route_rec, self.select_rec = route, select
        self.route_tol, self.index_tol = ROUTE_MARGIN[device], INDEX_MARGIN[device]
        self.counts = {"route": DecisionCount(), "index": DecisionCount()}
        self.rows = slice(None)  # the positions of the reference's current chunk

    def window(self, start: int, end: int) -> None:
        """The reference runs positions [start, end) now (a chunked reference)."""
        self.rows = slice(start, end)

    def route(self, layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = layer.cfg
        scores, choice = route_scores(x, *_router(layer), fused=not layer.exact, backends=layer.backends)
        own = pick_experts(choice, cfg)
        rec = self.route_rec.get(layer.n)
        count = self.counts["route"]
        if rec is None:
            count.unforced += own.shape[0]
            return own, route_weights(scores, own, cfg)
        run, values = (torch.as_tensor(a[self.rows], device=own.device) for a in rec)
        known = run[:, 0] >= 0
        count.compared += int(known.sum())
        count.unforced += int((~known).sum())
        run = torch.where(known[:, None], run, own)
        moved = (values - choice.gather(1, run)).abs().nan_to_num(0.0)[known]  # NaN: a value not recorded
        noise = float(moved.max()) if moved.numel() else 0.0
        count.noise = max(count.noise, noise)
        differ = (own.sort(-1).values != run.sort(-1).values).any(-1).nonzero().flatten()
        if differ.numel():  # every differing token's margin in one pass, read once
            margins = route_margins(choice[differ], own[differ], run[differ], cfg).tolist()
            for t, m in zip(differ.tolist(), margins):
                count.add(layer.n, t, m, 2 * noise + self.route_tol)
        return run, route_weights(scores, run, cfg)

    def select(self, layer, p, index_dense: torch.Tensor, plan, topk: torch.Tensor) -> torch.Tensor:
        rec = self.select_rec.get(layer.n)
        count = self.counts["index"]
        if rec is None:
            count.unforced += topk.shape[0]
            return topk
        sel, values, known = (torch.as_tensor(a[self.rows], device=topk.device) for a in rec)
        count.compared += int(known.sum())
        count.unforced += int((~known).sum())
        run = torch.where(known[:, None], sel.to(topk.dtype), topk)
        rows = known.nonzero().flatten()
        scale = _row_scale(layer, p, index_dense, plan, rows)
        ref = scores_at(layer, p, index_dense, rows, run[rows])
        moved = ((values[rows] - ref).abs().nan_to_num(0.0) / scale[:, None]).amax(-1) if rows.numel() else ref
        noise = float(moved.max()) if moved.numel() else 0.0
        count.noise = max(count.noise, noise)
        differ = (topk.sort(-1).values != run.sort(-1).values).any(-1)
        diff_rows = differ.nonzero().flatten().tolist()
        if diff_rows:  # every differing query's margin in one pass (per block of rows), read once
            margins: list[float] = []
            step = max(1, ROW_BLOCK_BYTES // max(1, 4 * index_dense.shape[0] * max(1, layer.cfg.index_n_heads)))
            for r0 in range(0, len(diff_rows), step):
                r = diff_rows[r0:r0 + step]
                scores = index_scores(layer, p, index_dense, plan.ks, plan.ke, r)
                at = torch.as_tensor(r, dtype=torch.long, device=topk.device)
                margins += index_margins(scores, topk[at], run[at]).tolist()
            for t, m in zip(diff_rows, margins):
                count.add(layer.n, t, m, 2 * noise + self.index_tol)
        return run

    def moe_out(self, layer, y: torch.Tensor) -> torch.Tensor:
        return y

    def summary(self) -> dict[str, DecisionCount]:
        return self.counts


def route_margin(choice: torch.Tensor, own: torch.Tensor, run: torch.Tensor, cfg) -> float:
    """How far the reference's own routing scores (``choice`` float32 [E]) are from preferring the run's experts
    ``run`` [k] to its own ``own`` [k]: max choice of an expert only it picked - min choice of one only the run
    picked, among the groups both kept; with group-limited routing, the same over the groups' scores when the
    groups differ, halved (a group's score is the sum of two choice values, so rounding moves it twice as far):
    the margin compares with twice the choice values' noise either way. <= 0: no preference (0)."""
    return float(route_margins(choice[None], own[None], run[None], cfg)[0])


def route_margins(choice: torch.Tensor, own: torch.Tensor, run: torch.Tensor, cfg) -> torch.Tensor:
    """``route_margin`` of n tokens at once: choice float32 [n, E], own / run int64 [n, k] -> float32 [n]."""
    n = choice.shape[0]
    e_per = cfg.n_routed_experts // cfg.n_group
    keep = torch.ones_like(choice, dtype=torch.bool)
    group_gap = torch.zeros(n, dtype=choice.dtype, device=choice.device)
    if cfg.topk_group < cfg.n_group:
        gs = group_scores(choice, cfg)
        mine = kept_groups(choice, cfg)
        theirs = torch.zeros_like(mine).scatter_(1, run // e_per, True)
        differ = (mine != theirs).any(-1)  # a group's score sums two choice values: twice their noise, halved here
        group_gap = torch.where(differ, gaps(gs, mine & ~theirs, theirs & ~mine) / 2, 0.0)
        keep = (mine & theirs).repeat_interleave(e_per, dim=1)
    o = torch.zeros_like(keep).scatter_(1, own, True)
    r = torch.zeros_like(keep).scatter_(1, run, True)
    return torch.maximum(group_gap, gaps(choice, o & ~r & keep, r & ~o & keep))


def _row_scale(layer, p, index_dense: torch.Tensor, plan, rows: torch.Tensor) -> torch.Tensor:
    """Each query row's largest |score| over the keys it sees (float32 [len(rows)]; 1 where it is 0): the scale
    of its selection margins and score noise."""
    out = torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device)
    step = max(1, ROW_BLOCK_BYTES // max(1, 4 * index_dense.shape[0] * max(1, layer.cfg.index_n_heads)))
    for r0 in range(0, rows.shape[0], step):
        r = rows[r0:r0 + step].tolist()
        m = index_scores(layer, p, index_dense, plan.ks, plan.ke, r).abs()
        m = torch.where(torch.isfinite(m), m, 0.0).amax(-1)
        out[r0:r0 + step] = torch.where(m > 0, m, 1.0)
    return out


def index_margins(scores: torch.Tensor, own: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
    """The indexer's margins of n queries at once: scores float32 [n, S] (the reference's, -inf where not
    visible), own / run int [n, k] (-1: none) -> float64 [n]: the gap of ``gaps`` over the keys only the reference
    picked and those only the run picked, relative to each query's largest |visible score| (1 where it has none
    or it is 0); inf where the run picked a key the query cannot see."""
    n, S = scores.shape
    o = torch.zeros((n, S + 1), dtype=torch.bool, device=scores.device)  # column S: where the -1 entries go
    r = torch.zeros_like(o)
    o.scatter_(1, torch.where(own >= 0, own.long(), S), True)
    r.scatter_(1, torch.where(run >= 0, run.long(), S), True)
    o, r = o[:, :S], r[:, :S]
    seen = torch.isfinite(scores)
    scale = torch.where(seen, scores.abs(), 0.0).amax(-1).double()
    scale = torch.where(scale > 0, scale, 1.0)
    bad = (r & ~seen).any(-1)  # the run picked a key the query cannot see
    gap = gaps(scores, o & ~r, r & ~o).double() / scale
    return torch.where(bad, float("inf"), gap)


def gaps(values: torch.Tensor, only_mine: torch.Tensor, only_theirs: torch.Tensor) -> torch.Tensor:
    """Per row of values [n, m]: max over only_mine - min over only_theirs, at least 0; 0 where either is empty
    (or where the difference is not a number: -inf on both sides)."""
    hi = torch.where(only_mine, values, float("-inf")).amax(-1)
    lo = torch.where(only_theirs, values, float("inf")).amin(-1)
    both = only_mine.any(-1) & only_theirs.any(-1)
    return torch.where(both, (hi - lo).clamp(min=0.0), 0.0).nan_to_num(0.0, posinf=float("inf"))
