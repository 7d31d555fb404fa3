"""``cpkv bench compose``: per-batch compose time per mode, and the gather kernel against a device copy.

Shape (default): a traced long-context batch — 12 requests, 44.6K query tokens, ~500K cached prefix
tokens (91.8% hit ratio), page 64, GLM-5 row sizes (656 / 132 B). A full indexer layer composes both
kinds, a shared one token rows only; per-layer cost depends only on that, so ``--layers`` full layers
and (for a model with shared layers) ``--layers`` shared layers are timed and the per-batch figure is
``full x n_full + shared x n_shared`` over the model's pattern (GLM-5: 40 full + 38 shared of 78).

Timing: all ranks start each iteration together (a group barrier); a rank's time is host wall time
around ``layers x kinds`` compose calls, with the device synchronised at both ends; the figure is the
slowest rank's median over iterations. On one GPU the ranks share the device (gloo collectives staged
through the host, peer reads from the same HBM): peer-memory figures then measure device memory, not
NVLink, and collective modes pay gloo's host round trips.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from cpkv.compose.modes import MODES, get_mode
from cpkv.compose.plan import ComposePlan
from cpkv.compose.runtime import ComposeRuntime
from cpkv.config import KINDS, AdmissionCaps, CPConfig, preset
from cpkv.bench.timing import event_median_s
from cpkv.dist import RankContext, launch
from cpkv.errors import ConfigError
from cpkv.layout import BatchLayout, build_layout
from cpkv.scheduler.costs import unit_costs_compose

GATHER_CONFIGS = (  # block: int32 elements per unit (capped at the page), num_warps (missing keys:
    # page_gather.triton.DEFAULT_CONFIG's, the first entry); the kernel's one shape, so only these two vary
    {"block": 16384, "num_warps": 8},
    {"block": 16384, "num_warps": 4},
    {"block": 16384, "num_warps": 16},
    {"block": 8192, "num_warps": 8},
    {"block": 4096, "num_warps": 4},
    {"block": 4096, "num_warps": 8},
)


@dataclass(frozen=True)
class BenchConfig:
    cp: int = 2
    device: str = "cuda"
    model: str = "glm5"
    page_size: int = 64
    requests: int = 12
    extend_tokens: int = 44_600
    prefix_tokens: int = 500_000
    layers: int = 4
    iters: int = 3
    modes: tuple[str, ...] = tuple(MODES)
    seed: int = 0
    kernel: bool = True

    def __post_init__(self) -> None:
        """Validate before any rank process starts."""
        CPConfig(self.cp, self.page_size)  # validates cp and page_size
        for key in ("requests", "extend_tokens", "layers", "iters"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"{key} must be an integer >= 1, got {getattr(self, key)!r}")
        if self.extend_tokens < self.requests:
            raise ConfigError(f"extend_tokens must be >= requests (every request needs a new token), got "
                              f"{self.extend_tokens} for {self.requests} requests")
        if not isinstance(self.prefix_tokens, int) or self.prefix_tokens < 0:
            raise ConfigError(f"prefix_tokens must be an integer >= 0, got {self.prefix_tokens!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if not self.modes:
            raise ConfigError("modes: expected at least one compose mode, got none")
        for mode in self.modes:
            get_mode(mode)
        preset(self.model)  # validates the preset name


def traced_batch(cfg: BenchConfig) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]], list[int], int]:
    """(requests, prefix pages, writer page id per current page, pool pages per rank) of the traced shape."""
    rng = np.random.default_rng(cfg.seed)
    P, n = cfg.page_size, cfg.requests
    ext = _split(rng, cfg.extend_tokens, n, 1)
    pre = [p * P for p in _split(rng, cfg.prefix_tokens // P, n, 0)]
    next_id = [1] * cfg.cp
    pages = []
    for p in pre:
        own = []
        for _ in range(p // P):
            o = int(rng.integers(0, cfg.cp))
            own.append((o, next_id[o]))
            next_id[o] += 1
        pages.append(own)
    layout = build_layout(list(zip(pre, ext)), page_size=P, cp=cfg.cp, prefix_pages=pages)
    ids = []
    for c in layout.current_pages:
        ids.append(next_id[c.writer])
        next_id[c.writer] += 1
    return list(zip(pre, ext)), pages, ids, max(next_id) + 1


def _split(rng: np.random.Generator, total: int, n: int, minimum: int) -> list[int]:
    w = rng.uniform(0.3, 1.7, n)
    parts = np.maximum(minimum, np.floor(w / w.sum() * total)).astype(int)
    parts[-1] += total - parts.sum()
    return [int(x) for x in parts]


def _caps(cfg: BenchConfig) -> AdmissionCaps:
    P = cfg.page_size
    ext = -(-cfg.extend_tokens // P) * P
    return AdmissionCaps(chunk_size=ext, cached_tokens=cfg.prefix_tokens + P * cfg.requests,
                         max_requests=cfg.requests)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(cfg: BenchConfig):
    """The timed layers: ``layers`` full indexer layers, then ``layers`` shared ones if the model has any."""
    model = preset(cfg.model)
    shared = len(model.full_layers) < model.num_layers
    pattern = ("full",) * cfg.layers + (("shared",) * cfg.layers if shared else ())
    return dataclasses.replace(model, num_layers=len(pattern), indexer_pattern=pattern, mlp_pattern=())


def rank_worker(ctx: RankContext, cfg: BenchConfig) -> dict[str, Any]:
    """One rank: build the runtime and the traced batch, time every mode; rank 0 also runs the kernel bench."""
    model = bench_model(cfg)
    reqs, pages, ids, num_pages = traced_batch(cfg)
    rt = ComposeRuntime.create(ctx, model, num_pages=num_pages, page_size=cfg.page_size, caps=_caps(cfg))
    for k in KINDS:
        buf = rt.pool.buffers[k]
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device=buf.device))
    out: dict[str, Any] = {"rank": ctx.rank, "modes": {}, "peer_memory": rt.mem.kind, "triton": rt.use_triton}
    layout = build_layout(reqs, page_size=cfg.page_size, cp=cfg.cp, prefix_pages=pages)
    out["plan_ms"], out["layout_ms"] = _time_plan(rt, reqs, pages, ids, cfg)
    out["plan_ms_host_only"], _ = _time_plan(rt, reqs, pages, ids, cfg, torch.device("cpu"))
    if cfg.kernel and rt.use_triton:  # rank 0 sweeps the gather configs; every rank then uses the best
        from cpkv.kernels.page_gather import triton as page_gather
        kern = kernel_bench(rt.device) if ctx.rank == 0 else None
        kern = ctx.all_gather_object(kern)[0]
        best = {k: v for k, v in kern.get("best", {}).items() if k in page_gather.DEFAULT_CONFIG}
        page_gather.DEFAULT_CONFIG.update(best)
        out["kernel"] = kern if ctx.rank == 0 else None
    plan = rt.plan_batch(layout, ids)
    for i, mode in enumerate(cfg.modes):
        if ctx.rank == 0:
            ctx.report((i, f"timing {mode}"))  # the parent's progress line (a CPU run takes minutes)
        lay, p = layout, plan
        if mode == "prefetch" and len(layout.requests) != 1:
            lay = _solo_layout(cfg)
            p = rt.plan_batch(lay)
        out["modes"][mode] = _time_mode(ctx, rt, p, mode, cfg, range(cfg.layers))
        if model.num_layers > cfg.layers:
            shared = _time_mode(ctx, rt, p, mode, cfg, range(cfg.layers, model.num_layers))
            out["modes"][mode]["ms_per_shared_layer"] = shared["ms_per_layer"]
        out["modes"][mode]["requests"] = len(lay.requests)
    if ctx.rank == 0:
        ctx.report((len(cfg.modes), "host time per call"))
    for r in range(ctx.world_size):  # one rank at a time, so that no other rank's work shares the device
        if r == ctx.rank:
            out["host_us"] = _host_us(rt, plan)
            out["host_us_layer"], out["host_us_layer_idle"] = _host_us_layer(rt, plan)
        ctx.barrier()
    out["host_us_layer_symm"] = _host_us_compose_layer(ctx, rt, plan)
    rt.close()
    return out


def _solo_layout(cfg: BenchConfig) -> BatchLayout:
    """Prefetch takes one request: the traced batch's largest request alone (same hit ratio class)."""
    reqs, pages, _, _ = traced_batch(cfg)
    i = max(range(len(reqs)), key=lambda j: reqs[j][0] + reqs[j][1])
    return build_layout([reqs[i]], page_size=cfg.page_size, cp=cfg.cp, prefix_pages=[pages[i]])


