"""Batch cost model for the replay: seconds of one prefill forward. No torch import.

Defaults: GLM-5 on 8×H200 (estimates from FLOP and byte counts at stated efficiencies, and the compose
time of a traced 544K-key batch measured by ``cpkv bench compose``, BENCHMARKS.md). Every figure is per GPU, all
layers included; a batch takes as long as its busiest rank::

    t = batch_overhead_s + num_layers * layer_overhead_s
      + max over ranks r of ( rows_r * linear_s_per_token
                              + indexer_pairs_r * indexer_s_per_pair      # (query, visible key) pairs
                              + attention_pairs_r * attention_s_per_pair )  # (query, min(visible, topk))
      + shared KV:     keys * compose_s_per_token                           # peers' pages, every rank
        replicated KV: keys * gather_s_per_token + new_tokens * allgather_s_per_token

``keys``: the batch's dense-buffer tokens (prefix + new pages). A JSON file (``--costs``) replaces any
subset of the fields: ``{"linear_s_per_token": 8e-5, "compose_s_per_token": 1.0e-7}``. The ``--json``
report of ``cpkv bench attention|indexer|compose`` works as such a file too: its ``"costs"`` object holds
the unit costs that bench measured (``unit_costs_*`` below), and several files apply in order. Every figure
read is checked against its field's range (``RANGES``: finite, positive where it divides, whole where it
counts): a bad one is one ``ConfigError`` naming the file and the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from cpkv.errors import ConfigError
from cpkv.files import input_problem
from cpkv.layout import causal_work
from cpkv.scheduler.batch import Batch


MAX_COSTS_BYTES = 16 << 20  # a --costs file


@dataclass(frozen=True)
class Range:
    """A cost field's range: ``low`` (excluded when ``low_open``) .. ``high``; ``integer``: a whole number;
    ``why``: the reason for the bound, named in the error."""

    low: float
    high: float
    low_open: bool = False
    integer: bool = False
    why: str = ""

    def holds(self, v: float) -> bool:
        above = v > self.low if self.low_open else v >= self.low
        return above and v <= self.high and (not self.integer or float(v).is_integer())

    def text(self) -> str:
        what = "an integer" if self.integer else "a finite number"
        return f"{what} {'>' if self.low_open else '>='} {_num(self.low)} and <= {_num(self.high)}"


def _num(x: float) -> str:
    """1073741824 -> '2^30', 1e15 -> '1e+15', 0.0 -> '0'."""
    if float(x).is_integer() and x >= 1 << 20 and int(x) & (int(x) - 1) == 0:
        return f"2^{int(x).bit_length() - 1}"
    return f"{x:g}"


SECONDS = Range(0.0, 1e6)  # an overhead or a unit cost: 0 (free) up to 11 days per unit
BYTES = Range(0.0, 1e15)   # up to a petabyte
# every field's range (the others: SECONDS), checked whenever a cost file or object is read (CostModel.updated)
RANGES: dict[str, Range] = {
    "num_layers": Range(1, 1 << 16, integer=True), "topk": Range(1, 1 << 24, integer=True),
    "hbm_bytes": Range(0.0, 1e15, low_open=True, why="a GPU's memory"),
    "mem_fraction": Range(0.0, 1.0, low_open=True, why="a share of the GPU's memory"),
    "weight_bytes": BYTES, "reserve_bytes": BYTES,
    "kv_bytes_per_token": Range(0, 1 << 30, low_open=True, integer=True, why="it divides the KV memory"),
}


@dataclass(frozen=True)
class CostModel:
    """Per-GPU unit costs (seconds) and the KV memory budget of one rank (bytes)."""

    batch_overhead_s: float = 4.0e-3       # scheduling, launch, sampling of one forward
    layer_overhead_s: float = 1.5e-4       # per layer: kernel launches, two barriers, norms
    num_layers: int = 78
    linear_s_per_token: float = 9.0e-5     # projections + MoE share: ~80 GFLOP/token at ~0.9 PFLOP/s fp8
    indexer_s_per_pair: float = 3.6e-10    # 40 full layers x (32x128x2 fp8 FLOP + 8 B logits traffic) per pair
    attention_s_per_pair: float = 1.8e-8   # 78 x 64 heads x (576 + 512) x 2 FLOP at ~0.6 PFLOP/s bf16
    topk: int = 2048
    compose_s_per_token: float = 1.15e-7   # the traced batch's symm compose / its 544K keys (BENCHMARKS.md)
    gather_s_per_token: float = 2.0e-8     # replicated: local dense gather, 61.5 KB/token at ~3 TB/s
    allgather_s_per_token: float = 1.5e-7  # replicated: every new token's KV to every rank over NVLink
    hbm_bytes: float = 141e9               # H200
    mem_fraction: float = 0.90
    weight_bytes: float = 7.6e11           # GLM-5 in FP8, whole model (divided over the cp ranks)
    reserve_bytes: float = 8e9             # activations, dense buffers, logits chunk, staging, graphs
    kv_bytes_per_token: int = 56448        # 78 layers x 656 B + 40 full indexer layers x 132 B (glm5 preset)

    @classmethod
    def from_json(cls, *paths: str | Path) -> "CostModel":
        """Defaults updated by each file in turn: a cost object, or a bench report with a ``costs`` object."""
        model = cls()
        for path in paths:
            problem = input_problem(path)
            if problem:
                raise ConfigError(f"{path}: {problem}")
            try:
                with open(path, "rb") as f:  # bounded: a cost file or bench report is a few KiB
                    raw = f.read(MAX_COSTS_BYTES + 1)
                obj = json.loads(raw.decode("utf-8")) if len(raw) <= MAX_COSTS_BYTES else None
            except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or undecodable bytes
                raise ConfigError(f"{path}: cannot read a cost model ({type(exc).__name__}: {str(exc)[:200]})") from None
            if len(raw) > MAX_COSTS_BYTES:
                raise ConfigError(f"{path}: cannot read a cost model (larger than {MAX_COSTS_BYTES >> 20} MiB)")
            if isinstance(obj, dict) and isinstance(obj.get("costs"), dict):
                obj = obj["costs"]
            model = model.updated(obj, str(path))
        return model

    def updated(self, obj: Any, source: str = "costs") -> "CostModel":
        """A copy with the fields of ``obj`` (a JSON object) replaced; unknown or bad values raise."""
        if not isinstance(obj, dict):
            raise ConfigError(f"{source}: expected a JSON object of cost fields, got {type(obj).__name__}")
        known = {f.name: f.type for f in fields(self)}
        unknown = sorted(set(obj) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown cost field(s) {', '.join(unknown)}; known: {', '.join(known)}")
        for k, v in obj.items():
            _check_field(k, v, source)
        return replace(self, **{k: (int(v) if known[k] == "int" else float(v)) for k, v in obj.items()})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def kv_tokens_per_rank(self, cp: int) -> int:
        """KV tokens one rank holds: HBM x fraction − weights/cp − reserve, over bytes per token."""
        free = self.hbm_bytes * self.mem_fraction - self.weight_bytes / cp - self.reserve_bytes
        if free <= 0:
            raise ConfigError(f"no memory left for KV at cp={cp}: weights/cp {self.weight_bytes / cp:.3g} B + reserve "
                              f"exceed {self.hbm_bytes * self.mem_fraction:.3g} B")
        return int(free // self.kv_bytes_per_token)

    # -- a batch's time ----------------------------------------------------------------------------
    def batch_seconds(self, batch: Batch, replicated: bool = False) -> float:
        rank = [0.0] * batch.cp
        for e in batch.entries:
            for w, s, t in _runs(e.writers, e.prefix_len, e.extend_len, batch.page_size):
                rank[w] += ((t - s) * self.linear_s_per_token + causal_work(s, t) * self.indexer_s_per_pair
                            + _topk_pairs(s, t, self.topk) * self.attention_s_per_pair)
        keys = batch.num_slots * batch.page_size
        if replicated:
            kv = keys * self.gather_s_per_token + batch.extend_tokens * self.allgather_s_per_token
        else:
            kv = keys * self.compose_s_per_token
        return self.batch_overhead_s + self.num_layers * self.layer_overhead_s + max(rank) + kv


def _check_field(name: str, value: Any, source: str) -> None:
    """ConfigError naming the file and the field unless ``value`` is a number within the field's range."""
    rng = RANGES.get(name, SECONDS)
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not math.isfinite(value) or not rng.holds(value):
        why = f" ({rng.why})" if rng.why else ""
        raise ConfigError(f"{source}: {name} must be {rng.text()}{why}, got {json.dumps(value)[:80]}")


