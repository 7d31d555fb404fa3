"""``cpkv bench indexer``: the indexer at GLM-5 shapes (H = 32, D = 128, k = 2048) on CUDA.

Per scenario: logits TFLOP/s over unmasked pairs (2*H*D FLOPs each) against torch._scaled_mm fp8
measured in the same run; top-k time against torch.topk on the same rows; index_topk time at chunk
budgets 8, 4, 2, 1, 0.5 GiB relative to 8 GiB. Plus the top-k headline: 4096 rows x 65536 keys.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

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
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--scenarios", default=",".join(s.name for s in SCENARIOS),
                   help="comma-separated subset of " + ", ".join(s.name for s in SCENARIOS))
    p.add_argument("--tune", action="store_true", help="also time logits tile configs on the first scenario")
    p.add_argument("--no-sweep", action="store_true", help="skip the chunk-size sweep")


def run(args: argparse.Namespace) -> int:
    import torch

    from cpkv.cli.fmt import emit_json, table
    from cpkv.errors import IndexerError

    if not torch.cuda.is_available():
        raise IndexerError("cpkv bench indexer needs a CUDA device (none is visible)")
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in {s.name for s in SCENARIOS}]
    if unknown:
        raise IndexerError(f"unknown scenario(s) {unknown}; expected some of {[s.name for s in SCENARIOS]}")
    report = {"device": torch.cuda.get_device_name(), "heads": HEADS, "dim": DIM, "topk": TOPK,
              "fp8_gemm_tflops": fp8_gemm_tflops()}
    chosen = [s for s in SCENARIOS if s.name in names]
    if args.tune:
        report["tune"] = tune_logits(chosen[0])
    report["scenarios"] = [bench_scenario(s, report["fp8_gemm_tflops"], not args.no_sweep) for s in chosen]
    report["topk_headline"] = bench_topk_headline()
    if args.json:
        emit_json(report)
    else:
        _print_tables(report, table)
    return 0


def _bench(fn) -> float:
    """Median milliseconds of fn() (CUDA events, warm-up first)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def fp8_gemm_tflops(n: int = 8192) -> float:
    """torch._scaled_mm rate on random fp8 e4m3 [n, n] x [n, n] -> bf16: the ceiling."""
    import torch

    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = _bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n ** 3 / ms / 1e9


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


def _plan(requests, budget_bytes):
    from cpkv.indexer import IndexerPlan

    return IndexerPlan.build(requests, "cuda", chunk_max_bytes=budget_bytes)


def bench_scenario(s: Scenario, ceiling: float, sweep: bool) -> dict:
    import torch

    from cpkv.indexer import index_topk
    from cpkv.indexer.logits import aligned_keys, logits_into
    from cpkv.indexer.plan import padded
    from cpkv.indexer.topk import topk_into

    q, k, k_scale, w, requests = make_inputs(s)
    full = _plan(requests, 1 << 62)
    c = full.chunks[0]
    pairs = int((full.ke - full.ks).sum())
    ka = aligned_keys(k)
    buf = torch.empty(c.rows, padded(c.width), device="cuda")[:, : c.width]
    run_logits = lambda clean: logits_into(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=clean)  # noqa: E731
    t_logits = _bench(lambda: run_logits(False))
    t_repack = _bench(lambda: aligned_keys(k))
    run_logits(True)
    out = torch.empty(q.shape[0], TOPK, dtype=torch.int32, device="cuda")
    t_topk = _bench(lambda: topk_into(buf, full.rel_ks, full.rel_ke, TOPK, out))
    t_torch = _bench(lambda: torch.topk(buf, TOPK, dim=1))
    tflops = pairs * 2 * HEADS * DIM / t_logits / 1e9
    res = {"name": s.name, "tokens": q.shape[0], "keys": k.shape[0], "pairs": pairs,
           "logits_ms": t_logits, "logits_tflops": tflops, "ratio_to_fp8_gemm": tflops / ceiling,
           "key_repack_ms": t_repack, "topk_ms": t_topk, "torch_topk_ms": t_torch,
           "topk_speedup": t_torch / t_topk}
    del buf
    if sweep:
        res["sweep"] = _sweep(q, k, k_scale, w, requests, index_topk)
    torch.cuda.empty_cache()
    return res


