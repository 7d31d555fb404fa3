"""The paged decode step with every shape fixed by (batch bucket B, context bucket L): captured once per bucket as a
CUDA graph and replayed (docs/design.md §11, *The step as one graph*).

    StepInputs   int64 [5, B] on the device: token ids, positions, the pool rows their KV goes to, page-table slots,
                 context lengths (keys each query sees, its own token included). Entries past the step's own are
                 copies of its first: they compute what it computes and write the same bytes to the same rows.
                 A token id < 0 is pending on the host: the entry reads its slot's ``DecodeTable.last``, the token
                 its previous step picked on the device
    step_forward the input tokens (pending ones from ``last``) -> per layer: project -> write the token / index rows -> ``attend_in_place``: (full layers) the
                 indexer's logits over the context read in place through the page table
                 (``kernels.mqa_logits.paged``: [B, L], -inf past each context) -> top-k over [0, context) -> the
                 selected positions as (owner, row) through the table -> sparse decode MLA over those rows in place
                 (``kernels.sparse_mla.decode``; shared layers reuse the selection) -> finish (o_proj, MLP / MoE)
                 -> the LM head over the B rows -> each entry's token, written to its slot's ``last``: the argmax,
                 or, for a step with DRAW_FIELDS, ``sampling.sample_rows`` (the host's ``pick``, in tensors)
    StepGraphs   the graphs, captured on first use per (B, L), sharing one memory pool; the inputs uploaded into
                 the captured buffers (one copy), the table written in place (``DecodeTable``: a grown table drops
                 the graphs made over the old one). ``run``: the logits (copied out); ``replay``: the step launched,
                 its logits and tokens left in the graph's buffers (the pipelined loop, ``DecodeRunner.launch``)

A context of at most top-k keys selects all of them (the top-k of n <= k keys is every key), so one form serves the
dense and the sparse step. Nothing reads a length on the host: the kernels take the contexts on the device, so a
replay with other contexts in the same bucket is the same launches. Graphs run where the step has no expert
exchange (cp 1) on CUDA with cpkv's kernels; with an exchange, ``attend_in_place`` serves the eager step
(``engine.decode.run_decode``'s "static" form: the layer graphs' token-only pieces, the exchange between them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from cpkv.attention.sparse_decode import sparse_decode_mla
from cpkv.engine.paged import DecodeTable, PagedViews
from cpkv.engine.sampling import sample_rows
from cpkv.indexer.paged import paged_logits
from cpkv.indexer.topk import topk_into
from cpkv.model.model import DSAModel

FIELDS = ("ids", "positions", "write_rows", "slot", "ctx")
# a sampling step's rows after FIELDS (``sampling.sample_rows``' parameters; ``decode.draw_rows`` makes them)
DRAW_FIELDS = ("top_k", "keys", "temperature", "top_p", "min_p")


def bucket(n: int, least: int = 1) -> int:
    """The power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()


def context_bucket(longest: int, topk: int) -> int:
    """L, the indexer logits' columns for a step whose longest context is ``longest``: its power of two, at least
    top-k (every shorter context shares one bucket)."""
    return bucket(longest, least=topk)