def _runs(writers: tuple[int, ...], prefix: int, extend: int, P: int):
    """(writer, start, end) of each run of consecutive pages with one writer (sequence positions)."""
    end = prefix + extend
    k = 0
    while k < len(writers):
        j = k
        while j + 1 < len(writers) and writers[j + 1] == writers[k]:
            j += 1
        yield writers[k], prefix + k * P, min(end, prefix + (j + 1) * P)
        k = j + 1


def _topk_pairs(start: int, end: int, topk: int) -> int:
    """Sum over positions p in [start, end) of min(p + 1, topk): keys each query attends to."""
    mid = min(max(topk, start), end)
    return causal_work(start, mid) + (end - mid) * topk


# -- unit costs from `cpkv bench` reports (per GPU, all layers of a GLM-5-shaped model) ---------------
def unit_costs_attention(cases: list[dict[str, Any]], topk: int, num_layers: int = 78) -> dict[str, float]:
    """``attention_s_per_pair`` from ``cpkv bench attention`` cases (``tokens``, ``ms``): time per
    (query, selected key) pair of one layer, times the layers."""
    pairs = sum(c["tokens"] * topk for c in cases)
    seconds = sum(c["ms"] for c in cases) / 1e3
    return {"attention_s_per_pair": num_layers * seconds / pairs} if pairs else {}


def unit_costs_indexer(scenarios: list[dict[str, Any]], num_layers: int = 40) -> dict[str, float]:
    """``indexer_s_per_pair`` from ``cpkv bench indexer`` scenarios: logits + top-k time over the
    (query, visible key) pairs, times the layers that run the indexer (GLM-5: its 40 full layers)."""
    pairs = sum(s["pairs"] for s in scenarios)
    seconds = sum(s["logits_ms"] + s["topk_ms"] for s in scenarios) / 1e3
    return {"indexer_s_per_pair": num_layers * seconds / pairs} if pairs else {}


def unit_costs_compose(modes: dict[str, dict[str, Any]], batch: dict[str, Any], mode: str = "symm") -> dict[str, float]:
    """``compose_s_per_token`` from ``cpkv bench compose``: ``mode``'s per-batch time (all layers) over
    the batch's dense-buffer tokens."""
    keys = batch["prefix_tokens"] + batch["extend_tokens"]
    if mode not in modes or not keys:
        return {}
    return {"compose_s_per_token": modes[mode]["ms_per_batch"] / 1e3 / keys}
