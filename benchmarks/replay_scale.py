"""Replay at scale with a full KV cache (issue 25): wall time of a 100K-request built-in trace on the CPU.

    PYTHONPATH=src python3 benchmarks/replay_scale.py [--trace fresh|conversations] [--requests 100000]
        [--scale 0.01] [--kv-tokens-per-rank N] [--scan] [--max-seconds S] [--json]

A 100K-request trace (seed 0) through ``cpkv.scheduler.replay`` (solo policy, shared KV, cp 8, page 64, the
default KV budget of ``cpkv replay``), the cache full for most of the run, so that nearly every admission evicts.
``conversations``: the built-in multi-turn trace (lengths x ``--scale``; chains share prefixes, so the cache
holds few leaves); ``fresh``: every request a fresh prompt of 1-5 pages (the cache is mostly leaves, the
worst case for an eviction that scans them; ``--scale`` is ignored). It
prints the seconds per 10,000 requests (stderr), then the total wall time, the requests replayed, the pages
evicted and when the first eviction happened. ``--scan`` puts back the eviction of before issue 25 (every
eviction call heapifies every unlocked device leaf) for comparison; ``--max-seconds`` stops a run early (the
report then says how many requests were done). Pure Python: no torch, no GPU.
"""
from __future__ import annotations

import argparse
import heapq
import json
import signal
import sys
import time

from cpkv.kvcache.prefix_cache import PrefixCache
from cpkv.scheduler.replay import ReplayConfig, replay
from cpkv.scheduler.trace import BuiltinShape, builtin_trace

FRESH = BuiltinShape(fresh_share=1.0, fresh_len=(64, 320))  # every request a fresh prompt of 1-5 pages


class _Stop(Exception):
    pass


def scan_evict(self: PrefixCache, num_pages: int, owner: int | None = None, on_spill=None) -> int:
    """The eviction before issue 25: a heap of every unlocked device leaf, built on each call."""
    heap = [(n.last_use, n.nid, n) for n in self._device_leaves if n.lock == 0]
    heapq.heapify(heap)
    freed = 0
    while freed < num_pages and heap:
        _, _, node = heapq.heappop(heap)
        if node not in self._device_leaves or node.lock:
            continue
        counts = owner is None or node.owner == owner
        parent = self._evict_device(node, on_spill)
        freed += int(counts)
        if parent is not None and parent in self._device_leaves and parent.lock == 0:
            heapq.heappush(heap, (parent.last_use, parent.nid, parent))
    return freed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", choices=("conversations", "fresh"), default="fresh")
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--scale", type=float, default=0.01, help="built-in trace length multiplier (default 0.01)")
    p.add_argument("--kv-tokens-per-rank", type=int, default=None,
                   help="KV budget of one rank (default: the cost model's, as `cpkv replay`: 423,398 at cp 8)")
    p.add_argument("--scan", action="store_true", help="the former eviction (scan every leaf), for comparison")
    p.add_argument("--max-seconds", type=float, default=0, help="stop after this many seconds (0: never)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    trace = (builtin_trace(args.requests, seed=0, scale=args.scale) if args.trace == "conversations"
             else builtin_trace(args.requests, seed=0, shape=FRESH))
    cfg = ReplayConfig(kv_tokens_per_rank=args.kv_tokens_per_rank)
    if args.scan:
        PrefixCache.evict = scan_evict  # type: ignore[method-assign]
    state = {"done": 0, "first_evict_at": None, "marks": [], "evicted": 0, "leaves": 0}
    original = PrefixCache._evict_device
    t0 = time.perf_counter()

    def evict_device(self, node, on_spill):  # notes when the cache first filled
        if state["first_evict_at"] is None:
            state["first_evict_at"] = (state["done"], round(time.perf_counter() - t0, 2))
        state["evicted"] += 1
        state["leaves"] = max(state["leaves"], len(self._device_leaves))
        return original(self, node, on_spill)

    PrefixCache._evict_device = evict_device  # type: ignore[method-assign]

    def progress(k: int) -> None:
        before, state["done"] = state["done"], state["done"] + k
        if state["done"] // 10_000 > before // 10_000:
            dt = time.perf_counter() - t0
            state["marks"].append((state["done"], round(dt, 2)))
            print(f"{state['done']:>7} requests  {dt:7.1f} s", file=sys.stderr, flush=True)

    if args.max_seconds:
        signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(_Stop()))
        signal.setitimer(signal.ITIMER_REAL, args.max_seconds)
    finished, result = True, None
    try:
        result = replay(trace, cfg, progress=progress)
    except _Stop:
        finished = False
    wall = time.perf_counter() - t0
    signal.setitimer(signal.ITIMER_REAL, 0)
    report = {"trace": args.trace, "requests": args.requests, "scale": args.scale, "kv_tokens_per_rank": args.kv_tokens_per_rank,
              "eviction": "scan" if args.scan else "heap", "finished": finished, "done": state["done"],
              "wall_s": round(wall, 2), "first_eviction": state["first_evict_at"],
              "evicted_pages": state["evicted"], "max_leaves_at_eviction": state["leaves"], "completed": None, "marks": state["marks"]}
    if result is not None:
        s = result.summary()
        report.update(completed=s["completed"], rejected=s["rejected"], cache_hit_ratio=round(s["cache_hit_ratio"], 4))
    if args.json:
        print(json.dumps(report))
    else:
        fill = state["first_evict_at"]
        print(f"{report['eviction']} eviction: {state['done']} of {args.requests} requests in {wall:.1f} s"
              + ("" if finished else " (stopped by --max-seconds)") + f", {state['evicted']} pages evicted (up to {state['leaves']} device leaves)"
              + (f"; cache full from request {fill[0]} ({fill[1]} s)" if fill else "; the cache never filled"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
