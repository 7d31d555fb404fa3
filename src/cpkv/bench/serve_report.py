"""What ``cpkv bench serve`` reports from its per-request records: percentiles, throughput, cache hits, the
cost model calibrated on the requests that ran alone, and ``cpkv replay``'s prediction for the same run.

Calibration. A request that was the only one in flight (no other request's [sent, end] overlaps its
[sent, first token]) took, under ``cpkv.scheduler.costs.CostModel``, the sum over its chunks of::

    batch_overhead_s + (rows / cp) * linear_s_per_token + (indexer pairs / cp) * indexer_s_per_pair
                     + (attention pairs / cp) * attention_s_per_pair + keys * compose_s_per_token

(a chunk covers prompt positions [s, t) after the cached prefix, chunks of ``chunk_size`` new tokens;
indexer pairs ``causal_work(s, t)``, attention pairs each query's min(visible keys, topk), keys the
chunk's dense buffer: ceil(t / page) pages; zigzag splits rows and pairs evenly over the cp ranks).
The five unit costs are fitted to those requests' TTFTs by non-negative least squares; the result is a
``costs`` object ``cpkv replay --costs`` takes (``layer_overhead_s`` 0: the intercept holds it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from cpkv.bench.serve import Record
from cpkv.layout import causal_work
from cpkv.scheduler.costs import CostModel
from cpkv.scheduler.replay import ReplayConfig, percentile, replay
from cpkv.scheduler.trace import TraceRequest

COST_FIELDS = ("batch_overhead_s", "linear_s_per_token", "indexer_s_per_pair", "attention_s_per_pair",
               "compose_s_per_token")
QUANTILES = (50, 90, 99)


def dist(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 (numpy's linear interpolation), mean and max; None when there are no values."""
    v = sorted(values)
    if not v:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    return {**{f"p{q}": percentile(v, q) for q in QUANTILES}, "mean": sum(v) / len(v), "max": v[-1]}


