"""``cpkv bench attention``: sparse MLA prefill TFLOP/s at GLM-5 shapes against a bf16 GEMM.

    TFLOP/s = 2 * T * topk * H * (576 + 512) / time        (score dot + value dot, all selected keys)

The ceiling is ``torch.matmul`` of two random 8192 x 8192 bf16 matrices, timed in the same run;
the ratio is the kernel's rate over it (target >= 0.5). Indices: per query row, ``topk`` distinct
rows drawn uniformly from [0, S). Times are medians of ``triton.testing.do_bench``. Also reports
the token-KV dequant bandwidth against a device-to-device copy, and the kernel's relative error
against a float64 reference on a sample of rows.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

from cpkv.bench.timing import do_bench_ms
from cpkv.scheduler.costs import unit_costs_attention

PATTERNS = ("random", "window", "hot")
HELP = "Sparse MLA prefill attention TFLOP/s at GLM-5 shapes, against a bf16 GEMM measured in the same run."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from cpkv.cli.args import int_list, positive_int

    parser.add_argument("--heads", type=positive_int, default=64, help="query heads (default 64, GLM-5)")
    parser.add_argument("--topk", type=positive_int, default=2048, help="selected keys per query (default 2048)")
    parser.add_argument("--tokens", type=int_list, default="4096,16384", help="comma-separated query-token counts T")
    parser.add_argument("--kv-rows", type=positive_int, default=65536, help="rows S of the composed KV (default 65536)")
    parser.add_argument("--rep-ms", type=positive_int, default=200, help="do_bench repetition budget per case (ms)")
    parser.add_argument("--pattern", choices=PATTERNS, default="random",
                        help="indices: random (distinct uniform rows of [0, S)), window (a contiguous run of "
                             "topk rows per query, also timed through dense_causal_mla), hot (rows of [0, 2 topk): "
                             "L2-resident, isolates the compute side)")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate kernel config at the first T")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    import torch

    from cpkv.kernels.platform import triton_importable as triton_available
    from cpkv.errors import AttentionError

    if args.topk > args.kv_rows:
        raise AttentionError(f"--topk {args.topk}: expected at most --kv-rows ({args.kv_rows}) distinct keys per query")
    if not (torch.cuda.is_available() and triton_available()):
        raise AttentionError("cpkv bench attention needs a CUDA device and triton")
    result = _bench(args)
    _report(result, args.json)
    return 0


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    gemm = _gemm_tflops()
    copy_gbs = _copy_gbs()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "gemm_tflops": gemm, "copy_gbs": copy_gbs,
        "heads": args.heads, "topk": args.topk, "kv_rows": args.kv_rows, "pattern": args.pattern,
        "cases": [], "sweep": [],
    }
    tokens = args.tokens  # parsed by int_list
    for i, t in enumerate(tokens):
        inputs = _inputs(t, args.heads, args.topk, args.kv_rows, args.pattern)
        res["cases"].append(_case(inputs, gemm, args.rep_ms))
        if args.sweep and i == 0:
            res["sweep"] = _sweep(inputs, gemm, args.rep_ms)
        del inputs
        torch.cuda.empty_cache()
    res["dequant"] = _dequant_case(args.kv_rows, copy_gbs, args.rep_ms)
    res["costs"] = unit_costs_attention(res["cases"], args.topk)  # usable as `cpkv replay --costs`
    return res


def _gemm_tflops() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench_ms(lambda: torch.matmul(a, b), 300, warmup_ms=25)
    return 2 * 8192**3 / ms / 1e9


def _copy_gbs() -> float:
    import torch

    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src), 200, warmup_ms=25)
    return 2 * src.numel() * 2 / ms / 1e6


def _inputs(t: int, h: int, topk: int, s: int, pattern: str) -> dict[str, Any]:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(t)
    q = torch.randn(t, h, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(s, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    ks = torch.randint(0, s - topk + 1, (t,), device="cuda", generator=gen, dtype=torch.int32)
    if pattern == "window":
        idx = ks[:, None] + torch.arange(topk, device="cuda", dtype=torch.int32)[None, :]
    else:
        pool = s if pattern == "random" else min(s, 2 * topk)
        idx = torch.empty(t, topk, device="cuda", dtype=torch.int32)
        for r0 in range(0, t, 512):  # distinct uniform rows per query: top-k of random keys
            keys = torch.rand(min(512, t - r0), pool, device="cuda", generator=gen)
            idx[r0 : r0 + 512] = keys.topk(topk, dim=1).indices.to(torch.int32)
    return {"q": q, "kv": kv, "idx": idx, "ks": ks, "ke": ks + topk, "scale": 1 / math.sqrt(192 + 64),
            "pattern": pattern}


def _flops(inp: dict[str, Any]) -> float:
    t, h, _ = inp["q"].shape
    return 2.0 * t * inp["idx"].shape[1] * h * (576 + 512)


def _case(inp: dict[str, Any], gemm: float, rep_ms: int) -> dict[str, Any]:
    from cpkv.attention import sparse_mla
    from cpkv.kernels.sparse_mla import triton as kernel

    ms = do_bench_ms(lambda: sparse_mla(inp["q"], inp["kv"], inp["idx"], inp["scale"]), rep_ms, warmup_ms=25)
    tflops = _flops(inp) / ms / 1e9
    from cpkv.kernels.platform import capability

    cfg = kernel.default_config(inp["q"].shape[1], 512, 64, capability(inp["q"]))
    case = {
        "tokens": inp["q"].shape[0], "ms": ms, "tflops": tflops, "ratio": tflops / gemm,
        "config": cfg.tag(), "rel_err": _rel_err(inp),
    }
    if inp["pattern"] == "window":
        from cpkv.attention import dense_causal_mla

        dms = do_bench_ms(lambda: dense_causal_mla(inp["q"], inp["kv"], inp["ks"], inp["ke"], inp["scale"]), rep_ms, warmup_ms=25)
        case.update(dense_ms=dms, dense_tflops=_flops(inp) / dms / 1e9)
    return case


def _rel_err(inp: dict[str, Any], rows: int = 8, config: Any = None) -> float:
    """||out - ref|| / ||ref|| on the first ``rows`` query rows, reference in float64 on the device."""
    import torch

    from cpkv.attention import sparse_mla_ref
    from cpkv.kernels.sparse_mla import triton as kernel

    q, idx = inp["q"][:rows], inp["idx"][:rows]
    out, _, _ = kernel.launch(q, inp["kv"], idx, None, None, inp["scale"], 512, config)
    ref, _ = sparse_mla_ref(q, inp["kv"], idx, inp["scale"], 512, dtype=torch.float64, chunk=1)
    return float((out.double() - ref).norm() / ref.norm())


def _sweep_configs() -> list[Any]:
    """Candidate kernel configs: the Triton kernel, the one-partition Gluon kernel, the warp-specialised one."""
    from cpkv.kernels.sparse_mla import triton as kernel

    return [kernel.Config(64, 64, 8, 2), kernel.GLUON_WS]


def _sweep(inp: dict[str, Any], gemm: float, rep_ms: int) -> list[dict[str, Any]]:
    from cpkv.kernels.sparse_mla import triton as kernel

    rows = []
    for cfg in _sweep_configs():
        row: dict[str, Any] = {"config": cfg.tag()}
        try:
            call = lambda: kernel.launch(inp["q"], inp["kv"], inp["idx"], None, None, inp["scale"], 512, cfg)  # noqa: E731
            compiled = call()[2]
            ms = do_bench_ms(call, rep_ms, warmup_ms=25)
            tflops = _flops(inp) / ms / 1e9
            row.update(ms=ms, tflops=tflops, ratio=tflops / gemm, rel_err=_rel_err(inp, config=cfg),
                       regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None),
                       smem=getattr(getattr(compiled, "metadata", None), "shared", None))
        except Exception as exc:  # a config that does not fit (shared memory, registers) is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
    return rows


def _dequant_case(s: int, copy_gbs: float, rep_ms: int) -> dict[str, Any]:
    import torch

    from cpkv.attention import dequant_token_kv, quant_token_kv

    rows = quant_token_kv(torch.randn(s, 576, device="cuda"))
    ms = do_bench_ms(lambda: dequant_token_kv(rows), rep_ms, warmup_ms=25)
    gbs = s * (656 + 576 * 2) / ms / 1e6
    return {"rows": s, "ms": ms, "gbs": gbs, "ratio_to_copy": gbs / copy_gbs}


def _report(res: dict[str, Any], as_json: bool) -> None:
    from cpkv.cli.fmt import emit_json, table

    if as_json:
        emit_json(res)
        return
    print(f"{res['device']}: bf16 GEMM 8192^3 {res['gemm_tflops']:.1f} TFLOP/s, copy {res['copy_gbs']:.0f} GB/s")
    print(f"sparse MLA: H={res['heads']} topk={res['topk']} S={res['kv_rows']} d_qk=576 d_v=512, "
          f"indices {res['pattern']}")
    if res["sweep"]:
        keys = ["config", "ms", "tflops", "ratio", "rel_err", "regs", "spills", "smem", "error"]
        table(keys, [[r.get(k, "") for k in keys] for r in res["sweep"]])
    table(["T", "config", "ms", "TFLOP/s", "ratio to GEMM", "rel err", "dense TFLOP/s"],
          [[c["tokens"], c["config"], c["ms"], c["tflops"], c["ratio"], c["rel_err"], c.get("dense_tflops", "")]
           for c in res["cases"]])
    d = res["dequant"]
    print(f"dequant {d['rows']} rows: {d['ms']:.3f} ms, {d['gbs']:.0f} GB/s ({d['ratio_to_copy']:.2f} of copy)")
