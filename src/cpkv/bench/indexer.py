"""``cpkv bench indexer``: the indexer at GLM-5 shapes (H = 32, D = 128, k = 2048) on CUDA.

Per scenario: logits TFLOP/s over unmasked pairs (2*H*D FLOPs each) against torch._scaled_mm fp8
measured in the same run, the two timed alternately (paired_rate: the clock follows the power of the
last tens of milliseconds, so each timing window follows 100 ms of the same work and each round compares
the kernel with the GEMMs just before and after it; the ratio to the run's first GEMM is reported too), launched as index_topk launches it (unclean, the plan's work items); top-k
time against torch.topk on the same rows; index_topk time at chunk
budgets 8, 4, 2, 1, 0.5 GiB relative to 8 GiB. Plus the top-k headline: 4096 rows x 65536 keys.
--variants also times every named kernel variant (logits_variants / topk_variants) with a check of
its output against the reference kernel, so the default can be chosen from measurements.
--decode runs the decode step's paged logits instead (cpkv.bench.indexer_decode: B = 1, 8, 32 generations of
1K / 32K / 128K keys, device time and GB/s against a copy_ of the same bytes), then their top-k: the stream kernel
beside the split path, with ratios).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from cpkv.bench.timing import do_bench_ms
from cpkv.scheduler.costs import unit_costs_indexer

HELP = "Indexer: fp8 logits vs the fp8 GEMM ceiling, top-k vs torch.topk, chunk-size sweep (CUDA)."
HEADS, DIM, TOPK = 32, 128, 2048
BUDGETS_GIB = (8.0, 4.0, 2.0, 1.0, 0.5)


@dataclass(frozen=True)
class Scenario:
    """requests: (prefix tokens, new tokens) per request; the dense buffer holds each request's
    prefix + new keys one after the other; the rank computes every new token."""

    name: str
    requests: tuple[tuple[int, int], ...]


SCENARIOS = (
    Scenario("cold", ((57344, 8192),)),
    Scenario("tail", ((64512, 1024),)),
    Scenario("warm", ((24576, 256), (40960, 256), (57344, 256), (90112, 256))),
    Scenario("warm_long", ((114688, 16384),)),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli.args import bounded_float

    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS),
                   help="comma-separated subset of " + ", ".join(s.name for s in SCENARIOS))
    p.add_argument("--tune", action="store_true", help="also time logits tile configs on the first scenario")
    p.add_argument("--no-sweep", action="store_true", help="skip the chunk-size sweep")
    p.add_argument("--settle-ms", type=bounded_float(0.0, 60_000.0, low_open=False), default=100.0,
                   help="untimed run of the same work before each logits / GEMM timing window (0: none), "
                        "so each is timed at its own steady clock")
    p.add_argument("--no-headline", action="store_true", help="skip the 4096 x 65536 top-k headline")
    p.add_argument("--decode", action="store_true",
                   help="time the decode step's paged logits (B = 1, 8, 32; 1K / 32K / 128K keys) and their top-k "
                        "(stream kernel vs split path) instead")
    p.add_argument("--variants", nargs="?", const="all", default=None, metavar="NAMES",
                   help="also time the named logits / top-k kernel variants (comma-separated; alone: all of them) "
                        "in each scenario and the headline")


def _picked(named: dict, names: str | None) -> dict:
    """The default plus the variants named in ``names`` ("all": every one)."""
    if names in (None, "all"):
        return named
    wanted = {n.strip() for n in names.split(",")}
    return {k: v for i, (k, v) in enumerate(named.items()) if i == 0 or k in wanted}


def _check_variant_names(names: str | None) -> None:
    from cpkv.errors import IndexerError

    if names in (None, "all"):
        return
    try:
        known = set(logits_variants()) | set(topk_variants())
    except ImportError:  # no Triton: the kernels' variants cannot be listed; the run stops on that next
        return
    unknown = sorted({n.strip() for n in names.split(",")} - known)
    if unknown:
        raise IndexerError(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def logits_variants() -> dict:
    """Named LogitsConfig variants timed by --variants (the first is the default)."""
    from cpkv.kernels.mqa_logits.triton import DEFAULT_CONFIG, LANES_CONFIG, LogitsConfig

    named = {"lanes_tma_w8_s128": LANES_CONFIG,
             "gluon_st3": LogitsConfig(gluon_stages=3),
             "gluon_items_unsplit": LogitsConfig(gluon_split=1),
             "gluon_items_span32": LogitsConfig(gluon_span=32),
             "gluon_items_span128": LogitsConfig(gluon_span=128, gluon_split=8)}
    return {"default": DEFAULT_CONFIG, **{k: v for k, v in named.items() if v != DEFAULT_CONFIG}}


def topk_variants() -> dict:
    """Named TopkConfig variants timed by --variants (the first is the default)."""
    from cpkv.kernels.topk.triton import DEFAULT_CONFIG, TopkConfig

    named = {"stream_w4_p4_d2": TopkConfig(depth=2),
             "stream_w4_p4_d1": TopkConfig(depth=1),
             "stream_w8_p2_b2048": TopkConfig(num_warps=8, programs_per_sm=2, block=2048)}
    return {"default": DEFAULT_CONFIG, **{k: v for k, v in named.items() if v != DEFAULT_CONFIG}}


def run(args: argparse.Namespace) -> int:
    import torch

    from cpkv.cli.fmt import emit_json, table
    from cpkv.errors import IndexerError

    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in {s.name for s in SCENARIOS}]
    if unknown or not names:
        raise IndexerError(f"--scenarios: expected some of {', '.join(s.name for s in SCENARIOS)}, "
                           f"got {args.scenarios!r}")
    if args.settle_ms < 0:
        raise IndexerError(f"--settle-ms must be >= 0, got {args.settle_ms}")
    _check_variant_names(args.variants)
    if not torch.cuda.is_available():
        raise IndexerError("cpkv bench indexer needs a CUDA device (none is visible)")
    from cpkv.kernels.platform import triton_importable

    if not triton_importable():
        raise IndexerError("cpkv bench indexer needs triton, which is not installed")
    if args.decode:
        from cpkv.bench.indexer_decode import bench_decode, print_decode

        report = bench_decode()
        emit_json(report) if args.json else print_decode(report, table)
        return 0
    report = {"device": torch.cuda.get_device_name(), "heads": HEADS, "dim": DIM, "topk": TOPK,
              "fp8_gemm_tflops": fp8_gemm_tflops()}
    chosen = [s for s in SCENARIOS if s.name in names]
    if args.tune:
        report["tune"] = tune_logits(chosen[0])
    report["settle_ms"] = args.settle_ms
    report["scenarios"] = [bench_scenario(s, report["fp8_gemm_tflops"], not args.no_sweep, args.variants,
                                          args.settle_ms) for s in chosen]
    report["costs"] = unit_costs_indexer(report["scenarios"])  # usable as `cpkv replay --costs`
    if not args.no_headline:
        report["topk_headline"] = bench_topk_headline(variants=args.variants)
    if args.json:
        emit_json(report)
    else:
        _print_tables(report, table)
    return 0


def _fp8_gemm(n: int = 8192):
    """torch._scaled_mm on random fp8 e4m3 [n, n] x [n, n] -> bf16, as a call, and its FLOPs."""
    import torch

    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    return (lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), 2 * n ** 3


def fp8_gemm_tflops(n: int = 8192, rep: int = 60) -> float:
    """The ceiling: the _fp8_gemm rate in TFLOP/s."""
    fn, flops = _fp8_gemm(n)
    return flops / do_bench_ms(fn, rep_ms=rep) / 1e9


def _settle(fn, ms: float) -> None:
    """Run fn back to back for about ``ms`` milliseconds (untimed), then wait for it."""
    import time

    import torch

    torch.cuda.synchronize()
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()


def paired_rate(fn, flops: float, rounds: int = 7, rep: int = 25, settle: float = 100.0) -> dict:
    """fn's TFLOP/s against the fp8 GEMM ceiling, the two timed alternately: GEMM, fn, GEMM, fn, ..., GEMM
    (``rounds`` times fn, ~``rep`` ms each). The H200's clock follows the power drawn by the work of the
    last tens of milliseconds (seen: the GEMM at 1,447 then 1,230 TFLOP/s in one run; the tail-scenario
    logits at 1,154 TFLOP/s timed alone and 1,014 when each timing window followed a GEMM window), so
    each window is preceded by ``settle`` ms of the same work, untimed: each side is timed at its own
    steady clock, not at the clock the other left behind. Each round's fn is compared with the mean of
    the GEMMs just before and just after it; ratio is the median of the rounds' ratios."""
    import statistics

    gemm_fn, gemm_flops = _fp8_gemm()

    def gemm_tflops() -> float:
        _settle(gemm_fn, settle)
        return gemm_flops / do_bench_ms(gemm_fn, rep_ms=rep) / 1e9

    gemm = [gemm_tflops()]
    ms, ratios = [], []
    for _ in range(rounds):
        _settle(fn, settle)
        ms.append(do_bench_ms(fn, rep_ms=rep))
        gemm.append(gemm_tflops())
        ratios.append(flops / ms[-1] / 1e9 / ((gemm[-2] + gemm[-1]) / 2))
    t = statistics.median(ms)
    return {"ms": t, "tflops": flops / t / 1e9, "ratio": statistics.median(ratios), "ratios": ratios,
            "gemm_tflops": gemm, "settle_ms": settle}


