"""Experiment (GPU, Hopper): variants x configs of the grouped block-scaled fp8 expert GEMM
(``cpkv.kernels.fp8_gemm.triton``, VARIANTS) against the dense block-scaled ``torch._scaled_mm`` of equal FLOPs.

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/grouped_fp8_sweep.py [--json]`` (a minute or
so on an H200, Triton compiles included; ``--budget-s`` stops starting new configs past that many seconds).
Not part of the package. The variants the earlier sweeps measured slower were deleted (BENCHMARKS.md); this
sweep re-times the kept ones: the model's kernel, two other Gluon forms and the Triton baselines v16 / v4.

Per variant x config (the model's kernel first, then the other Gluon forms, then the Triton ones; a GLUON
variant whose kernel does not apply on this machine is excluded, not timed as its Triton fallback):
  1. correctness on a ragged load with empty experts and 7 padding rows (9 experts, counts 5 0 130 1 0 64 3
     300 0; N 384 K 2048 and N 256 K 6144; one zero activation group): max |c - ref| / max |ref| against the
     float32 reference ``grouped_fp8_ref``, <= 1e-2, padding rows untouched; a failure (or a compile error)
     excludes the config
  2. time (CUDA events, median of --iters runs after warm-up) at --experts x --tokens rows (32 x 1024, even)
     for GLM-5's two projections, gate_up (N 4096, K 6144) and down (N 6144, K 2048); the timed output is
     checked against the float32 reference too
Then the dense block-scaled ``torch._scaled_mm`` at the same [R, K] x [K, N] (timed before and after the sweep)
and ``torch._grouped_mm`` bf16, and the best configs on the skewed load of ``cpkv bench moe``. Printed: a table,
the winner (least gate_up + down time) and the line selecting it in ``kernels/fp8_gemm/triton.py``
(``GROUPED = ...``, also on stderr); with ``--json`` one JSON object on stdout (progress on stderr).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from cpkv.bench.moe import expert_counts
from cpkv.bench.timing import event_median_s
from cpkv.kernels.fp8_gemm import triton as kern
from cpkv.kernels.fp8_gemm.ref import grouped_fp8_ref
from cpkv.model.linear import empty_quant

FP8 = torch.float8_e4m3fn
PROJS = {"gate_up": (4096, 6144), "down": (6144, 2048)}  # GLM-5: (N, K) = (2 I, D) and (D, I)
CHECK_COUNTS = [5, 0, 130, 1, 0, 64, 3, 300, 0]
CHECK_SHAPES = [(384, 2048), (256, 6144)]
TOL = 1e-2
DEV = "cuda"  # "cpu" with --smoke-cpu (TRITON_INTERPRET=1, tiny shapes: checks this script, times nothing real)


def _cfg(bm: int, bn: int, w: int, st: int) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}


# (variant, config), the model's first (--budget-s skips the tail): 10 configs, compiles of a second or two each.
# The warp-specialised Gluon kernel (GLUON variants: 128 x 128 tiles, two consumer warpgroups of 4 warps,
# num_stages = TMA ring depth; compiled offline for sm_90a without spills; ``_tma``: the TMA-store epilogue,
# ``_ah``: next tile's lookup and scales before the epilogue, ``_n256``: 128 x 256 tiles, BLOCK_N in the config
# stays 128, the variant sets it; 6 stages + their 32 KB of output buffers = 229,672 B of shared memory, n256 3
# stages + 64 KB 213,248 B), then the Triton ones: v16 (scales prefetched a K block ahead, the expert map in
# registers; ptxas: 196 registers at 128 x 128 x 8 warps) and v4, at 128 x 128 x 8 warps (BLOCK_N 256 and
# 128 x 128 at 4 warps spill).
_GLUON = [  # (variant, stages): the measured best of each first
    ("gluon_ws_n256_g8_tma_ah", 2), ("gluon_ws_pair_g8_tma_ah", 6), ("gluon_ws_g8_tma_ah", 4),
    ("gluon_ws_n256_g8_tma_ah", 3), ("gluon_ws_pair_g8_tma_ah", 4), ("gluon_ws_g8_tma_ah", 6)]
SWEEP = (
    [(v, _cfg(128, 128, 4, st)) for v, st in _GLUON]
    + [(v, _cfg(*c)) for v in ("v16", "v4") for c in ((128, 128, 8, 4), (128, 128, 8, 3))]
)


def _interpreter_index_patch() -> None:
    """--smoke-cpu: Triton 3.6's interpreter takes int() of 1-element arrays for loop bounds, which numpy >= 2.3
    refuses; give its tensors an ``__index__`` through .item() (as tests/kernels/test_fp8_gemm_variants.py)."""
    import triton.runtime.interpreter as ti

    patch = getattr(ti, "_patch_lang_tensor", None)
    if patch is None:
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    ti._patch_lang_tensor = patched


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_s(fn, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs, each timed by its own pair of CUDA events (after a
    warm-up: ``cpkv.bench.timing.event_median_s``); on CPU (``--smoke-cpu``) one timed call."""
    if DEV == "cpu":
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return event_median_s(fn, iters)