def summary(records: Sequence[Record]) -> dict[str, Any]:
    """The run's figures: counts by status and error, TTFT / e2e / TPOT / inter-token latency distributions (the
    last two from streamed chunks), throughput, hit ratio."""
    ok = [r for r in records if r.status == "ok"]
    sent = [r for r in records if r.sent_s is not None]
    span = (max(r.end_s for r in sent) - min(r.sent_s for r in sent)) if sent else 0.0
    counted = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records), "sent": len(sent), "completed": len(ok),
        "failed": sum(r.status == "error" for r in records),
        "not_sent": sum(r.status == "not_sent" for r in records),
        "skipped_parent_failed": sum(r.status == "skipped" for r in records),
        "errors": _errors(records),
        "ttft_s": dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "e2e_s": dist([r.e2e_s for r in ok if r.e2e_s is not None]),
        "tpot_s": dist([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": dist([gap for r in ok for gap in r.itl_s]),
        "duration_s": span,
        "request_throughput": len(ok) / span if span > 0 else None,
        "input_token_throughput": prompt / span if span > 0 else None,
        "output_token_throughput": sum(r.completion_tokens for r in ok) / span if span > 0 else None,
        "prompt_tokens": prompt, "completion_tokens": sum(r.completion_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in counted),
        "cache_hit_ratio": (sum(r.cached_tokens for r in counted) / sum(r.prompt_tokens for r in counted)
                            if counted and sum(r.prompt_tokens for r in counted) else None),
        "cached_tokens_reported": len(counted),
        "follow_ups_without_parent_output": sum(r.parent_output_missing for r in records),
    }


def _errors(records: Sequence[Record]) -> dict[str, int]:
    """error message (numbers and ids kept, cut at 120 characters) -> count, most frequent first."""
    out: dict[str, int] = {}
    for r in records:
        if r.status == "error":
            key = (r.error or "unknown")[:120]
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# -- calibration -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """The server's batch geometry, as ``cpkv serve`` was started (for the features and the replay)."""

    cp: int = 2
    chunk_size: int = 512
    page_size: int = 64
    topk: int = 64


def features(prompt: int, cached: int, g: Geometry) -> list[float]:
    """One request alone: its chunks' sums of [batches, rows/cp, indexer pairs/cp, attention pairs/cp, keys]."""
    f = [0.0] * len(COST_FIELDS)
    s = cached
    while True:
        t = min(prompt, s + g.chunk_size)
        keys = -(-t // g.page_size) * g.page_size
        part = (1.0, (t - s) / g.cp, causal_work(s, t) / g.cp, _topk_pairs(s, t, g.topk) / g.cp, float(keys))
        f = [a + b for a, b in zip(f, part)]
        s = t
        if s >= prompt:
            return f


def _topk_pairs(start: int, end: int, topk: int) -> int:
    """Sum over positions p in [start, end) of min(p + 1, topk)."""
    mid = min(max(topk, start), end)
    return causal_work(start, mid) + (end - mid) * topk


def isolated(records: Sequence[Record]) -> list[Record]:
    """Completed requests whose [sent, first token] no other sent request's [sent, end] overlaps."""
    ok = [r for r in records if r.status == "ok" and r.ttft_s is not None]
    spans = sorted((r.sent_s, r.end_s) for r in records if r.sent_s is not None and r.end_s is not None)
    out = []
    for r in ok:
        first = r.sent_s + r.ttft_s
        overlaps = sum(1 for a, b in spans if a < first and b > r.sent_s)
        if overlaps <= 1:  # itself
            out.append(r)
    return out


def fit_costs(records: Sequence[Record], g: Geometry) -> dict[str, Any]:
    """``{"costs": {...} | None, "calibration": {...}}`` fitted on the requests that ran alone."""
    alone = isolated(records)
    need = len(COST_FIELDS) + 1
    if len(alone) < need:
        return {"costs": None, "calibration": {
            "requests_used": len(alone), "reason": f"needs at least {need} requests that ran alone, got {len(alone)} "
                                                   "(run --closed-loop, where every request runs alone)"}}
    X = np.array([features(r.prompt_tokens, r.cached_tokens or 0, g) for r in alone])
    y = np.array([r.ttft_s for r in alone])
    coef = nnls_scaled(X, y)
    pred = X @ coef
    ss = float(((y - y.mean()) ** 2).sum())
    costs = {k: float(c) for k, c in zip(COST_FIELDS, coef)}
    costs.update(layer_overhead_s=0.0, topk=g.topk)
    return {"costs": costs, "calibration": {
        "requests_used": len(alone), "rmse_s": float(np.sqrt(((y - pred) ** 2).mean())),
        "r2": 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else None,
        "max_rel_error": float(np.max(np.abs(pred - y) / np.maximum(y, 1e-9))),
        "measured_ttft_s": dist(y.tolist()), "fitted_ttft_s": dist(pred.tolist()),
        "geometry": vars(g)}}


def nnls_scaled(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||X c - y|| over c >= 0 (Lawson-Hanson on unit-norm columns, float64)."""
    norms = np.linalg.norm(X, axis=0)
    norms[norms == 0] = 1.0
    return nnls(X / norms, y) / norms


def nnls(A: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """Lawson-Hanson active-set non-negative least squares (float64)."""
    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        w = A.T @ (b - A @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, np.abs(w).max()):
            return x
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


# -- replay's prediction for the same run ----------------------------------------------------------
def sent_trace(records: Sequence[Record]) -> list[TraceRequest]:
    """The completed requests as a replay trace: arrival = when sent, prompt_len as sent, parent kept."""
    ok = sorted((r for r in records if r.status == "ok"), key=lambda r: r.sent_s)
    seen: set[tuple[str, Hashable]] = set()
    out = []
    for r in ok:
        parent = r.parent if r.parent is not None and (type(r.parent).__name__, r.parent) in seen else None
        out.append(TraceRequest(r.id, r.sent_s, r.prompt_tokens, None, parent, len(out) + 1))
        seen.add((type(r.id).__name__, r.id))
    return out


def predict(records: Sequence[Record], costs: CostModel, cfg: ReplayConfig) -> dict[str, Any]:
    """``cpkv replay``'s TTFT distribution for the completed requests, sent when they were, under ``costs``."""
    trace = sent_trace(records)
    if not trace:
        return {"ttft_s": dist([]), "requests": 0, "rejected": 0}
    t0 = trace[0].arrival
    trace = [TraceRequest(r.id, r.arrival - t0, r.prompt_len, None, r.parent, r.line) for r in trace]
    res = replay(trace, cfg, costs)
    s = res.summary()
    return {"ttft_s": dist(res.ttft), "requests": len(trace), "rejected": s["rejected"],
            "rejected_by_reason": s["rejected_by_reason"], "cache_hit_ratio": s["cache_hit_ratio"],
            "policy": cfg.policy, "cp": cfg.cp, "chunk_size": cfg.chunk_size, "page_size": cfg.page_size,
            "max_requests": cfg.max_requests, "kv_tokens_per_rank": cfg.kv_tokens_per_rank}
