"""Where a batch's time goes: its GPU kernels (from a profiled run) grouped by part, against its wall time.

    parts([(kernels, timed wall_s), ...]) -> {part: {"ms", "share"}} + gpu_busy_ms + wall_ms + timed_wall_ms
    kernels: [(name, start us, end us)] of one batch, from its start (``engine.instruments``, ``MeasureConfig.profile``)

Parts are read off kernel names (cuBLAS/CUTLASS GEMMs, the Triton/Gluon kernels by function name, torch's
own kernels as elementwise; block-scaled fp8 GEMMs, cuBLAS's e4m3 ones, the grouped Triton kernel and the
indexer's ``_head_weights`` are GEMMs); ``quant`` holds the token-KV quant/dequant kernels, the fp8 linear layers'
activation quantisation (``_act_quant``, ``_swiglu_quant``) and every torch kernel converting to or from fp8.
The fused elementwise kernels that quantise as they go (``_add_rms_norm``, ``_token_rows``, ``_index_rows``) count
as elementwise.
``host_gap`` = the profiled batch's wall (from its start to its last kernel's end) - its GPU busy time (the union
of kernel intervals): time the GPU waited for the host. A batch's start is where the host began it, or, chained on
the batch before (``Instruments``: one profiler over the run, so batches chain as unprofiled), where the batch
before's last kernel ended. Shares are of that profiled wall (``wall_ms``); ``timed_wall_ms`` is the timed runs'
median, whose kernels may run at other clocks than the profiled run's (under the power cap a cached batch can run
~10 % slower timed than profiled), so the host gap is measured against the profiled wall only. ``idle_ms`` =
``host_gap``'s ms (its older name).
Kernels that overlap (a prefetch on a side stream) count in their part each, so parts may add up to more
than the busy time. No torch import.
"""
from __future__ import annotations

import re
from typing import Iterable, Sequence

TOP = 15  # kernels listed by total time, with their part (to audit the name rules)
PARTS = ("gemm", "indexer_logits", "topk", "attention", "compose", "quant", "elementwise", "host_gap")
LABELS = {
    "gemm": "projection / MLP GEMMs", "indexer_logits": "indexer logits", "topk": "top-k",
    "attention": "sparse attention", "compose": "compose (gather, barrier)", "quant": "quant / dequant",
    "elementwise": "norms, RoPE, elementwise, copies", "host_gap": "host gap (wall - GPU busy)",
}
_RULES = (  # first match wins
    ("indexer_logits", re.compile(r"mqa_logits")),
    ("topk", re.compile(r"topk")),
    ("attention", re.compile(r"sparse_mla|sparse_attn")),  # cpkv's kernels; FlashMLA's (a CUTLASS template)
    ("compose", re.compile(r"page_gather|_barrier")),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|gemv|splitk|_grouped_v|_grouped_ws|_head_weights", re.I)),  # fp8 GEMMs too
    ("quant", re.compile(r"^_?(de)?quant\b|_act_quant|_swiglu_quant|float8|fp8|e4m3", re.I)),
)


def classify(name: str) -> str:
    """The part a kernel named ``name`` belongs to (``elementwise`` when no rule matches)."""
    for part, rule in _RULES:
        if rule.search(name):
            return part
    return "elementwise"


def busy_us(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def idle_gaps(kernels: Sequence[tuple[str, float, float]], top: int = 5) -> list[tuple[float, float]]:
    """The ``top`` longest stretches with no kernel running, from time 0 (the batch start) to the last
    kernel's end: [(start ms, length ms)], longest first."""
    gaps, end = [], 0.0
    for a, b in sorted((a, b) for _, a, b in kernels):
        if a > end:
            gaps.append((round(end / 1e3, 3), round((a - end) / 1e3, 3)))
        end = max(end, b)
    return sorted(gaps, key=lambda g: -g[1])[:top]


def idle_between(kernels: Sequence[tuple[str, float, float]], top: int = 8,
                 over_ms: float = 0.5) -> dict:
    """Idle stretches of one batch with the kernels around them: ``top`` longest as (start ms, length ms,
    kernel before or "" at the batch start, kernel after), and the count and total of those over ``over_ms``."""
    stretches, end, last = [], 0.0, ""
    for name, a, b in sorted(kernels, key=lambda k: k[1]):
        if a > end:
            stretches.append((round(end / 1e3, 3), round((a - end) / 1e3, 3), last[:60], name[:60]))
        if b >= end:
            end, last = b, name
    long = [g for g in stretches if g[1] > over_ms]
    return {"top": sorted(stretches, key=lambda g: -g[1])[:top], f"over_{over_ms}_ms": len(long),
            f"over_{over_ms}_ms_total": round(sum(g[1] for g in long), 3)}


def parts(batches: Sequence[tuple[Sequence[tuple[str, float, float]], float]]) -> dict:
    """batches: [(kernels of one batch from its start, its timed wall seconds)] -> per part ms and share of the
    summed profiled wall, the GPU busy time (per batch, summed), the host gap (module docstring) and each batch's
    longest idle gaps."""
    ms = {p: 0.0 for p in PARTS}
    by_name: dict[str, float] = {}
    busy = wall = timed = 0.0
    n = 0
    for kernels, wall_s in batches:
        for name, a, b in kernels:
            ms[classify(name)] += (b - a) / 1e3
            by_name[name] = by_name.get(name, 0.0) + (b - a) / 1e3
        busy += busy_us((a, b) for _, a, b in kernels) / 1e3
        wall += max((b for _, _, b in kernels), default=0.0) / 1e3
        timed += wall_s * 1e3
        n += len(kernels)
    ms["host_gap"] = max(wall - busy, 0.0)
    return {"parts": {p: {"ms": round(v, 3), "share": round(v / wall, 4) if wall else 0.0} for p, v in ms.items()},
            "gpu_busy_ms": round(busy, 3), "wall_ms": round(wall, 3), "timed_wall_ms": round(timed, 3), "kernels": n,
            "idle_ms": round(ms["host_gap"], 3),
            "idle_gaps": [idle_gaps(k) for k, _ in batches],
            "idle_between": [idle_between(k) for k, _ in batches],
            "top": [(name[:120], round(v, 3), classify(name)) for name, v in
                    sorted(by_name.items(), key=lambda x: -x[1])[:TOP]]}