def operands(counts: list[int], n: int, k: int, pad: int = 0, seed: int = 0) -> dict:
    """Random fp8 operands of one grouped GEMM: rows sorted by expert (``counts``), ``pad`` rows past them."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    e, r = len(counts), sum(counts) + pad
    g = -(-k // 128)
    a = (torch.randn(r, k, device=DEV, generator=gen) * 0.5).to(FP8)
    a_s = torch.rand(r, g, device=DEV, generator=gen) + 0.5
    w = (torch.randn(e, n, k, device=DEV, generator=gen) * 0.5).to(FP8)
    ws = torch.rand(e, -(-n // 128), g, device=DEV, generator=gen) * 0.01 + 0.001
    offs = torch.tensor(counts, dtype=torch.int32, device=DEV).cumsum(0, dtype=torch.int32)
    return {"a": a, "a_s": a_s, "w": w, "ws": ws, "offs": offs, "rows": sum(counts)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def gluon_refusal(variant: str, op: dict) -> str | None:
    """Why the Gluon kernel would not run this variant's call (the dispatcher would then time the Triton
    fallback under the Gluon variant's name: excluded instead); None for Triton variants."""
    if not kern.VARIANTS[variant].get("GLUON"):
        return None
    from cpkv.kernels.fp8_gemm import gluon_ws

    c = torch.empty(1, op["w"].shape[1], dtype=torch.bfloat16, device=DEV).expand(op["a"].shape[0], -1)
    return gluon_ws.applies(op["a"], op["w"], c)


def run_gemm(op: dict, variant: str, cfg: dict, c: torch.Tensor, tiles: torch.Tensor) -> None:
    kern.grouped_gemm(op["a"], op["a_s"], op["offs"], op["w"], op["ws"], c, tiles, config=cfg,
                      variant=variant)


def check(variant: str, cfg: dict, checks: list[tuple[dict, torch.Tensor]]) -> float:
    """Max relative error over the ragged checks; raises AssertionError when padding rows were written."""
    worst = 0.0
    for op, want in checks:
        c = torch.full((op["a"].shape[0], op["w"].shape[1]), 3.0, dtype=torch.bfloat16, device=DEV)
        run_gemm(op, variant, cfg, c, kern.tile_ends(op["offs"], cfg["BLOCK_M"]))
        done = op["rows"]
        assert bool((c[done:] == 3.0).all()), "padding rows written"
        worst = max(worst, rel_err(c[:done], want[:done]))
    return worst