@dataclass
class StepInputs:
    """One step's inputs on the device (module docstring): ``all`` int64 [5, B], one row per FIELDS name, or
    [10, B] with DRAW_FIELDS' rows after them (a sampling step; its float rows hold float64 bit patterns: one upload
    for all); ``L`` the context bucket (columns of the indexer's logits)."""

    all: torch.Tensor
    L: int

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in FIELDS:
            return self.all[FIELDS.index(name)]
        raise AttributeError(name)

    def draw(self) -> tuple[torch.Tensor, ...] | None:
        """A sampling step's (top_k int64, keys int64, temperature, top_p, min_p float64) [B] each, else None."""
        if self.all.shape[0] == len(FIELDS):
            return None
        ints, floats = self.all[len(FIELDS):len(FIELDS) + 2], self.all[len(FIELDS) + 2:].view(torch.float64)
        return ints[0], ints[1], floats[0], floats[1], floats[2]

    @property
    def B(self) -> int:
        return self.all.shape[1]

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 [B] each: every entry's top-k range over its logits' columns, [0, ctx), made from the inputs as
        they are now: a step makes them once and passes them to each layer (never kept on the inputs, whose buffer
        a captured step reuses with other contexts)."""
        return torch.zeros(self.B, dtype=torch.int32, device=self.all.device), self.ctx.to(torch.int32)


class StepKernels:
    """The paged reads a static step makes, chosen once: cpkv's kernels where the backends run Triton, else their
    references (the CPU path and the tests' oracle)."""

    def __init__(self, model: DSAModel, views: PagedViews) -> None:
        self.model, self.views = model, views

    def logits(self, layer: int, q: torch.Tensor, w: torch.Tensor, table: DecodeTable, s: StepInputs) -> torch.Tensor:
        """float32 [B, L]: the indexer's logits of each entry's context keys, -inf past its context
        (``cpkv.indexer.paged.paged_logits``: the index rows read in place through the table)."""
        out = torch.empty((s.B, s.L), dtype=torch.float32, device=q.device)
        return paged_logits(q, w, self.views.rows(layer, "index"), self.views.bases(layer, "index"), table.owner,
                            table.page, s.slot, s.ctx, self.views.page_size, out, backends=self.model.backends)

    def attend(self, layer: int, q: torch.Tensor, owner: torch.Tensor, row: torch.Tensor, sm_scale: float,
               d_v: int) -> torch.Tensor:
        """bf16 [B, H, d_v]: sparse MLA of each entry over its selected token rows, read in place and dequantised in
        the kernel (``cpkv.attention.sparse_decode``)."""
        return sparse_decode_mla(q, self.views.rows(layer, "token"), owner, row, sm_scale, d_v,
                                 self.model.cfg.token_format, bases=self.views.bases(layer, "token"),
                                 backends=self.model.backends)[0]


def attend_in_place(model: DSAModel, n: int, layer: Any, p: Any, kern: StepKernels, table: DecodeTable,
                    s: StepInputs, bounds: tuple[torch.Tensor, torch.Tensor],
                    sel: tuple[torch.Tensor, torch.Tensor] | None, keep: dict | None = None):
    """Layer ``n``'s attention for the step's entries, every read in place -> (latent [B, H, kv_lora], the selection
    as (owner, row) [B, k]: a full layer's own, a shared layer's the last full layer's). ``bounds``: the step's
    ``s.bounds()``; ``keep``: a full layer's selection goes into it (``step_forward``)."""
    if layer.full:
        P, k = kern.views.page_size, model.cfg.index_topk
        lo, hi = bounds
        logits = kern.logits(n, p.iq, p.iw, table, s)
        top = topk_into(logits, lo, hi, k, torch.empty((s.B, k), dtype=torch.int32, device=lo.device),
                        backends=model.backends)
        if keep is not None:  # by reference, no work (``step_forward``)
            keep.update(selected=top, index_logits=logits)
        top = top.long()
        at = top.clamp(min=0)
        page, rows_of = at // P, s.slot[:, None]
        sel = (table.owner[rows_of, page], torch.where(top >= 0, table.page[rows_of, page] * P + at % P, -1))
    if sel is None:
        raise ValueError(f"layer {n} is a shared indexer layer with no earlier full layer's top-k")
    layer.stats["sparse"] += 1
    return kern.attend(n, p.q, sel[0], sel[1], layer.sm_scale, model.cfg.kv_lora_rank), sel


def step_forward(model: DSAModel, kern: StepKernels, table: DecodeTable, s: StepInputs,
                 keep: dict | None = None, decisions: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 [B, vocab] next-token logits, int64 [B] their tokens) of the step's B entries (module docstring);
    no expert exchange (a step with one runs ``engine.decode.run_decode`` in place). ``keep``: {layer: tensors}
    filled by reference, no work added (under a graph, its own buffers: ``StepGraphs.decisions``): each MoE
    layer's "routed" experts; with ``decisions`` also each full layer's "selected" positions and "index_logits"
    and each MoE layer's "route_choice" (held to the graph's end, [B, L] floats a full layer: a check's, not a
    server's)."""
    cfg, views = model.cfg, kern.views
    ids = torch.where(s.ids >= 0, s.ids, table.last[s.slot])
    h, delta, sel, bounds = model.embed(ids), None, None, s.bounds()
    rot = model.rotary(s.positions)
    for n, layer in enumerate(model.layers):
        p = layer.project(h, rot, delta)
        for kind in cfg.kinds_at(n):
            views.own(n, kind).index_copy_(0, s.write_rows, getattr(p, kind))
        mine = None if keep is None else keep.setdefault(n, {})
        latent, sel = attend_in_place(model, n, layer, p, kern, table, s, bounds, sel, mine if decisions else None)
        layer.keep_choice = mine is not None and decisions
        try:
            h, delta = layer.finish(p.h, latent)
        finally:
            layer.keep_choice = False
        if mine is not None and layer.is_moe:
            mine["routed"] = layer.routed
            if decisions:
                mine["route_choice"], layer.route_choice = layer.route_choice, None
    logits = model.logits(h, delta)
    draw = s.draw()
    if draw is None:
        tokens = logits.argmax(-1)
    else:
        top_k, keys, temperature, top_p, min_p = draw
        tokens = sample_rows(logits, temperature, top_k, top_p, min_p, keys)
    table.last.index_copy_(0, s.slot, tokens)  # padding entries repeat entry 0's slot and token
    return logits, tokens


class StepGraphs:
    """The static step as CUDA graphs per (B, L) bucket (module docstring). ``run(host, t, L)``: ``host`` int64
    [5, t] (numpy, FIELDS order) -> float32 [t, vocab] logits (a copy: the graph's buffer is reused);
    ``replay(host, t, L)`` -> (logits [B, vocab], tokens [B]): the graph's own buffers, valid until the next
    replay is enqueued (stream order)."""

    def __init__(self, model: DSAModel, kern: StepKernels, table: DecodeTable, max_batch: int,
                 upload: Callable[[Any], torch.Tensor], keep_decisions: bool = False) -> None:
        self.model, self.kern, self.table, self.max_batch = model, kern, table, max_batch
        self.keep_decisions = keep_decisions  # ``step_forward``'s ``decisions`` in every graph (a check's)
        self.upload = upload
        self.capture = model.device.type == "cuda"  # elsewhere the padded step runs eagerly (its tests' form)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # per bucket: (graph, its inputs, its output, its decisions' buffers: ``step_forward``'s ``keep``)
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, StepInputs, torch.Tensor, dict]] = {}
        # the last step's decisions (``step_forward``'s ``keep``: {layer: {"routed": int [B, k]; with
        # keep_decisions "selected": int32 [B, top-k] context positions, -1 none; "index_logits": float32 [B, L];
        # "route_choice": float32 [B, E]}}), valid until the next step is enqueued: what ``cpkv bench decode``'s
        # check forces on its reference
        self.decisions: dict = {}
        self.eager: dict[tuple[int, ...], StepInputs] = {}  # without capture: each bucket's inputs buffer
        self.captured, self.capture_s, self.replays = 0, 0.0, 0

    def fits(self, t: int) -> bool:
        return 0 < t <= self.max_batch

    def run(self, host, t: int, L: int) -> torch.Tensor:
        return self.replay(host, t, L)[0][:t].clone()

    def replay(self, host, t: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``host``: int64 [5, t] (FIELDS), or [10, t] with DRAW_FIELDS (a sampling step: its own graphs)."""
        B = bucket(t)
        padded = np.concatenate([host, np.repeat(host[:, :1], B - t, axis=1)], axis=1) if B > t else host
        self.replays += 1
        key = (B, L, self.table.version, host.shape[0])
        if not self.capture:  # eagerly, through the bucket's one inputs buffer as a replay reads it
            inputs = self.eager.get(key)
            if inputs is None:
                inputs = self.eager[key] = StepInputs(torch.empty((host.shape[0], B), dtype=torch.int64,
                                                                  device=self.model.device), L)
            inputs.all.copy_(self.upload(padded))
            self.decisions = {}
            return step_forward(self.model, self.kern, self.table, inputs, self.decisions, self.keep_decisions)
        got = self.graphs.get(key)
        if got is None:
            stale = [k for k in self.graphs if k[2] != self.table.version]
            if stale:  # made over a table since grown: dropped, with their pool (a pool whose graphs are all gone
                torch.cuda.current_stream(self.model.device).synchronize()  # cannot take a new capture: a fresh
                for old in stale:  # one); none may still run (a pipelined step's replay can be in flight)
                    del self.graphs[old]
                self.pool = torch.cuda.graph_pool_handle()
            t0 = time.perf_counter()
            got = self.graphs[key] = self._capture(padded, B, L)
            self.captured += 1
            self.capture_s += time.perf_counter() - t0
        graph, inputs, out, self.decisions = got
        inputs.all.copy_(self.upload(padded), non_blocking=True)
        graph.replay()
        return out

    def _capture(self, padded, B: int, L: int):
        inputs = StepInputs(torch.empty((padded.shape[0], B), dtype=torch.int64, device=self.model.device), L)
        inputs.all.copy_(self.upload(padded))
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        last = self.table.last.clone()  # the warm-up steps pick tokens too: a pending input must read these
        with torch.cuda.stream(side):  # compile and warm every kernel before the capture (the same bytes written)
            for _ in range(2):
                step_forward(self.model, self.kern, self.table, inputs)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        self.table.last.copy_(last)
        graph = torch.cuda.CUDAGraph()
        kept: dict = {}
        with torch.cuda.graph(graph, pool=self.pool):
            out = step_forward(self.model, self.kern, self.table, inputs, kept, self.keep_decisions)
        return graph, inputs, out, kept
