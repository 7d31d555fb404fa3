"""A run's discrete decisions per request, assembled from every rank's batches (no torch import).

Each rank sends, per batch, the decisions of its own query tokens (``cpkv.engine.taps.BatchDecisions``). A
request's reference reruns its whole prompt, so it needs a decision for every position: those the request
computed itself, and those of its cached prefix, which an earlier request computed. The prefix's come from the
latest request that computed that position with the same tokens up to it in a batch before this request's
first one (the KV it hit is that computation's).

    log = DecisionLog.build(per_rank_batches, tokens)     # tokens: {request id: its prompt's token ids}
    route, select = log.for_request(rid)                   # cpkv.engine.taps.Forced's inputs
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np


@dataclass
class _Own:
    """What one request computed itself: per position the batch (-1: not computed by it), per layer the arrays."""

    batch: np.ndarray
    route: dict[int, np.ndarray] = field(default_factory=dict)    # int16 [L, k], -1 rows unknown
    values: dict[int, np.ndarray] = field(default_factory=dict)   # float32 [L, k]: their choice values
    select: dict[int, np.ndarray] = field(default_factory=dict)   # int32 [L, topk]
    svalues: dict[int, np.ndarray] = field(default_factory=dict)  # float32 [L, topk]: the run's scores of them
    chosen: dict[int, np.ndarray] = field(default_factory=dict)   # bool [L]: the selection was recorded


class DecisionLog:
    """Per request, the decisions of every position of its prompt (module docstring)."""

    def __init__(self, own: dict[Hashable, _Own], tokens: dict[Hashable, Sequence[int]]) -> None:
        self.own, self.tokens = own, tokens

    @classmethod
    def build(cls, batches: Sequence[Any], tokens: dict[Hashable, Sequence[int]]) -> "DecisionLog":
        """``batches``: every rank's BatchDecisions (numpy form), any order."""
        own: dict[Hashable, _Own] = {}
        for b in batches:
            at = 0
            for rid, s, e, _ in b.runs:
                n = e - s
                o = own.get(rid)
                if o is None:
                    o = own[rid] = _Own(np.full(len(tokens[rid]), -1, np.int64))
                o.batch[s:e] = b.batch
                for layer, a in b.route.items():
                    _rows(o.route, layer, len(o.batch), a.shape[1], np.int16)[s:e] = a[at: at + n]
                for layer, a in b.route_values.items():
                    _rows(o.values, layer, len(o.batch), a.shape[1], np.float32)[s:e] = a[at: at + n]
                for layer, a in b.select.items():
                    _rows(o.select, layer, len(o.batch), a.shape[1], np.int32)[s:e] = a[at: at + n]
                    o.chosen.setdefault(layer, np.zeros(len(o.batch), bool))[s:e] = True
                for layer, a in b.select_values.items():
                    _rows(o.svalues, layer, len(o.batch), a.shape[1], np.float32)[s:e] = a[at: at + n]
                at += n
        return cls(own, tokens)

    def for_request(self, rid: Hashable) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]],
                                                  dict[int, tuple[np.ndarray, np.ndarray]]]:
        """(route {layer: (int64 [L, k], -1 rows unknown; float32 [L, k] their choice values)}, select {layer:
        (int32 [L, topk], float32 [L, topk] their scores, bool [L] known)}) of
        every position of ``rid``'s prompt: its own, then its cached prefix's from earlier requests."""
        toks = np.asarray(self.tokens[rid])
        length = len(toks)
        mine = self.own.get(rid)
        first = int(mine.batch[mine.batch >= 0].min()) if mine is not None and (mine.batch >= 0).any() else 1 << 62
        src = np.full(length, -1, np.int64)        # the batch that computed each position (its source's)
        route: dict[int, np.ndarray] = {}
        values: dict[int, np.ndarray] = {}
        svalues: dict[int, np.ndarray] = {}
        select: dict[int, np.ndarray] = {}
        known: dict[int, np.ndarray] = {}
        for other_id, o in self.own.items():
            m = length if other_id == rid else min(_common(toks, self.tokens[other_id]), length)
            b = o.batch[:m]
            if other_id == rid:
                take = b >= 0
            else:
                take = (b >= 0) & (b < first) & (b > src[:m]) & (src[:m] < first)
            if not take.any():
                continue
            idx = np.nonzero(take)[0]
            src[idx] = b[idx]
            for layer, a in o.route.items():
                _rows(route, layer, length, a.shape[1], np.int64)[idx] = a[idx]
            for layer, a in o.values.items():
                _rows(values, layer, length, a.shape[1], np.float32)[idx] = a[idx]
            for layer, a in o.select.items():
                _rows(select, layer, length, a.shape[1], np.int32)[idx] = a[idx]
                k = known.setdefault(layer, np.zeros(length, bool))
                k[idx] = o.chosen[layer][idx]
            for layer, a in o.svalues.items():
                _rows(svalues, layer, length, a.shape[1], np.float32)[idx] = a[idx]
        return ({n: (route[n], values[n]) for n in route},
                {n: (select[n], svalues[n], known[n]) for n in select})


def _rows(d: dict[int, np.ndarray], layer: int, length: int, width: int, dtype) -> np.ndarray:
    a = d.get(layer)
    if a is None:
        a = d[layer] = np.full((length, width), -1, dtype)
    return a


def _common(a: np.ndarray, b: Sequence[int]) -> int:
    """The length of the common prefix of two token sequences."""
    b = np.asarray(b)
    n = min(len(a), len(b))
    neq = np.nonzero(a[:n] != b[:n])[0]
    return int(neq[0]) if neq.size else n