def _time_plan(rt: ComposeRuntime, reqs, pages, ids, cfg: BenchConfig,
               device: torch.device | None = None) -> tuple[float, float]:
    """Median ms to build the traced batch's plan from a fresh layout (``device`` cpu: without the
    host-to-device copy), and median ms of that ``build_layout`` itself (not part of the plan figure)."""
    device = device or rt.device
    plan_s, layout_s = [], []
    for _ in range(11):
        t0 = time.perf_counter()
        layout = build_layout(reqs, page_size=cfg.page_size, cp=cfg.cp, prefix_pages=pages)
        t1 = time.perf_counter()
        plan = ComposePlan(layout, rt.rank, rt.staging.capacity, rt.page_bytes, device, ids)
        _sync(rt.device)
        plan_s.append(time.perf_counter() - t1)
        layout_s.append(t1 - t0)
        del plan, layout  # freed outside the timed span
    return statistics.median(plan_s) * 1e3, statistics.median(layout_s) * 1e3


def _time_mode(ctx: RankContext, rt: ComposeRuntime, plan: ComposePlan, mode: str, cfg: BenchConfig,
               layers: range) -> dict:
    times = []
    for it in range(cfg.iters + 1):  # first iteration warms up (compilation, gloo buffers)
        ctx.barrier()
        _sync(rt.device)
        t0 = time.perf_counter()
        for layer in layers:  # as the engine runs it: rows of the layer's kinds, then compose_layer
            for k in rt.pool.kinds_at(layer):
                rt.current_rows(plan, layer, k)
            rt.compose_layer(plan, layer, mode=mode)
        _sync(rt.device)
        if it:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"ms_measured": med * 1e3, "ms_per_layer": med * 1e3 / len(layers), "effective": rt.effective_mode(mode)}