def make_inputs(s: Scenario):
    """Random GLM-5-shaped indexer inputs: q fp8 (scale folded into weights), keys as 132-byte rows."""
    import torch

    from cpkv.indexer import quantize_index_keys, quantize_queries
    from cpkv.indexer.quant import dequantize_index_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    total_new = sum(e for _, e in s.requests)
    total_keys = sum(p + e for p, e in s.requests)
    q, w = quantize_queries(torch.randn(total_new, HEADS, DIM, device="cuda", generator=gen),
                            torch.randn(total_new, HEADS, device="cuda", generator=gen) * HEADS ** -0.5)
    rows = quantize_index_keys(torch.randn(total_keys, DIM, device="cuda", generator=gen))
    k, k_scale = dequantize_index_rows(rows)
    requests, base = [], 0
    for p, e in s.requests:
        requests.append((base, list(range(p, p + e))))
        base += p + e
    return q, k, k_scale, w, requests


def indexer_plan(requests, budget_bytes):
    from cpkv.indexer import IndexerPlan

    return IndexerPlan.build(requests, "cuda", chunk_max_bytes=budget_bytes)


def bench_scenario(s: Scenario, ceiling: float, sweep: bool, variants: str | None = None,
                   settle_ms: float = 100.0) -> dict:
    import torch

    from cpkv.indexer import index_topk
    from cpkv.indexer.logits import aligned_keys, aligned_scales, logits_into
    from cpkv.indexer.plan import padded
    from cpkv.indexer.topk import topk_into
    from cpkv.kernels.mqa_logits.triton import work_shape

    q, k, k_scale, w, requests = make_inputs(s)
    full = indexer_plan(requests, 1 << 62)
    c = full.chunks[0]
    pairs = int((full.ke - full.ks).sum())
    ka, k_scale = aligned_keys(k), aligned_scales(k_scale)
    buf = torch.empty(c.rows, padded(c.width), device="cuda")[:, : c.width]
    work = lambda shape: full.work_items(c, shape)  # noqa: E731
    run_logits = lambda clean: logits_into(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start,  # noqa: E731
                                           clean=clean, work=work)
    flops = pairs * 2 * HEADS * DIM
    # timed alternately with the GEMM ceiling: the ratio compares the two in the same clock state
    paired = paired_rate(lambda: run_logits(False), flops, settle=settle_ms)
    t_logits = paired["ms"]
    t_repack = do_bench_ms(lambda: aligned_keys(k))
    run_logits(True)
    out = torch.empty(q.shape[0], TOPK, dtype=torch.int32, device="cuda")
    t_topk = do_bench_ms(lambda: topk_into(buf, full.rel_ks, full.rel_ke, TOPK, out))
    t_torch = do_bench_ms(lambda: torch.topk(buf, TOPK, dim=1))
    tflops = paired["tflops"]
    res = {"name": s.name, "tokens": q.shape[0], "keys": k.shape[0], "pairs": pairs,
           "logits_ms": t_logits, "logits_tflops": tflops, "ratio_to_fp8_gemm": paired["ratio"],
           "ratio_rounds": paired["ratios"], "fp8_gemm_tflops_interleaved": paired["gemm_tflops"],
           "ratio_to_first_fp8_gemm": tflops / ceiling,
           "work_items": int(full.work_items(c, shape).shape[0]) if (shape := work_shape(q, ka)) else None,
           "key_repack_ms": t_repack, "topk_ms": t_topk, "torch_topk_ms": t_torch,
           "topk_speedup": t_torch / t_topk}
    if variants:
        res["logits_variants"] = _logits_variant_rows(q, ka, k_scale, w, full, c, buf, run_logits, flops, work,
                                                      variants, settle_ms)
        res["topk_variants"] = _topk_variant_rows(buf, full, out, t_torch, variants)
    del buf
    if sweep:
        res["sweep"] = _sweep(q, k, k_scale, w, requests, index_topk)
    torch.cuda.empty_cache()
    return res


