"""``cpkv bench moe``: the routed experts' GEMMs at a model's shapes (GLM-5: D 6144, I 2048) on CUDA.

Per expert load (``even``: every local expert gets ``--tokens`` rows; ``ragged``: the same total routed with a
skewed random distribution, two experts empty) and per projection (gate_up: [R, D] x [2I, D]^T per expert;
down: [R, I] x [D, I]^T), four GEMMs over the same R rows, timed alternately in ``--rounds`` rounds:

    grouped fp8      the Triton block-scaled grouped GEMM (``kernels/fp8_gemm``): rows sorted by expert,
                     device offsets, 1 x 128 activation and 128 x 128 weight scales
    dense fp8        ``torch._scaled_mm`` with the same block scales on one [R, K] x [K, N] product: the same
                     FLOPs, no grouping (the ceiling the grouped kernel is held to)
    grouped bf16     ``torch._grouped_mm`` on the bf16 weights
    dense bf16       one bf16 ``torch.mm`` of the same FLOPs
    grouped bf16 gluon  (Hopper with Gluon) the kernel the model runs for bf16 experts: the warp-specialised
                     grouped GEMM unscaled (``gluon_ws.BF16``); ``bf16_gluon_vs_grouped_mm`` = its speed-up

TFLOP/s = 2 R N K / median time; ``grouped_vs_dense`` = grouped fp8 / dense fp8 (the grouped GEMM should stay >= 0.80 of dense).
Then the whole expert MLP (``model.experts.grouped_swiglu``: quantise, gate_up, SwiGLU + quantise, down) with
fp8 and with bf16 experts.
"""
from __future__ import annotations

import argparse
import statistics