def _host_us(rt: ComposeRuntime, plan: ComposePlan, n: int = 100) -> float:
    """Host µs per (layer, kind) of the gather path with the plan built (no barrier wait), back to back."""
    def call(i: int) -> None:
        kind = KINDS[i & 1]
        rt.gather(rt.dense(plan, kind, 0)[1], "global", 0, kind, 0, plan.all)
    return _host_call_us(rt, n, call)[0]


def _host_us_layer(rt: ComposeRuntime, plan: ComposePlan, n: int = 100) -> tuple[float, float]:
    """Host µs per layer (every kind in one call, as ``compose_layer`` under symm) with the plan built:
    (back to back, each call alone on an idle device)."""
    halves = {k: 0 for k in KINDS}

    def call(_: int) -> None:
        rt._checked(plan)  # what every compose call does with its plan
        rt.gather_kinds("global", 0, halves, {k: (rt.dense(plan, k, 0)[1], plan.all) for k in KINDS})
    return _host_call_us(rt, n, call)


def _host_us_compose_layer(ctx: RankContext, rt: ComposeRuntime, plan: ComposePlan, n: int = 100) -> float:
    """Host µs per ``compose_layer`` under symm with the plan cached, barrier round included, every rank at
    once and back to back (as a forward pass issues them). With the GPU barrier the round is a kernel the
    host only enqueues; with the host barrier this includes its wait."""
    if not rt.mem.available:
        return float("nan")
    for layer in range(rt.num_layers):  # builds every layer's launches
        rt.compose_layer(plan, layer, mode="symm")
    _sync(rt.device)
    ctx.barrier()
    t0 = time.perf_counter()
    for i in range(n):
        rt.compose_layer(plan, i % rt.num_layers, mode="symm")
    us = (time.perf_counter() - t0) / n * 1e6
    _sync(rt.device)
    ctx.barrier()
    return us