def _logits_variant_rows(q, ka, k_scale, w, full, c, buf, run_logits, flops, work, names,
                         settle_ms: float) -> list[dict]:
    """Each logits variant, timed unclean with the plan's work items (as index_topk runs it) alternately
    with the GEMM ceiling (paired_rate, 3 rounds): time, TFLOP/s, ratio, and whether its clean output
    equals the default kernel's on every -inf position and within 1e-5 of the row maximum elsewhere."""
    import torch

    from cpkv.indexer.logits import logits_into

    run_logits(True)
    want = buf.clone()
    rows = []
    for name, cfg in _picked(logits_variants(), names).items():
        try:
            paired = paired_rate(lambda: logits_into(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start,
                                                     clean=False, config=cfg, work=work), flops, rounds=3,
                                 settle=settle_ms)
            logits_into(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=True, config=cfg)
            same_inf = bool(torch.equal(torch.isinf(buf), torch.isinf(want)))
            fin = torch.isfinite(want)
            scale = want.masked_fill(~fin, 0).abs().amax().clamp(min=1e-30)
            err = float(((buf - want).abs().masked_fill(~fin, 0).amax() / scale))
            rows.append({"variant": name, "config": repr(cfg), "ms": paired["ms"], "tflops": paired["tflops"],
                         "ratio_to_fp8_gemm": paired["ratio"], "same_inf": same_inf, "max_rel_diff": err})
        except Exception as exc:  # a variant that does not compile is reported, not fatal
            rows.append({"variant": name, "config": repr(cfg), "error": str(exc)[:300]})
    buf.copy_(want)
    return rows


