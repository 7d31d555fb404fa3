"""``cpkv bench gemv``: a model's fp8 linears at decode's row counts (GLM-5 by default) on CUDA: cuBLAS
(``torch._scaled_mm``) against cpkv's Triton GEMV (``kernels/fp8_gemm/gemv.py``), each weight read from HBM.

Per linear (N x K, ``decode_shapes``) and row count M (``--rows``), four functions on the same bf16 input:

    cublas        ``fp8_linear`` with the GEMV off: the activation quantised (Triton), ``torch._scaled_mm``
    gemv          ``fp8_linear`` with the GEMV on (a Linear's own counters): the same quantisation, the GEMV
    cublas_gemm   ``torch._scaled_mm`` alone on the quantised activation (``linear._scaled_mm``)
    gemv_gemm     the GEMV alone on it

Timing: each function is captured in one CUDA graph that runs it once per copy of the weight, with enough copies
that a replay reads at least 4 x the L2 cache (each call's weight comes from HBM, as each layer's does in a decode
step); the replays are timed alternately in ``--rounds`` rounds (``do_bench`` windows, which also flush L2
before each replay), and the median divided by the copies: device time per call, no launch cost (a decode step
runs as graphs). Rates: the bytes a GEMM reads and writes (weight and its scales, activation and its scales,
bf16 output) per second of the GEMM alone, and their fraction of a device ``copy_`` measured in the same run
(``bench.timing.copy_gbs``: bytes read + written). ``gemv_vs_cublas``: cuBLAS's time / the GEMV's (> 1: the
GEMV faster), for the whole linear and for the GEMMs alone; ``max_err``: the GEMV's largest difference from
cuBLAS over cuBLAS's largest |value|. Totals per M: the sums over the linears timed.

``--sweep`` also times the GEMV alone under each of ``sweep_configs`` (one change from the default each) and reports
each one's time and the best; ``CPKV_FP8_GEMV``'s auto rows and the default config are picked from these numbers.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, replace

HELP = ("fp8 linears at decode rows (GLM-5 shapes): cpkv's Triton GEMV vs cuBLAS torch._scaled_mm, "
        "against the copy rate (CUDA).")
ROWS = (1, 4, 8, 16, 32)
L2_READS = 4  # a replay reads at least this many times the L2 cache's bytes of weights
DEVICE = "cuda"  # (a test runs the bench's assembly on the CPU under Triton's interpreter)


@dataclass(frozen=True)
class Shape:
    """One fp8 linear: y [M, n] = x [M, k] W^T."""

    name: str
    n: int
    k: int


def decode_shapes(cfg) -> list[Shape]:
    """The fp8 linears a decode step runs per layer (``cpkv.model.layer``: LINEARS and the MLPs), named as there;
    ``qkv_a``: q_a, kv_a and the indexer's wk stacked (one read of the normed input); the dense MLP's (first
    layers) and the shared experts' (MoE layers) gate_up / down."""
    d, heads = cfg.hidden_size, cfg.num_heads
    kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    shared = cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1)
    return [Shape("q_a", cfg.q_lora_rank, d), Shape("kv_a", kv_a, d), Shape("wk", cfg.index_head_dim, d),
            Shape("qkv_a", cfg.q_lora_rank + kv_a + cfg.index_head_dim, d),
            Shape("q_b", heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank),
            Shape("wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
            Shape("o_proj", d, heads * cfg.v_head_dim),
            Shape("gate_up", 2 * cfg.intermediate_size, d), Shape("down", d, cfg.intermediate_size),
            Shape("shared_gate_up", 2 * shared, d), Shape("shared_down", d, shared)]


def weight_copies(weight_bytes: int, l2_bytes: int) -> int:
    """Copies of a weight one replay walks through: at least 2, and together at least L2_READS x the L2 cache."""
    return max(2, -(-L2_READS * l2_bytes // weight_bytes))


def gemm_bytes(m: int, n: int, k: int) -> int:
    """Bytes a block-scaled GEMM reads and writes: fp8 weight + float32 block scales, fp8 activation + float32
    group scales, bf16 output."""
    g = k // 128
    return n * k + 4 * -(-n // 128) * g + m * k + 4 * m * g + 2 * m * n


def sweep_configs() -> dict:
    """Named GemvConfig variants, one change from the default each (the first: the default)."""
    from cpkv.kernels.fp8_gemm.gemv import DEFAULT, GemvConfig

    changes = {"bn64": {"block_n": 64}, "stages2": {"num_stages": 2}, "stages4": {"num_stages": 4},
               "stages6": {"num_stages": 6}, "waves2": {"waves": 2}, "waves8": {"waves": 8},
               "groups2": {"min_groups": 2}, "groups8": {"min_groups": 8}, "warps8": {"num_warps": 8},
               "reduce_kernel": {"reduce": "reduce"}, "pointer_loads": {"tma": False}}
    out: dict[str, GemvConfig] = {"default": DEFAULT}
    out.update({name: replace(DEFAULT, **c) for name, c in changes.items()})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli.args import positive_int

    p.add_argument("--model", default="glm5", help="preset or checkpoint dir whose linear shapes to use (default glm5)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)),
                   help="comma-separated row counts M, each 1..64 (default 1,4,8,16,32)")
    p.add_argument("--shapes", default=None, help="comma-separated subset of the linears (default: all; names as "
                                                  "decode_shapes: q_a, kv_a, wk, qkv_a, q_b, wq_b, o_proj, gate_up, "
                                                  "down, shared_gate_up, shared_down)")
    p.add_argument("--rounds", type=positive_int, default=3, help="alternating timing rounds (default 3)")
    p.add_argument("--sweep", action="store_true", help="also time the GEMV under sweep_configs per case")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    from cpkv.cli.args import choice_list, require_cuda
    from cpkv.model.config import load_model_config

    rows = _rows(args.rows)
    require_cuda("cuda", "cpkv bench gemv")
    cfg = load_model_config(args.model, 1)
    shapes = decode_shapes(cfg)
    if args.shapes is not None:
        chosen = choice_list(args.shapes, "--shapes", [s.name for s in shapes])
        shapes = [s for s in shapes if s.name in chosen]
    import torch

    from cpkv.bench.timing import copy_gbs

    copy = copy_gbs()
    cases = [case_row(s, m, copy, args.rounds, args.sweep) for s in shapes for m in rows]
    report = {"model": cfg.name, "device": torch.cuda.get_device_name(), "copy_gbs": round(copy, 1),
              "cases": cases, "totals": totals(cases, rows)}
    _print(report, args.json)
    return 0


def _rows(text: str) -> list[int]:
    from cpkv.config import FP8_GEMV_MAX_ROWS
    from cpkv.errors import ConfigError

    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1 or max(rows) > FP8_GEMV_MAX_ROWS:
        raise ConfigError(f"--rows: expected comma-separated row counts in 1..{FP8_GEMV_MAX_ROWS}, got {text!r}")
    return rows


def case_row(shape: Shape, m: int, copy: float, rounds: int, sweep: bool) -> dict:
    """The four functions (module docstring) on one linear at M rows: µs, GB/s, fractions, ratios, error."""
    import torch

    from cpkv.kernels import platform
    from cpkv.kernels.fp8_gemm import gemv as gv

    fns, reuse = _functions(shape, m)
    graphs = {name: _graph(fn) for name, fn in fns.items()}
    secs = alternate({name: g.replay for name, (g, _) in graphs.items()}, rounds)
    copies = len(reuse["layers"])
    us = {name: s / copies * 1e6 for name, s in secs.items()}
    nbytes = gemm_bytes(m, shape.n, shape.k)
    gemv_out, cublas_out = graphs["gemv_gemm"][1], graphs["cublas_gemm"][1]
    torch.cuda.synchronize()
    err = float((gemv_out.float() - cublas_out.float()).abs().max() / cublas_out.float().abs().max().clamp(min=1e-30))
    p = gv.plan(m, shape.n, shape.k, platform.sm_count(gemv_out))
    row = {"name": shape.name, "n": shape.n, "k": shape.k, "m": m, "weight_mb": round(shape.n * shape.k / 1e6, 2),
           "copies": copies, "split": p.split, "programs": p.programs,
           **{f"{name}_us": round(t, 2) for name, t in us.items()}}
    for name in ("cublas_gemm", "gemv_gemm"):
        gbs = nbytes / us[name] / 1e3
        row[f"{name}_gbs"] = round(gbs, 1)
        row[f"{name}_copy_frac"] = round(gbs / copy, 4)
    row["gemv_vs_cublas"] = round(us["cublas"] / us["gemv"], 3)
    row["gemm_gemv_vs_cublas"] = round(us["cublas_gemm"] / us["gemv_gemm"], 3)
    row["max_err"] = round(err, 5)
    if sweep:
        row["sweep_us"] = sweep_row(reuse)
        row["sweep_best"] = min(row["sweep_us"], key=row["sweep_us"].get)
    return row


def _functions(shape: Shape, m: int) -> tuple[dict, dict]:
    """The four functions over the weight's copies, and what the sweep reuses (layers, input, its QuantAct)."""
    import torch

    from cpkv.kernels.fp8_gemm import gemv as gv
    from cpkv.kernels.platform import Backends
    from cpkv.model import linear as lin
    from cpkv.model.weights import quant_fp8_blocks

    gen = torch.Generator(device=DEVICE).manual_seed(shape.n * 7 + shape.k + m)
    w, ws = quant_fp8_blocks(torch.randn(shape.n, shape.k, generator=gen, device=DEVICE) / shape.k ** 0.5)
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
    on, off = Backends(triton=True, fp8_gemv_rows=gv.MAX_ROWS), Backends(triton=True, fp8_gemv_rows=0)
    copies = [(w.clone(), ws.clone()) for _ in range(weight_copies(w.numel(), l2))]
    layers = [(lin.Linear(wc, sc, on), lin.Linear(wc, sc, off)) for wc, sc in copies]  # one weight, both paths
    del w, ws, copies
    x = torch.randn(m, shape.k, generator=gen, device=DEVICE).to(torch.bfloat16)
    xa = lin.quant_act(x, on)
    fns = {"cublas": lambda: [b(x) for _, b in layers][-1],
           "gemv": lambda: [a(x) for a, _ in layers][-1],
           "cublas_gemm": lambda: [lin._scaled_mm(xa, b.weight, b.scale) for _, b in layers][-1],
           "gemv_gemm": lambda: [gv.gemv(xa.q, xa.s, a.weight, a.scale, tickets=a.tickets) for a, _ in layers][-1]}
    return fns, {"layers": [a for a, _ in layers], "xa": xa}


def _graph(fn):
    """(fn captured in a CUDA graph after two warm-up calls on a side stream, the graph's output)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def sweep_row(reuse: dict) -> dict[str, float]:
    """µs per call of the GEMV alone under each ``sweep_configs`` config (graphs over the same copies)."""
    from cpkv.kernels.fp8_gemm import gemv as gv

    layers, xa = reuse["layers"], reuse["xa"]
    fns = {name: (lambda c=c: [gv.gemv(xa.q, xa.s, a.weight, a.scale, tickets=a.tickets, cfg=c) for a in layers][-1])
           for name, c in sweep_configs().items()}
    graphs = {name: _graph(fn)[0] for name, fn in fns.items()}
    secs = alternate({name: g.replay for name, g in graphs.items()}, 1)
    return {name: round(s / len(layers) * 1e6, 2) for name, s in secs.items()}


def alternate(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each function, timed in turn in each of ``rounds`` rounds (``do_bench`` windows)."""
    from cpkv.bench.timing import do_bench_ms

    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench_ms(fn) / 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def totals(cases: list[dict], rows: list[int]) -> list[dict]:
    """Per M: the summed µs of each function over the linears timed, and the GEMV's speed-up on the sums."""
    out = []
    for m in rows:
        mine = [c for c in cases if c["m"] == m]
        sums = {f: round(sum(c[f"{f}_us"] for c in mine), 2) for f in ("cublas", "gemv", "cublas_gemm", "gemv_gemm")}
        out.append({"m": m, **{f"{f}_us": v for f, v in sums.items()},
                    "gemv_vs_cublas": round(sums["cublas"] / sums["gemv"], 3),
                    "gemm_gemv_vs_cublas": round(sums["cublas_gemm"] / sums["gemv_gemm"], 3)})
    return out


def _print(rep: dict, as_json: bool) -> None:
    from cpkv.cli.fmt import emit_json, table

    if as_json:
        emit_json(rep)
        return
    table(("linear", "N x K", "M", "split", "cuBLAS µs", "GEMV µs", "speed-up", "cuBLAS GEMM µs", "GEMV GEMM µs",
           "GEMM speed-up", "cuBLAS copy", "GEMV copy", "GEMV GB/s", "max err"),
          [(c["name"], f"{c['n']} x {c['k']}", c["m"], c["split"], c["cublas_us"], c["gemv_us"],
            f"{c['gemv_vs_cublas']:.2f}x", c["cublas_gemm_us"], c["gemv_gemm_us"], f"{c['gemm_gemv_vs_cublas']:.2f}x",
            f"{c['cublas_gemm_copy_frac']:.1%}", f"{c['gemv_gemm_copy_frac']:.1%}", c["gemv_gemm_gbs"],
            f"{c['max_err']:.1e}") for c in rep["cases"]])
    print()
    table(("M", "cuBLAS µs", "GEMV µs", "speed-up", "cuBLAS GEMM µs", "GEMV GEMM µs", "GEMM speed-up"),
          [(t["m"], t["cublas_us"], t["gemv_us"], f"{t['gemv_vs_cublas']:.2f}x", t["cublas_gemm_us"], t["gemv_gemm_us"],
            f"{t['gemm_gemv_vs_cublas']:.2f}x") for t in rep["totals"]])
    swept = [c for c in rep["cases"] if "sweep_us" in c]
    if swept:
        print()
        names = list(swept[0]["sweep_us"])
        table(("linear", "M", *[f"{n} µs" for n in names], "best"),
              [(c["name"], c["m"], *[c["sweep_us"][n] for n in names], c["sweep_best"]) for c in swept])
    print(f"\n{rep['model']} fp8 linears at decode rows ({rep['device']}); device time per call from CUDA graphs over "
          f"weight copies (HBM reads); copy rate {rep['copy_gbs']} GB/s (read + written) measured in the same run; "
          "speed-up = cuBLAS time / GEMV time; linear = activation quantisation + GEMM")