def _host_call_us(rt: ComposeRuntime, n: int, call) -> tuple[float, float]:
    """Host µs of ``call(i)``, two ways: the mean over ``n`` calls issued back to back, as the layers of a
    forward pass issue them (``n`` stays far below the launch queue's depth, so the host never waits for the
    device), and the median of ``n`` calls each timed alone after a synchronisation (this adds the cost of
    waking an idle device's queue)."""
    if not rt.mem.available:
        return float("nan"), float("nan")
    call(0)  # builds the launches
    _sync(rt.device)
    t0 = time.perf_counter()
    for i in range(n):
        call(i)
    steady = (time.perf_counter() - t0) / n
    _sync(rt.device)
    times = []
    for i in range(n):
        _sync(rt.device)
        t0 = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t0)
    _sync(rt.device)
    return steady * 1e6, statistics.median(times) * 1e6


# the gather kernel against a device copy ------------------------------------------------------------

def allocator_order(pool_pages: int, n: int, chunk: int = 512, seed: int = 0) -> list[int]:
    """``n`` distinct pages of a ``pool_pages``-page pool (0-based) in the order the engine's allocator
    (``kvcache.allocator.PageAllocator``: lowest free id first) hands them to requests on a pool in use: the
    pool filled, a random half released (requests finished or evicted), then the ``n`` pages allocated
    ``chunk`` at a time (a prompt's chunks, in slot order) while random other pages are released between the
    chunks. Each chunk ascends; a later chunk may restart lower (the pages freed meanwhile)."""
    from cpkv.kvcache.allocator import PageAllocator
    if not 0 <= n <= pool_pages // 2:
        raise ValueError(f"allocator_order: n must be in [0, {pool_pages // 2}], got {n}")
    rng = np.random.default_rng(seed)
    alloc = PageAllocator(pool_pages + 1, name="bench pool")  # ids 1..pool_pages (0 is the allocator's reserve)
    others = alloc.allocate(pool_pages)
    rng.shuffle(others)
    alloc.release(others[: pool_pages // 2])
    others = others[pool_pages // 2:]
    out: list[int] = []
    while len(out) < n:
        out += alloc.allocate(min(chunk, n - len(out)))
        k = min(chunk // 2, len(others))  # other requests finish meanwhile
        alloc.release(others[:k])
        others = others[k:]
    return [p - 1 for p in out]


def kernel_bench(device: torch.device, page_bytes: int = 64 * 656, pool_pages: int = 16384,
                 gather_pages: int = 8192, configs: tuple[dict, ...] = GATHER_CONFIGS) -> dict[str, Any]:
    """Gather ``gather_pages`` random pages of a pool into a dense buffer; compare with a same-size copy.

    Every gather config is first checked byte-exact against ``index_select``, then timed. Figures: bytes
    read + written per second of *device* time (``event_median_s(..., device_only=True)``: the stream is held by a spin kernel
    while the host enqueues, so a launch's host cost is not counted: the 170-190 µs calls here are short
    enough for a 5-30 µs launch to show), ``ratio_to_copy`` against ``copy_`` timed the same way; the
    ``*_event`` figures time each call from its host launch on an idle device (``event_median_s``: a per-call
    Triton launch costs more host time than ``copy_``'s, which these figures include)."""
    from cpkv.kernels.page_gather.triton import DEFAULT_CONFIG, gather_launcher, load, page_gather_triton
    pool = torch.randint(0, 256, (pool_pages, page_bytes), dtype=torch.uint8, device=device)
    out = torch.empty((gather_pages, page_bytes), dtype=torch.uint8, device=device)
    flat = torch.empty_like(out)
    idx = torch.randperm(pool_pages, device=device)[:gather_pages]
    want = pool.index_select(0, idx)
    dest = torch.arange(gather_pages, dtype=torch.int32, device=device)
    src = torch.zeros(gather_pages, dtype=torch.int32, device=device)
    bases = torch.tensor([pool.data_ptr()], dtype=torch.int64, device=device)
    nbytes = 2 * gather_pages * page_bytes
    res: dict[str, Any] = {"page_bytes": page_bytes, "pages": gather_pages, "bytes_moved": nbytes,
                           "default": dict(DEFAULT_CONFIG)}

    def gbps(fn) -> float:
        return nbytes / event_median_s(fn, device_only=True) / 1e9

    def copy() -> None:
        flat.copy_(pool[:gather_pages])
    res["copy_GBps"] = gbps(copy)
    res["copy_GBps_event"] = nbytes / event_median_s(copy) / 1e9
    res["index_select_GBps"] = gbps(lambda: torch.index_select(pool, 0, idx, out=out))
    res["index_select_ratio"] = res["index_select_GBps"] / res["copy_GBps"]
    variants = []
    for cfg in configs:
        full = {**DEFAULT_CONFIG, **cfg}
        out.zero_()
        launch = gather_launcher(out, bases, dest, src, idx, config=full)  # what compose runs
        launch()
        ok = bool(torch.equal(out, want))  # byte-exact before timing
        row = {**full, "correct": ok}
        if ok:
            row["GBps"] = gbps(launch)
            row["ratio_to_copy"] = row["GBps"] / res["copy_GBps"]
            row["GBps_event"] = nbytes / event_median_s(
                lambda: page_gather_triton(out, bases, dest, src, idx, config=full)) / 1e9
            row["ratio_to_copy_event"] = row["GBps_event"] / res["copy_GBps_event"]
            row["correct"] = bool(torch.equal(out, want))  # and still after the timed runs
        variants.append(row)
    res["variants"] = variants
    # host cost of one launch, on a one-page gather so that the GPU never holds the launches back
    one = (out[:1], bases, dest[:1], src[:1], idx[:1])
    res["launch_host_us_unprepared"] = _launch_us(lambda: page_gather_triton(*one))  # resolves args every call
    res["launch_host_us"] = _launch_us(gather_launcher(*one))  # built once per plan: what compose runs
    tiny = torch.zeros(1, device=device)
    res["torch_launch_host_us"] = _launch_us(lambda: tiny.add_(1))  # the host's launch floor, same run
    timed = [v for v in variants if v["correct"]]
    res["all_correct"] = len(timed) == len(variants)
    if not timed:
        return res
    best = max(timed, key=lambda v: v["GBps"])
    cfg = {k: best[k] for k in DEFAULT_CONFIG}
    # same pages in address order, contiguous pages (a plain copy through the same kernel), and pages in the order
    # the engine's allocator hands them out on a pool in use: separate the access pattern from the kernel's cost
    churned = torch.tensor(allocator_order(pool_pages, gather_pages), device=device)
    cases = (("sorted", idx.sort().values, cfg), ("contiguous", torch.arange(gather_pages, device=device), cfg),
             ("allocator", churned, cfg), ("allocator_default", churned, None))  # the last: what compose runs
    for name, pages, conf in cases:
        res[f"{name}_GBps"] = gbps(gather_launcher(out, bases, dest, src, pages, config=conf))
        res[f"{name}_ratio"] = res[f"{name}_GBps"] / res["copy_GBps"]
    res["allocator_correct"] = bool(torch.equal(out, pool.index_select(0, churned)))  # the last case's bytes
    res["best"] = best
    res["ptx_v4_loads"] = _count_v4(load())
    return res


def _count_v4(kernel: Any) -> list[int] | None:
    """Per compiled variant: 16-byte global loads (``ld.global...v4.b32``) in its PTX."""
    import re
    try:
        cache = getattr(kernel, "device_caches", None) or getattr(kernel, "cache", None)
        out = []
        for dev_cache in (cache or {}).values():
            entries = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for compiled in entries.values():
                out.append(len(re.findall(r"ld\.global[^\n]*\.v4\.b32", compiled.asm["ptx"])))
        return out
    except Exception:  # noqa: BLE001
        return None


def _launch_us(fn, n: int = 300) -> float:
    """Host µs per call of ``fn`` (asynchronous launches, no synchronisation inside the loop)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / n * 1e6


def run_bench(cfg: BenchConfig, on_progress=None) -> dict[str, Any]:
    """Launch the ranks and aggregate: per mode the slowest rank's median, scaled to a whole batch.
    ``on_progress(step, what)`` follows rank 0 (step: modes timed so far)."""
    report = (lambda rank, msg: on_progress(*msg)) if on_progress else None
    results = launch(rank_worker, cfg.cp, device=cfg.device, args=(cfg,), timeout_s=900, on_progress=report)
    model = preset(cfg.model)
    modes = {}
    for m in cfg.modes:
        per_layer = max(r["modes"][m]["ms_per_layer"] for r in results)
        shared = max(r["modes"][m].get("ms_per_shared_layer", per_layer) for r in results)
        n_full = len(model.full_layers)
        modes[m] = {"ms_per_layer": per_layer, "ms_per_shared_layer": shared,
                    "ms_per_batch": per_layer * n_full + shared * (model.num_layers - n_full),
                    "effective": results[0]["modes"][m]["effective"], "requests": results[0]["modes"][m]["requests"]}
    reqs, _, _, _ = traced_batch(cfg)
    batch = {"requests": len(reqs), "extend_tokens": sum(e for _, e in reqs), "prefix_tokens": sum(p for p, _ in reqs),
             "hit_ratio": sum(p for p, _ in reqs) / sum(p + e for p, e in reqs)}
    return {"config": asdict(cfg), "model_layers": model.num_layers, "model_full_layers": len(model.full_layers),
            "modes": modes,
            "costs": unit_costs_compose(modes, batch),  # usable as `cpkv replay --costs`
            "plan_ms": max(r["plan_ms"] for r in results),
            "plan_ms_host_only": max(r["plan_ms_host_only"] for r in results),
            "layout_ms": max(r["layout_ms"] for r in results), "host_us_per_layer_kind": max(r["host_us"] for r in results),
            "host_us_per_layer": max(r["host_us_layer"] for r in results),
            "host_us_per_layer_idle": max(r["host_us_layer_idle"] for r in results),
            "host_us_per_layer_symm": max(r["host_us_layer_symm"] for r in results),
            "kernel": results[0].get("kernel"), "peer_memory": results[0]["peer_memory"],
            "triton": results[0]["triton"], "shared_device": cfg.device == "cuda" and _shared(cfg.cp),
            "batch": batch}


def _shared(cp: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() < cp


def pair_bench(device: torch.device, kinds: dict[str, tuple[int, int]],
               config: dict | None = None) -> dict[str, Any]:
    """Both kinds of a layer gathered as compose runs them (a ``gather_launcher`` per kind, each at ``config``,
    None: DEFAULT_CONFIG): ``kinds`` {name: (page_bytes, pool_pages)}, half of each pool gathered, in
    the allocator's order (``allocator_order``) and in random order, each byte-checked, in device time against its
    ceilings: ``copy_`` of each kind's bytes back to back (two launches, as the two gathers) and one ``copy_`` of
    all of them."""
    from cpkv.kernels.page_gather.triton import gather_launcher
    if len(kinds) != 2:
        raise ValueError(f"pair_bench: two kinds, got {sorted(kinds)}")
    segs, nbytes = [], 0
    for name, (page_bytes, pool_pages) in kinds.items():
        n = pool_pages // 2
        pool = torch.randint(0, 256, (pool_pages, page_bytes), dtype=torch.uint8, device=device)
        segs.append({"name": name, "pool": pool, "out": torch.empty((n, page_bytes), dtype=torch.uint8, device=device),
                     "flat": torch.empty((n, page_bytes), dtype=torch.uint8, device=device),
                     "dest": torch.arange(n, dtype=torch.int32, device=device),
                     "src": torch.zeros(n, dtype=torch.int32, device=device),
                     "bases": torch.tensor([pool.data_ptr()], dtype=torch.int64, device=device),
                     "orders": {"allocator": torch.tensor(allocator_order(pool_pages, n), device=device),
                                "random": torch.randperm(pool_pages, device=device)[:n]}})
        nbytes += 2 * n * page_bytes
    total = sum(x["out"].numel() for x in segs)
    big_src = torch.empty(total, dtype=torch.uint8, device=device)
    big_dst = torch.empty_like(big_src)

    def gbps(fn) -> float:
        return nbytes / event_median_s(fn, device_only=True) / 1e9

    def copies() -> None:
        for x in segs:
            x["flat"].copy_(x["pool"][: x["flat"].shape[0]])
    res: dict[str, Any] = {"kinds": {x["name"]: list(x["out"].shape) for x in segs}, "bytes_moved": nbytes,
                           "copy_each_GBps": gbps(copies), "copy_one_GBps": gbps(lambda: big_dst.copy_(big_src))}
    for order in ("allocator", "random"):
        for x in segs:
            x["out"].zero_()
        launchers = [gather_launcher(x["out"], x["bases"], x["dest"], x["src"], x["orders"][order], config=config)
                     for x in segs]

        def both() -> None:
            for one in launchers:
                one()
        both()
        ok = all(torch.equal(x["out"], x["pool"].index_select(0, x["orders"][order])) for x in segs)
        res[f"{order}_correct"] = ok
        if ok:
            res[f"{order}_GBps"] = g = gbps(both)
            res[f"{order}_ratio_each"] = g / res["copy_each_GBps"]
            res[f"{order}_ratio_one"] = g / res["copy_one_GBps"]
    return res


def kernel_main(argv: list[str] | None = None) -> int:
    """``python -m cpkv.bench.compose [--json] [--save PATH] [--model glm5] [--page-size 64]``: the gather
    sweep alone (one GPU, no ranks), token pages then index pages of the model, then both kinds as compose gathers them
    (``pair_bench``: what compose runs each layer); a table (or ``--json``: the two sweeps and ``pair``) on
    stdout, the JSON also written to ``--save``."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m cpkv.bench.compose", description=kernel_main.__doc__)
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", default=None, help="also write the JSON result to this file")
    p.add_argument("--model", default="glm5")
    p.add_argument("--page-size", type=int, default=64)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m cpkv.bench.compose: error: the gather sweep needs a CUDA device, found none", file=sys.stderr)
        return 2
    model, dev = preset(args.model), torch.device("cuda")
    runs = {}
    for kind, pool_pages in (("token", 16384), ("index", 65536)):  # GLM-5: 344 / 277 MB gathered from 2x that
        page_bytes = model.row_bytes(kind) * args.page_size
        print(f"gather sweep: {kind} pages of {page_bytes} B", file=sys.stderr, flush=True)
        runs[kind] = kernel_bench(dev, page_bytes=page_bytes, pool_pages=pool_pages, gather_pages=pool_pages // 2)
        torch.cuda.empty_cache()
    print("gather sweep: both kinds of a layer (what compose runs each layer)", file=sys.stderr, flush=True)
    pair = pair_bench(dev, {kind: (runs[kind]["page_bytes"], 2 * runs[kind]["pages"]) for kind in ("token", "index")})
    torch.cuda.empty_cache()
    runs["pair"] = pair
    if args.save:
        with open(args.save, "w") as f:
            json.dump(runs, f, indent=1)
    if args.json:
        print(json.dumps(runs, indent=1))
        return 0
    nan = float("nan")
    print(f"both kinds of a layer, {pair['bytes_moved'] / 1e6:.0f} MB moved: in the allocator's order "
          f"{pair.get('allocator_ratio_each', nan):.3f} of copy_ per kind ({pair.get('allocator_ratio_one', nan):.3f} of "
          f"one copy_), random order {pair.get('random_ratio_each', nan):.3f} ({pair.get('random_ratio_one', nan):.3f}); "
          f"byte-exact: {pair['allocator_correct'] and pair['random_correct']}")
    del runs["pair"]
    for kind, r in runs.items():
        print(f"{kind} pages {r['page_bytes']} B x {r['pages']}: copy_ {r['copy_GBps']:.0f} GB/s device time "
              f"({r['copy_GBps_event']:.0f} launch included), index_select {r['index_select_ratio']:.3f}, "
              f"sorted {r.get('sorted_ratio', float('nan')):.3f}, contiguous {r.get('contiguous_ratio', float('nan')):.3f}, "
              f"allocator order {r.get('allocator_ratio', float('nan')):.3f}")
        for v in r["variants"]:
            cfg = " ".join(f"{k}={v[k]!r}" for k in r["default"])
            fig = (f"{v['GBps']:7.0f} GB/s  {v['ratio_to_copy']:.3f}  (launch incl. {v['ratio_to_copy_event']:.3f})"
                   if "GBps" in v else "")
            print(f"  {'ok ' if v['correct'] else 'BAD'} {cfg:<72} {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(kernel_main())