def dense_fn(op: dict):
    """The ceiling: one block-scaled ``torch._scaled_mm`` [R, K] x [K, N] with expert 0's weight (as ``cpkv bench
    moe``); a float matmul of the same shape with --smoke-cpu."""
    a, w0, ws0, a_col = op["a"], op["w"][0], op["ws"][0], op["a_col"]
    if DEV == "cpu":
        af, wf = a.float(), w0.float()
        return lambda: af @ wf.t()
    return lambda: torch._scaled_mm(a, w0.t(), scale_a=a_col, scale_b=ws0.t(), out_dtype=torch.bfloat16)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    p.add_argument("--budget-s", type=float, default=200.0, help="no new config starts past this many seconds")
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke_cpu:  # TRITON_INTERPRET=1 ... --smoke-cpu --variants v4,v16 --experts 2 --tokens 40 --iters 1
        global DEV, PROJS, CHECK_SHAPES
        DEV, PROJS, CHECK_SHAPES = "cpu", {"gate_up": (256, 384), "down": (384, 256)}, [(384, 256), (256, 384)]
        kern._sm_count = lambda index: 2
        _interpreter_index_patch()
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    only = {v for v in args.variants.split(",") if v}
    sweep = [(v, c) for v, c in SWEEP if not only or v in only]

    checks = []
    for n, k in CHECK_SHAPES:
        op = operands(CHECK_COUNTS, n, k, pad=7, seed=n + k)
        op["a"].view(torch.uint8)[6, 128:256] = 0  # a zero activation group (scale 0)
        op["a_s"][6, 1] = 0
        checks.append((op, grouped_fp8_ref(op["a"], op["a_s"], op["offs"], op["w"], op["ws"])))

    counts = [args.tokens] * args.experts
    ops, refs, dense, bf16 = {}, {}, {}, {}
    for proj, (n, k) in PROJS.items():
        op = operands(counts, n, k, seed=1)
        ops[proj] = op
        refs[proj] = grouped_fp8_ref(op["a"], op["a_s"], op["offs"], op["w"], op["ws"]).to(torch.bfloat16)
        a_col = empty_quant(op["rows"], k, torch.device(DEV))[1]
        a_col.copy_(op["a_s"])
        op["a_col"] = a_col
        dense[proj] = [median_s(dense_fn(op), args.iters)]
        ab, wb = op["a"].to(torch.bfloat16), op["w"].to(torch.bfloat16)
        if DEV == "cuda":
            bf16[proj] = median_s(lambda: torch._grouped_mm(ab, wb.transpose(1, 2), offs=op["offs"]), args.iters)
        else:
            bf16[proj] = median_s(lambda: ab @ wb[0].t(), args.iters)
        del ab, wb
    flops = {proj: 2.0 * args.experts * args.tokens * n * k for proj, (n, k) in PROJS.items()}
    log("dense fp8: " + ", ".join(f"{p} {flops[p] / dense[p][0] / 1e12:.0f} TFLOP/s" for p in PROJS)
        + f" ({time.time() - t0:.0f} s)")

    results = []
    for variant, cfg in sweep:
        row = {"variant": variant, "config": cfg}
        results.append(row)
        if time.time() - t0 > args.budget_s:
            row["error"] = "skipped: over --budget-s"
            continue
        t1 = time.time()
        try:
            why = gluon_refusal(variant, ops["gate_up"])
            if why:
                raise RuntimeError(f"the Gluon kernel does not apply here ({why})")
            row["check_rel_err"] = check(variant, cfg, checks)
            if row["check_rel_err"] > TOL:
                raise AssertionError(f"ragged check: rel err {row['check_rel_err']:.3g} > {TOL}")
            for proj, op in ops.items():
                c = torch.empty(op["rows"], op["w"].shape[1], dtype=torch.bfloat16, device=DEV)
                tiles = kern.tile_ends(op["offs"], cfg["BLOCK_M"])
                run_gemm(op, variant, cfg, c, tiles)
                err = rel_err(c, refs[proj].float())
                if err > TOL:
                    raise AssertionError(f"{proj} at {args.experts} x {args.tokens}: rel err {err:.3g} > {TOL}")
                row[f"{proj}_rel_err"] = err
                s = median_s(lambda: run_gemm(op, variant, cfg, c, tiles), args.iters)
                row[f"{proj}_ms"] = s * 1e3
                row[f"{proj}_tflops"] = flops[proj] / s / 1e12
        except Exception as exc:  # compile errors (shared memory, registers) and failed checks exclude it
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        row["wall_s"] = round(time.time() - t1, 1)
        log(f"{variant} {cfg}: " + (row.get("error") or " ".join(f"{p} {row[p + '_tflops']:.0f}" for p in PROJS))
            + f" ({row['wall_s']} s, total {time.time() - t0:.0f} s)")

    for proj, op in ops.items():  # the ceiling again, after the sweep (clocks, thermals)
        dense[proj].append(median_s(dense_fn(op), args.iters))
    dense_s = {proj: statistics.mean(v) for proj, v in dense.items()}
    ok = [r for r in results if "error" not in r]
    for r in ok:
        for proj in PROJS:
            r[f"{proj}_vs_dense"] = dense_s[proj] / (r[f"{proj}_ms"] / 1e3)
        r["total_ms"] = sum(r[f"{proj}_ms"] for proj in PROJS)
    ok.sort(key=lambda r: r["total_ms"])

    ragged = expert_counts("ragged", args.experts, args.tokens)
    best_per_variant = {}
    for r in ok:
        best_per_variant.setdefault(r["variant"], r)
    ragged_ops = {proj: operands(ragged, n, k, seed=2) for proj, (n, k) in PROJS.items()} if ok else {}
    for r in list(best_per_variant.values())[:4]:  # the skewed load of ``cpkv bench moe`` for the leaders
        for proj, (n, k) in PROJS.items():
            op = ragged_ops[proj]
            c = torch.empty(op["rows"], n, dtype=torch.bfloat16, device=DEV)
            tiles = kern.tile_ends(op["offs"], r["config"]["BLOCK_M"])
            s = median_s(lambda: run_gemm(op, r["variant"], r["config"], c, tiles), args.iters)
            r[f"ragged_{proj}_tflops"] = flops[proj] / s / 1e12
            r[f"ragged_{proj}_vs_dense"] = dense_s[proj] / s

    winner = ok[0] if ok else None
    line = (f"GROUPED: dict = {{\"variant\": \"{winner['variant']}\", \"config\": {json.dumps(winner['config'])}}}"
            if winner else None)
    report = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke, Triton interpreter)",
              "experts": args.experts, "tokens": args.tokens,
              "iters": args.iters,
              "dense_fp8_tflops": {p: flops[p] / dense_s[p] / 1e12 for p in PROJS},
              "dense_fp8_tflops_before_after": {p: [flops[p] / s / 1e12 for s in dense[p]] for p in PROJS},
              "grouped_bf16_tflops": {p: flops[p] / bf16[p] / 1e12 for p in PROJS},
              "results": ok + [r for r in results if "error" in r],
              "best_per_variant": {v: {"config": r["config"], **{f"{p}_vs_dense": r[f"{p}_vs_dense"] for p in PROJS}}
                                   for v, r in best_per_variant.items()},
              "winner": winner, "grouped_line": line, "wall_s": round(time.time() - t0, 1)}
    log(f"winner: {line}")
    if args.json:
        print(json.dumps(report, indent=1, default=float))
        return 0
    hdr = ("variant", "BM", "BN", "warps", "stages", "check err", "gate_up TF/s", "down TF/s", "gate_up/dense",
           "down/dense", "ragged g/d", "ragged d/d")
    print(" | ".join(hdr))
    for r in ok:
        c = r["config"]
        print(" | ".join(str(x) for x in (
            r["variant"], c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"], f"{r['check_rel_err']:.2e}",
            f"{r['gate_up_tflops']:.0f}", f"{r['down_tflops']:.0f}", f"{r['gate_up_vs_dense']:.3f}",
            f"{r['down_vs_dense']:.3f}", f"{r.get('ragged_gate_up_vs_dense', float('nan')):.3f}",
            f"{r.get('ragged_down_vs_dense', float('nan')):.3f}")))
    for r in results:
        if "error" in r:
            print(f"excluded {r['variant']} {r['config']}: {r['error']}")
    print(f"dense fp8 TFLOP/s: {report['dense_fp8_tflops']}; grouped bf16: {report['grouped_bf16_tflops']}")
    print(f"winner: {line}  (wall {report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