HELP = "Routed-expert GEMMs: grouped fp8 (Triton) vs dense block-scaled fp8 at equal FLOPs, and bf16 (CUDA)."
LOADS = ("even", "ragged")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli.args import positive_int

    p.add_argument("--model", default="glm5", help="preset or checkpoint dir whose expert shapes to use (default glm5)")
    p.add_argument("--experts", type=positive_int, default=32, help="local experts (default 32: 256 over 8 ranks)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="rows per expert on average (default 1024)")
    p.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated subset of {', '.join(LOADS)}")
    p.add_argument("--rounds", type=positive_int, default=3, help="alternating timing rounds (default 3)")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from cpkv.cli.args import require_cuda
    from cpkv.errors import ConfigError
    from cpkv.model.config import load_model_config

    loads = [x for x in args.loads.split(",") if x]
    bad = [x for x in loads if x not in LOADS]
    if bad or not loads:
        raise ConfigError(f"--loads: expected a comma-separated subset of {', '.join(LOADS)}, got {args.loads!r}")
    require_cuda("cuda", "cpkv bench moe")
    cfg = load_model_config(args.model, 1)
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    rows, mlp = [], []
    for load in loads:
        counts = expert_counts(load, args.experts, args.tokens)
        for proj, (n, k) in (("gate_up", (2 * i, d)), ("down", (d, i))):
            rows.append({"load": load, "proj": proj, **gemm_row(counts, n, k, args.rounds)})
        mlp.append({"load": load, **swiglu_row(counts, d, i, args.rounds)})
    import torch

    report = {"model": cfg.name, "hidden": d, "moe_intermediate": i, "experts": args.experts, "tokens": args.tokens,
              "device": torch.cuda.get_device_name(), "gemms": rows, "mlp": mlp}
    _print(report, args.json)
    return 0


def expert_counts(load: str, experts: int, tokens: int, seed: int = 0) -> list[int]:
    """Rows per expert summing to experts x tokens: equal, or skewed (log-normal weights, two experts empty)."""
    import torch

    total = experts * tokens
    if load == "even":
        return [tokens] * experts
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(experts, generator=gen).mul(0.6).exp()
    p[: min(2, experts - 1)] = 0
    counts = torch.multinomial(p / p.sum(), total, replacement=True, generator=gen).bincount(minlength=experts)
    return counts.tolist()


def _operands(counts: list[int], n: int, k: int):
    import torch

    from cpkv.model.linear import empty_quant

    e, r = len(counts), sum(counts)
    dev = "cuda"
    w = (torch.randn(e, n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
    ws = torch.rand(e, -(-n // 128), -(-k // 128), device=dev) * 0.01 + 0.001
    a = (torch.randn(r, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
    a_s = torch.rand(r, -(-k // 128), device=dev) + 0.5  # row-major, as the model's expert MLP allocates them
    a_col = empty_quant(r, k, torch.device(dev))[1]
    a_col.copy_(a_s)
    offs = torch.tensor(counts, dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
    return w, ws, a, a_s, a_col, offs


def gemm_row(counts: list[int], n: int, k: int, rounds: int) -> dict:
    """The four GEMMs of one projection (module docstring) -> TFLOP/s and ratios."""
    import torch

    from cpkv.kernels.fp8_gemm import triton as kern

    w, ws, a, a_s, a_col, offs = _operands(counts, n, k)
    tiles = kern.tile_ends(offs)  # built once per set of offsets (grouped_swiglu shares it by two GEMMs)
    r = a.shape[0]
    c = torch.empty(r, n, dtype=torch.bfloat16, device="cuda")
    wb, ab = w.to(torch.bfloat16), a.to(torch.bfloat16)
    fns = {
        "grouped_fp8": lambda: kern.grouped_gemm(a, a_s, offs, w, ws, c, tiles),
        "dense_fp8": lambda: torch._scaled_mm(a, w[0].t(), scale_a=a_col, scale_b=ws[0].t(), out_dtype=torch.bfloat16),
        "grouped_bf16": lambda: torch._grouped_mm(ab, wb.transpose(1, 2), offs=offs),
        "dense_bf16": lambda: torch.mm(ab, wb[0].t()),
    }
    from cpkv.kernels.fp8_gemm import gluon_ws

    if gluon_ws.applies(ab, wb, c) is None:  # the bf16 experts' kernel (Hopper): the warp-specialised one, unscaled
        fns["grouped_bf16_gluon"] = lambda: gluon_ws.launch(ab, None, offs, wb, None, c, tiles, **gluon_ws.BF16)
    secs = alternate(fns, rounds)
    flops = 2.0 * r * n * k
    out = {"rows": r, "n": n, "k": k, "counts_min_max": [min(counts), max(counts)]}
    out.update({f"{name}_tflops": round(flops / s / 1e12, 1) for name, s in secs.items()})
    out["grouped_vs_dense"] = round(secs["dense_fp8"] / secs["grouped_fp8"], 4)
    out["fp8_vs_bf16_grouped"] = round(secs["grouped_bf16"] / secs["grouped_fp8"], 4)
    if "grouped_bf16_gluon" in secs:
        out["bf16_gluon_vs_grouped_mm"] = round(secs["grouped_bf16"] / secs["grouped_bf16_gluon"], 4)
    return out


def swiglu_row(counts: list[int], d: int, i: int, rounds: int) -> dict:
    """The whole expert MLP with fp8 and with bf16 experts: ms and TFLOP/s (3 GEMMs' FLOPs)."""
    import torch

    from cpkv.model.experts import ExpertWeights, grouped_swiglu

    gu, gus, x8, *_ = _operands(counts, 2 * i, d)
    dn, dns, *_, offs = _operands(counts, d, i)
    r = x8.shape[0]
    xs = x8.to(torch.bfloat16)
    rw = torch.rand(r, device="cuda")
    fp8 = ExpertWeights(gu, dn, gus, dns)
    bf16 = ExpertWeights(gu.to(torch.bfloat16), dn.to(torch.bfloat16))
    secs = alternate({"fp8": lambda: grouped_swiglu(xs, offs, rw, fp8),
                      "bf16": lambda: grouped_swiglu(xs, offs, rw, bf16)}, rounds)
    flops = 2.0 * r * 3 * d * i
    return {"rows": r, **{f"{k}_ms": round(s * 1e3, 3) for k, s in secs.items()},
            **{f"{k}_tflops": round(flops / s / 1e12, 1) for k, s in secs.items()},
            "fp8_vs_bf16": round(secs["bf16"] / secs["fp8"], 4)}


def alternate(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each function, timed in turn in each of ``rounds`` rounds (``do_bench`` windows)."""
    from cpkv.bench.timing import do_bench_ms

    for fn in fns.values():  # compile / autotune first
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench_ms(fn) / 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _print(rep: dict, as_json: bool) -> None:
    from cpkv.cli.fmt import emit_json, table

    if as_json:
        emit_json(rep)
        return
    table(("load", "proj", "rows", "N x K", "grouped fp8", "dense fp8", "grouped bf16", "bf16 gluon", "dense bf16",
           "grouped/dense"),
          [(r["load"], r["proj"], r["rows"], f"{r['n']} x {r['k']}", r["grouped_fp8_tflops"], r["dense_fp8_tflops"],
            r["grouped_bf16_tflops"], r.get("grouped_bf16_gluon_tflops", "-"), r["dense_bf16_tflops"],
            f"{r['grouped_vs_dense']:.1%}") for r in rep["gemms"]])
    print()
    table(("load", "rows", "fp8 ms", "bf16 ms", "fp8 TFLOP/s", "bf16 TFLOP/s", "fp8 speed-up"),
          [(m["load"], m["rows"], m["fp8_ms"], m["bf16_ms"], m["fp8_tflops"], m["bf16_tflops"], f"{m['fp8_vs_bf16']:.2f}x")
           for m in rep["mlp"]])
    print(f"\n{rep['model']} expert shapes (D {rep['hidden']}, I {rep['moe_intermediate']}), {rep['experts']} local experts "
          f"x {rep['tokens']} rows on average ({rep['device']}); TFLOP/s of each GEMM, ceiling: the dense block-scaled "
          "GEMM of the same FLOPs in the same run")