def _topk_variant_rows(buf, full, out, t_torch, names) -> list[dict]:
    """Each top-k variant on the scenario's logits: time, speed-up over torch.topk, exact equality
    with the pure-torch reference's result."""
    import torch

    from cpkv.indexer.ref import topk_ref
    from cpkv.indexer.topk import topk_into

    want = topk_ref(buf, full.rel_ks, full.rel_ke, TOPK)
    rows = []
    for name, cfg in _picked(topk_variants(), names).items():
        try:
            ms = do_bench_ms(lambda: topk_into(buf, full.rel_ks, full.rel_ke, TOPK, out, config=cfg))
            out.fill_(-2)
            topk_into(buf, full.rel_ks, full.rel_ke, TOPK, out, config=cfg)
            rows.append({"variant": name, "config": repr(cfg), "ms": ms, "speedup": t_torch / ms,
                         "equal_to_reference": bool(torch.equal(out, want))})
        except Exception as exc:
            rows.append({"variant": name, "config": repr(cfg), "error": str(exc)[:300]})
    return rows


def _sweep(q, k, k_scale, w, requests, index_topk, rounds: int = 3) -> list[dict]:
    """index_topk time per chunk budget: the median of ``rounds`` rounds over every budget, in alternating
    order (the clock drifts under sustained load; a single pass in one order showed a one-chunk budget
    1.2x slower than the identical one-chunk 8 GiB run measured just before it)."""
    import statistics

    plans = {gib: indexer_plan(requests, int(gib * (1 << 30))) for gib in BUDGETS_GIB}
    times: dict[float, list[float]] = {gib: [] for gib in BUDGETS_GIB}
    for r in range(rounds):
        for gib in (BUDGETS_GIB if r % 2 == 0 else BUDGETS_GIB[::-1]):
            p = plans[gib]
            times[gib].append(do_bench_ms(lambda p=p: index_topk(q, k, k_scale, w, p.ks, p.ke, topk=TOPK, plan=p)))
    rows = [{"budget_gib": gib, "chunks": len(plans[gib].chunks), "ms": statistics.median(times[gib])}
            for gib in BUDGETS_GIB]
    for r in rows:
        r["relative_to_8gib"] = r["ms"] / rows[0]["ms"]
    return rows


def tune_logits(s: Scenario) -> list[dict]:
    """Time a few tile configs of the logits kernel on scenario s (unmasked-pair TFLOP/s)."""
    import torch

    from cpkv.indexer.logits import aligned_keys
    from cpkv.indexer.plan import padded
    from cpkv.kernels.mqa_logits.triton import LogitsConfig, mqa_logits_triton

    q, k, k_scale, w, requests = make_inputs(s)
    plan = indexer_plan(requests, 1 << 62)
    c = plan.chunks[0]
    ka = aligned_keys(k)
    pairs = int((plan.ke - plan.ks).sum())
    buf = torch.empty(c.rows, padded(c.width), device="cuda")[:, : c.width]
    configs = [LogitsConfig(block_s=64, num_warps=4, maxnreg=None), LogitsConfig(block_s=64, num_warps=4, maxnreg=168),
               LogitsConfig(block_s=64, num_warps=4, maxnreg=None, span=16),
               LogitsConfig(block_s=64, num_warps=4, maxnreg=None, num_stages=4), LogitsConfig(maxnreg=None),
               LogitsConfig(span=16)]
    rows = []
    for cfg in configs:
        try:
            ms = do_bench_ms(lambda: mqa_logits_triton(q, ka, k_scale, w, plan.ks, plan.ke, buf,
                                                  col_offset=c.key_start, clean=False, config=cfg))
            rows.append({"config": repr(cfg), "ms": ms, "tflops": pairs * 2 * HEADS * DIM / ms / 1e9})
        except Exception as exc:  # a config that does not compile is reported, not fatal
            rows.append({"config": repr(cfg), "error": str(exc)[:200]})
    return rows


