"""Experiment (GPU, Hopper): the switches of the warp-specialised grouped GEMM with bf16 operands
(``cpkv.kernels.fp8_gemm.gluon_ws``, no scales) against ``torch._grouped_mm`` and the copy rate of the weights.

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/grouped_bf16_sweep.py [--json]`` (about a
minute on an H200). Not part of the package.

Loads (GLM-5's expert shapes: gate_up N 4096 K 6144, down N 6144 K 2048):
  cached   256 experts, ~104 rows each, skewed (``cpkv bench moe``'s ragged load): a 90 %-cached 32K turn's
           3,328 tokens x 8 routed experts on one rank holding every expert; the weights (19.3 GB) bound it
  wide     32 experts x 1,024 rows, even: a cold prefill's shape at 8-way expert parallelism; compute-bound
Per switch set: first checked on a ragged load with empty experts and padding rows against a float32 reference
(<= 1e-2 of max |ref|, padding untouched); then both projections timed (CUDA events, median). Reported per
load: ms, TFLOP/s, the weights' read rate (bytes of every expert's weights / time) and the ratio of that rate
to ``copy_`` of a 4 GiB buffer (the memory ceiling, timed in the same run), and torch._grouped_mm's figures.
The winner (least gate_up + down time on the cached load, then the wide one) is printed as the line for
``gluon_ws.BF16``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from cpkv.bench.moe import expert_counts
from cpkv.bench.timing import event_median_s
from cpkv.kernels.fp8_gemm import gluon_ws
from cpkv.kernels.fp8_gemm.triton import tile_ends

BF = torch.bfloat16
PROJS = {"gate_up": (4096, 6144), "down": (6144, 2048)}
LOADS = {"cached": ("ragged", 256, 104), "wide": ("even", 32, 1024)}
CHECK_COUNTS = [5, 0, 130, 1, 0, 64, 3, 300, 0]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def switch_sets() -> list[dict]:
    out = []
    for wide, inflight, group_m in itertools.product((False, True), (True, False), (8, 1)):
        for stages in ((3, 2) if wide else (6, 4)):
            out.append({"stages": stages, "wide": wide, "inflight": inflight, "group_m": group_m, "epi_tma": True})
    return out


def check(sw: dict) -> float:
    worst = 0.0
    for n, k in ((384, 2048), (512, 1024)):
        e, rows = len(CHECK_COUNTS), sum(CHECK_COUNTS) + 7
        a = torch.randn(rows, k, device="cuda").to(BF)
        b = (torch.randn(e, n, k, device="cuda") * k ** -0.5).to(BF)
        offs = torch.tensor(CHECK_COUNTS, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
        c = torch.full((rows, n), 3.0, dtype=BF, device="cuda")
        gluon_ws.launch(a, None, offs, b, None, c, tile_ends(offs, 128), **sw)
        ref = torch.zeros(rows, n, device="cuda")
        s = 0
        for i, t in enumerate(offs.tolist()):
            ref[s:t] = a[s:t].float() @ b[i].float().T
            s = t
        done = sum(CHECK_COUNTS)
        err = float((c[:done].float() - ref[:done]).abs().max() / ref[:done].abs().max())
        if not bool((c[done:] == 3.0).all()):
            return float("inf")
        worst = max(worst, err)
    return worst


def operands(load: str) -> dict:
    kind, e, tokens = LOADS[load]
    counts = expert_counts(kind, e, tokens)
    r = sum(counts)
    offs = torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    ops = {"counts": counts, "offs": offs, "tiles": tile_ends(offs, 128), "rows": r}
    for proj, (n, k) in PROJS.items():
        ops[proj] = {"a": (torch.randn(r, k, device="cuda") * 0.5).to(BF),
                     "b": (torch.randn(e, n, k, device="cuda") * k ** -0.5).to(BF),
                     "c": torch.empty(r, n, dtype=BF, device="cuda"), "n": n, "k": k, "e": e}
    return ops


def rates(ops: dict, proj: str, s: float) -> dict:
    p = ops[proj]
    flops = 2.0 * ops["rows"] * p["n"] * p["k"]
    wbytes = p["e"] * p["n"] * p["k"] * 2
    return {"ms": round(s * 1e3, 3), "tflops": round(flops / s / 1e12, 1), "weights_tb_s": round(wbytes / s / 1e12, 3)}


def copy_rate() -> float:
    """TB/s (bytes read + written) of ``copy_`` between two 4 GiB buffers."""
    src = torch.empty(1 << 31, dtype=BF, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / event_median_s(lambda: dst.copy_(src), 10) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    t0 = time.time()
    copy_tb_s = copy_rate()
    log(f"copy_ {copy_tb_s:.3f} TB/s (read + write)")
    report = {"device": torch.cuda.get_device_name(), "copy_tb_s": round(copy_tb_s, 3), "loads": {}, "sets": []}
    loads = {name: operands(name) for name in LOADS}
    for name, ops in loads.items():
        row = {"rows": ops["rows"], "experts": len(ops["counts"]), "counts_min_max": [min(ops["counts"]),
                                                                                    max(ops["counts"])]}
        for proj in PROJS:
            p = ops[proj]
            s = event_median_s(lambda: torch._grouped_mm(p["a"], p["b"].transpose(1, 2), offs=ops["offs"]), args.reps)
            row[f"torch_{proj}"] = rates(ops, proj, s)
        report["loads"][name] = row
        log(f"{name}: {row}")
    for sw in switch_sets():
        entry = {"switches": sw}
        try:
            entry["check_rel_err"] = err = check(sw)
        except Exception as exc:  # a compile or launch error excludes the set
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            report["sets"].append(entry)
            log(f"{sw}: {entry['error']}")
            continue
        if not err <= 1e-2:
            entry["error"] = f"check failed: rel err {err}"
            report["sets"].append(entry)
            log(f"{sw}: {entry['error']}")
            continue
        for name, ops in loads.items():
            total = 0.0
            for proj in PROJS:
                p = ops[proj]
                s = event_median_s(lambda: gluon_ws.launch(p["a"], None, ops["offs"], p["b"], None, p["c"],
                                                           ops["tiles"], **sw), args.reps)
                entry[f"{name}_{proj}"] = r = rates(ops, proj, s)
                r["vs_torch"] = round(report["loads"][name][f"torch_{proj}"]["ms"] / r["ms"], 3)
                r["weights_vs_copy"] = round(r["weights_tb_s"] / copy_tb_s, 3)
                total += s
            entry[f"{name}_ms"] = round(total * 1e3, 3)
        report["sets"].append(entry)
        log(f"{sw}: cached {entry['cached_ms']} ms, wide {entry['wide_ms']} ms (check {err:.2e})")
    ok = [x for x in report["sets"] if "error" not in x]
    if ok:
        best = min(ok, key=lambda x: (x["cached_ms"], x["wide_ms"]))
        report["best"] = best
        line = f"BF16 = {json.dumps(best['switches']).replace('true', 'True').replace('false', 'False')}"
        log(line)
    report["seconds"] = round(time.time() - t0, 1)
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