def _sweep(q, k, k_scale, w, requests, index_topk) -> list[dict]:
    rows = []
    for gib in BUDGETS_GIB:
        plan = _plan(requests, int(gib * (1 << 30)))
        ms = _bench(lambda: index_topk(q, k, k_scale, w, plan.ks, plan.ke, topk=TOPK, plan=plan))
        rows.append({"budget_gib": gib, "chunks": len(plan.chunks), "ms": ms})
    for r in rows:
        r["relative_to_8gib"] = r["ms"] / rows[0]["ms"]
    return rows


def tune_logits(s: Scenario) -> list[dict]:
    """Time a few tile configs of the logits kernel on scenario s (unmasked-pair TFLOP/s)."""
    import torch

    from cpkv.indexer.logits import aligned_keys
    from cpkv.indexer.plan import padded
    from cpkv.kernels.mqa_logits import LogitsConfig, mqa_logits_triton

    q, k, k_scale, w, requests = make_inputs(s)
    plan = _plan(requests, 1 << 62)
    c = plan.chunks[0]
    ka = aligned_keys(k)
    pairs = int((plan.ke - plan.ks).sum())
    buf = torch.empty(c.rows, padded(c.width), device="cuda")[:, : c.width]
    configs = [LogitsConfig(), LogitsConfig(maxnreg=None), LogitsConfig(n_rows=256, maxnreg=None),
               LogitsConfig(block_s=64, num_warps=4, maxnreg=None), LogitsConfig(block_s=64, num_warps=4),
               LogitsConfig(span=16), LogitsConfig(span=4), LogitsConfig(num_stages=2)]
    rows = []
    for cfg in configs:
        try:
            ms = _bench(lambda: mqa_logits_triton(q, ka, k_scale, w, plan.ks, plan.ke, buf,
                                                  col_offset=c.key_start, clean=False, config=cfg))
            rows.append({"config": repr(cfg), "ms": ms, "tflops": pairs * 2 * HEADS * DIM / ms / 1e9})
        except Exception as exc:  # a config that does not compile is reported, not fatal
            rows.append({"config": repr(cfg), "error": str(exc)[:200]})
    return rows


def bench_topk_headline(rows: int = 4096, cols: int = 65536) -> dict:
    """Top-k of 4096 x 65536 random logits, k = 2048: Triton kernel vs torch.topk."""
    import torch

    from cpkv.indexer.topk import topk_into

    x = torch.randn(rows, cols, device="cuda")
    lo = torch.zeros(rows, dtype=torch.int32, device="cuda")
    hi = torch.full((rows,), cols, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
    t_ours = _bench(lambda: topk_into(x, lo, hi, TOPK, out))
    t_torch = _bench(lambda: torch.topk(x, TOPK, dim=1))
    ref = torch.topk(x, TOPK, dim=1).indices.sort(dim=1).values.int()
    return {"rows": rows, "cols": cols, "k": TOPK, "topk_ms": t_ours, "torch_topk_ms": t_torch,
            "speedup": t_torch / t_ours, "matches_torch_set": bool(torch.equal(out, ref))}


def _print_tables(r: dict, table) -> None:
    print(f"{r['device']}: H={r['heads']} D={r['dim']} k={r['topk']}; fp8 _scaled_mm ceiling "
          f"{r['fp8_gemm_tflops']:.1f} TFLOP/s")
    if "tune" in r:
        table(["config", "ms", "TFLOP/s"], [(t["config"], t.get("ms", "-"), t.get("tflops", t.get("error")))
                                            for t in r["tune"]])
    table(["scenario", "tokens", "keys", "logits ms", "TFLOP/s", "/fp8 GEMM", "topk ms", "torch.topk ms", "speedup"],
          [(s["name"], s["tokens"], s["keys"], s["logits_ms"], s["logits_tflops"], s["ratio_to_fp8_gemm"],
            s["topk_ms"], s["torch_topk_ms"], s["topk_speedup"]) for s in r["scenarios"]])
    sweep = [(s["name"], x["budget_gib"], x["chunks"], x["ms"], x["relative_to_8gib"])
             for s in r["scenarios"] for x in s.get("sweep", [])]
    if sweep:
        table(["scenario", "budget GiB", "chunks", "index_topk ms", "vs 8 GiB"], sweep)
    h = r["topk_headline"]
    print(f"top-k {h['rows']}x{h['cols']} k={h['k']}: {h['topk_ms']:.3f} ms vs torch.topk "
          f"{h['torch_topk_ms']:.3f} ms ({h['speedup']:.2f}x), same set as torch: {h['matches_torch_set']}")