def bench_topk_headline(rows: int = 4096, cols: int = 65536, variants: str | None = None) -> dict:
    """Top-k of 4096 x 65536 random logits, k = 2048: Triton kernel vs torch.topk."""
    import torch

    from cpkv.indexer.topk import topk_into

    x = torch.randn(rows, cols, device="cuda")
    lo = torch.zeros(rows, dtype=torch.int32, device="cuda")
    hi = torch.full((rows,), cols, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
    t_ours = do_bench_ms(lambda: topk_into(x, lo, hi, TOPK, out))
    t_torch = do_bench_ms(lambda: torch.topk(x, TOPK, dim=1))
    ref = torch.topk(x, TOPK, dim=1).indices.sort(dim=1).values.int()
    res = {"rows": rows, "cols": cols, "k": TOPK, "topk_ms": t_ours, "torch_topk_ms": t_torch,
           "speedup": t_torch / t_ours, "matches_torch_set": bool(torch.equal(out, ref))}
    if variants:
        res["variants"] = []
        for name, cfg in _picked(topk_variants(), variants).items():
            try:
                ms = do_bench_ms(lambda: topk_into(x, lo, hi, TOPK, out, config=cfg))
                out.fill_(-2)
                topk_into(x, lo, hi, TOPK, out, config=cfg)
                res["variants"].append({"variant": name, "config": repr(cfg), "ms": ms, "speedup": t_torch / ms,
                                        "matches_torch_set": bool(torch.equal(out, ref))})
            except Exception as exc:
                res["variants"].append({"variant": name, "config": repr(cfg), "error": str(exc)[:300]})
    return res


def _print_tables(r: dict, table) -> None:
    print(f"{r['device']}: H={r['heads']} D={r['dim']} k={r['topk']}; first fp8 _scaled_mm of the run "
          f"{r['fp8_gemm_tflops']:.1f} TFLOP/s; '/fp8 GEMM': against GEMMs timed alternately with the logits, "
          f"each window after {r.get('settle_ms', 0):g} ms of the same work")
    if "tune" in r:
        table(["config", "ms", "TFLOP/s"], [(t["config"], t.get("ms", "-"), t.get("tflops", t.get("error")))
                                            for t in r["tune"]])
    table(["scenario", "tokens", "keys", "logits ms", "TFLOP/s", "/fp8 GEMM", "/first GEMM", "topk ms",
           "torch.topk ms", "speedup"],
          [(s["name"], s["tokens"], s["keys"], s["logits_ms"], s["logits_tflops"], s["ratio_to_fp8_gemm"],
            s["ratio_to_first_fp8_gemm"],
            s["topk_ms"], s["torch_topk_ms"], s["topk_speedup"]) for s in r["scenarios"]])
    sweep = [(s["name"], x["budget_gib"], x["chunks"], x["ms"], x["relative_to_8gib"])
             for s in r["scenarios"] for x in s.get("sweep", [])]
    if sweep:
        table(["scenario", "budget GiB", "chunks", "index_topk ms", "vs 8 GiB"], sweep)
    vrows = [(s["name"], "logits", v["variant"], v.get("ms", "-"), v.get("ratio_to_fp8_gemm", v.get("error")))
             for s in r["scenarios"] for v in s.get("logits_variants", [])]
    vrows += [(s["name"], "topk", v["variant"], v.get("ms", "-"), v.get("speedup", v.get("error")))
              for s in r["scenarios"] for v in s.get("topk_variants", [])]
    vrows += [("headline", "topk", v["variant"], v.get("ms", "-"), v.get("speedup", v.get("error")))
              for v in r.get("topk_headline", {}).get("variants", [])]
    if vrows:
        table(["scenario", "kernel", "variant", "ms", "/fp8 GEMM or speed-up"], vrows)
    if "topk_headline" not in r:
        return
    h = r["topk_headline"]
    print(f"top-k {h['rows']}x{h['cols']} k={h['k']}: {h['topk_ms']:.3f} ms vs torch.topk "
          f"{h['torch_topk_ms']:.3f} ms ({h['speedup']:.2f}x), same set as torch: {h['matches_torch_set']}")
