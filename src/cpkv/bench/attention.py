"""``cpkv bench attention``: sparse MLA prefill TFLOP/s at GLM-5 shapes against a bf16 GEMM.

    TFLOP/s = 2 * T * topk * H * (576 + 512) / time        (score dot + value dot, all selected keys)

The ceiling is ``torch.matmul`` of two random 8192 x 8192 bf16 matrices, timed in the same run;
the ratio is the kernel's rate over it (target >= 0.5). Indices: per query row, ``topk`` distinct
rows drawn uniformly from [0, S). Times are medians of ``triton.testing.do_bench``. Also reports
the token-KV dequant and quant bandwidth against a device-to-device ``copy_`` moving the same number of
bytes, and the kernel's relative error against a float64 reference on a sample of rows.

``--peer flashmla`` also times FlashMLA's ``flash_mla_sparse_fwd`` (deepseek-ai/FlashMLA, built from
source; the ``flash_mla`` package must import) and cpkv's sparse MLA on the same inputs, in alternating
rounds of CUDA-event-timed calls, compares their outputs (cosine difference, largest difference, lse), and
reports cpkv / FlashMLA per shape: FlashMLA's benchmark shapes (h 128) and GLM-5's (h 64) by default.
cpkv's full-size output is also checked against a float64 reference on 12 rows (start, middle and end: the
persistent kernel reaches the last rows late in its tile loop).

``--decode`` times the sparse decode kernel over paged fp8 rows instead (``cpkv.bench.attention_decode``): B
generations of one token each (``--batches``), against the paged step's gather + dequant + prefill kernel and,
with ``--peer flashmla``, FlashMLA's ``flash_mla_with_kvcache`` with indices.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

from cpkv.bench.compare import compare_outputs as _compare_outputs
from cpkv.bench.timing import copy_gbs, do_bench_ms
from cpkv.scheduler.costs import unit_costs_attention

PATTERNS = ("random", "window", "hot")
PEERS = ("flashmla",)
# (s_q, s_kv, h_q): FlashMLA's sparse prefill benchmark shapes (d_qk 576, d_v 512) and GLM-5's 64 heads
PEER_SHAPES = ((4096, 8192, 128), (4096, 32768, 128), (4096, 131072, 128), (4096, 65536, 64), (16384, 65536, 64))
# token-KV launch shapes (rows per program, warps) timed by --sweep
KV_LAUNCHES = ((16, 4), (8, 4), (32, 4), (32, 8), (64, 8), (16, 8))
HELP = "Sparse MLA prefill attention TFLOP/s at GLM-5 shapes, against a bf16 GEMM measured in the same run."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from cpkv.cli import args as a
    from cpkv.cli.args import int_list

    parser.add_argument("--heads", type=a.bounded_int(1, 4096), default=64, help="query heads (default 64, GLM-5)")
    parser.add_argument("--topk", type=a.bounded_int(1, 1 << 20), default=2048, help="selected keys per query (default 2048)")
    parser.add_argument("--tokens", type=int_list, default="4096,16384", help="comma-separated query-token counts T")
    parser.add_argument("--kv-rows", type=a.bounded_int(1, 1 << 30), default=65536, help="rows S of the composed KV (default 65536)")
    parser.add_argument("--rep-ms", type=a.bounded_int(1, 3_600_000), default=200, help="do_bench repetition budget per case (ms)")
    parser.add_argument("--pattern", choices=PATTERNS, default="random",
                        help="indices: random (distinct uniform rows of [0, S)), window (a contiguous run of "
                             "topk rows per query, also timed through dense_causal_mla), hot (rows of [0, 2 topk): "
                             "L2-resident, isolates the compute side); the --peer comparison uses them too")
    parser.add_argument("--sweep", action="store_true",
                        help="also time every candidate kernel config at the first T, and the token-KV launch shapes; "
                             "--decode: every candidate launch shape at every B, beside the first kernel's")
    parser.add_argument("--kv-quant-rows", type=a.bounded_int(1, 1 << 30), default=1 << 20,
                        help="token-KV rows of the dequant / quant cases (default 1,048,576)")
    parser.add_argument("--peer", choices=PEERS, default=None,
                        help="also time a peer kernel on the same inputs, alternating rounds: flashmla = FlashMLA's "
                             "flash_mla_sparse_fwd (the flash_mla package must import)")
    parser.add_argument("--peer-shapes", type=_shape_list, default=None,
                        help="S_Q:S_KV:H,... shapes of the peer comparison (default: FlashMLA's benchmark shapes "
                             "and GLM-5's h 64)")
    parser.add_argument("--peer-rounds", type=a.bounded_int(1, 10_000), default=7, help="alternating timing rounds per peer shape")
    parser.add_argument("--decode", action="store_true",
                        help="time the sparse decode kernel over paged fp8 token rows (cpkv.bench.attention_decode) "
                             "instead of the prefill kernel; --peer flashmla: FlashMLA's flash_mla_with_kvcache")
    parser.add_argument("--batches", type=int_list, default="1,8,32",
                        help="--decode: comma-separated generation counts B (one query token each)")
    parser.add_argument("--pools", type=a.bounded_int(1, 64), default=2,
                        help="--decode: pools the selected rows are spread over (CP ranks; default 2)")
    parser.add_argument("--pool-rows", type=a.bounded_int(64, 1 << 26), default=131072,
                        help="--decode: 656-byte rows per pool, a multiple of 64 (default 131072)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _shape_list(text: str) -> list[tuple[int, int, int]]:
    """'4096:8192:128,16384:65536:64' -> [(4096, 8192, 128), (16384, 65536, 64)] (each count >= 1)."""
    try:
        shapes = [tuple(int(v) for v in part.split(":")) for part in text.split(",") if part.strip()]
    except ValueError:
        shapes = []
    if not shapes or any(len(sh) != 3 or min(sh) < 1 or max(sh) > 1 << 30 for sh in shapes):
        raise argparse.ArgumentTypeError(f"expected S_Q:S_KV:H[,S_Q:S_KV:H...] (e.g. 4096:65536:64), each in "
                                         f"1..2^30, got {text[:80]!r}")
    return shapes  # type: ignore[return-value]


_shape_list.bounds = (1, 1 << 30)  # type: ignore[attr-defined]
_shape_list.range_text = "each count 1..2^30"  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> int:
    import torch

    from cpkv.kernels.platform import triton_importable as triton_available
    from cpkv.errors import AttentionError

    if args.decode:
        return _run_decode(args)
    if args.topk > args.kv_rows:
        raise AttentionError(f"--topk {args.topk}: expected at most --kv-rows ({args.kv_rows}) distinct keys per query")
    small = [sh for sh in (args.peer_shapes or PEER_SHAPES) if sh[1] < args.topk]
    if args.peer and small:
        raise AttentionError(f"--peer-shapes {small[0][0]}:{small[0][1]}:{small[0][2]}: expected S_KV >= --topk "
                             f"({args.topk}) distinct keys per query")
    peer = _load_peer(args.peer) if args.peer else None
    if not (torch.cuda.is_available() and triton_available()):
        raise AttentionError("cpkv bench attention needs a CUDA device and triton")
    result = _bench(args)
    if peer is not None:
        result["peer"] = _peer_bench(args, peer)
    _report(result, args.json)
    return 0


def _run_decode(args: argparse.Namespace) -> int:
    import torch

    from cpkv.bench import attention_decode
    from cpkv.errors import AttentionError
    from cpkv.kernels.platform import triton_importable

    attention_decode.check_args(args)
    if not (torch.cuda.is_available() and triton_importable()):
        raise AttentionError("cpkv bench attention --decode needs a CUDA device and triton")
    attention_decode.report(attention_decode.run(args, args.peer), args.json)
    return 0


def _cpkv_backends(x: Any) -> Any:
    """The device's backends with cpkv's own sparse MLA kernel (FlashMLA is timed as the peer, not as cpkv)."""
    import dataclasses

    from cpkv.kernels.platform import backends_for

    return dataclasses.replace(backends_for(x), sparse_mla="cpkv")


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    gemm = _gemm_tflops()
    copy_rate = copy_gbs()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "gemm_tflops": gemm, "copy_gbs": copy_rate,
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
    res["dequant"], res["quant"] = _token_kv_cases(args.kv_quant_rows, args.rep_ms, args.sweep)
    res["costs"] = unit_costs_attention(res["cases"], args.topk)  # usable as `cpkv replay --costs`
    return res


def _gemm_tflops() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench_ms(lambda: torch.matmul(a, b), 300, warmup_ms=25)
    return 2 * 8192**3 / ms / 1e9


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

    cpkv = _cpkv_backends(inp["q"])
    ms = do_bench_ms(lambda: sparse_mla(inp["q"], inp["kv"], inp["idx"], inp["scale"], backends=cpkv), rep_ms,
                     warmup_ms=25)
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


def _rel_err_sampled(inp: dict[str, Any], out: Any, per_part: int = 4) -> float:
    """||out - ref|| / ||ref|| on ``per_part`` query rows at the start, middle and end of a full-size output (a
    persistent kernel reaches the last rows late in its tile loop), reference in float64 on the device."""
    import torch

    from cpkv.attention import sparse_mla_ref

    t = inp["q"].shape[0]
    rows = sorted({r for base in (0, t // 2, t - per_part) for r in range(max(base, 0), min(base + per_part, t))})
    sel = torch.tensor(rows, device=inp["q"].device)
    ref, _ = sparse_mla_ref(inp["q"][sel], inp["kv"], inp["idx"][sel], inp["scale"], 512, dtype=torch.float64, chunk=1)
    return float((out[sel].double() - ref).norm() / ref.norm())


def _sweep_configs() -> list[Any]:
    """Candidate kernel configs: the Triton kernel and the warp-specialised Gluon one."""
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


def _token_kv_cases(s: int, rep_ms: int, sweep: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Dequant (656 B read, 1,152 B written per row) and quant (fp32 rows in, as the model layer passes them:
    2,304 B read, 656 B written) of ``s`` GLM-5 rows, each against a ``copy_`` moving the same bytes."""
    import torch

    from cpkv.attention import dequant_token_kv, quant_token_kv
    from cpkv.attention.ref import GLM5_TOKEN, row_views
    from cpkv.kernels.token_kv import triton as token_kv

    x = torch.randn(s, 576, device="cuda")
    rows = quant_token_kv(x)
    cases = []
    for name, moved, fn, launch_fn in (
        ("dequant", s * (656 + 576 * 2), lambda: dequant_token_kv(rows),
         lambda shape: token_kv.dequant(*row_views(rows, GLM5_TOKEN), launch=shape)),
        ("quant", s * (576 * 4 + 656), lambda: quant_token_kv(x),
         lambda shape: token_kv.quant(x, *row_views(torch.empty_like(rows), GLM5_TOKEN), launch=shape)),
    ):
        copy_rate = copy_gbs(moved // 2)
        ms = do_bench_ms(fn, rep_ms, warmup_ms=25)
        case = {"rows": s, "bytes_moved": moved, "ms": ms, "gbs": moved / ms / 1e6, "copy_gbs": copy_rate,
                "ratio_to_copy": moved / ms / 1e6 / copy_rate,
                "launch": list(getattr(token_kv, f"{name.upper()}_LAUNCH"))}
        if sweep:
            case["sweep"] = [{"launch": list(shape), "ms": (t := do_bench_ms(lambda: launch_fn(shape), rep_ms, warmup_ms=25)),
                              "ratio_to_copy": moved / t / 1e6 / copy_rate} for shape in KV_LAUNCHES]
        cases.append(case)
    del x, rows
    torch.cuda.empty_cache()
    return cases[0], cases[1]


# the peer comparison (--peer) --------------------------------------------------------------------------

def _load_peer(name: str) -> Any:
    """The peer's sparse prefill function; AttentionError (a one-line usage error) when it does not import."""
    from cpkv.errors import AttentionError

    try:
        from flash_mla import flash_mla_sparse_fwd
    except Exception as exc:  # ImportError, or a build that fails to load its CUDA library
        raise AttentionError(f"--peer {name}: expected the flash_mla package (FlashMLA built from source) on "
                             f"PYTHONPATH, got {type(exc).__name__}: {str(exc)[:200]}") from None
    return flash_mla_sparse_fwd


def _event_ms(fn, reps: int) -> float:
    """Mean ms per call of ``reps`` back-to-back calls, timed with CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _peer_bench(args: argparse.Namespace, peer: Any) -> dict[str, Any]:
    """The peer comparison on every peer shape."""
    import statistics
    import sys

    cases = []
    for shape in args.peer_shapes or PEER_SHAPES:
        print(f"cpkv bench attention: peer shape s_q {shape[0]} s_kv {shape[1]} h {shape[2]}", file=sys.stderr)
        cases.append(_peer_case(shape, args.topk, peer, args.peer_rounds, args.pattern))
    ratios = [c["cpkv_over_peer"] for c in cases]
    return {"name": args.peer, "pattern": args.pattern, "cases": cases, "min_ratio": min(ratios),
            "geo_mean_ratio": statistics.geometric_mean(ratios)}


def _peer_case(shape: tuple[int, int, int], topk: int, peer: Any, rounds: int,
               pattern: str = "random") -> dict[str, Any]:
    """One shape: same q / kv / indices (``pattern``: distinct random rows per query; hot: rows of [0, 2 topk),
    L2-resident, so that the comparison is of the two kernels' compute side) for both; alternating timed rounds."""
    import statistics

    import torch

    from cpkv.attention import sparse_mla

    s_q, s_kv, h = shape
    inp = _inputs(s_q, h, topk, s_kv, pattern)
    q, kv, idx, scale = inp["q"], inp["kv"], inp["idx"], inp["scale"]
    kv3, idx3 = kv[:, None, :], idx[:, None, :]  # FlashMLA: kv [s_kv, h_kv = 1, d_qk], indices [s_q, 1, topk]
    cpkv = _cpkv_backends(q)
    ours = lambda: sparse_mla(q, kv, idx, scale, backends=cpkv)  # noqa: E731
    theirs = lambda: peer(q, kv3, idx3, scale, 512)  # noqa: E731
    calls = {"peer": theirs, "cpkv": ours}
    got = ours()
    match = {"rel_err": _rel_err_sampled(inp, got[0]), **_compare_outputs(theirs(), got)}
    del got
    torch.cuda.synchronize()
    reps = max(3, round(30 / max(_event_ms(ours, 1), 1e-3)))  # ~30 ms per timed batch of calls
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(_event_ms(fn, reps))
    med = {name: statistics.median(t) for name, t in times.items()}
    flops = _flops(inp)
    del inp, q, kv, idx, kv3, idx3
    calls.clear()
    torch.cuda.empty_cache()
    mo, mp = med["cpkv"], med["peer"]
    return {"s_q": s_q, "s_kv": s_kv, "h_q": h, "topk": topk, "cpkv_ms": mo, "cpkv_tflops": flops / mo / 1e9,
            "rounds": rounds, "calls_per_round": reps, "cpkv_ms_rounds": times["cpkv"], **match,
            "peer_ms": mp, "peer_tflops": flops / mp / 1e9, "cpkv_over_peer": mp / mo, "peer_ms_rounds": times["peer"]}


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
    for name in ("dequant", "quant"):
        d = res[name]
        print(f"token-KV {name}, {d['rows']} rows (launch {d['launch']}): {d['ms']:.3f} ms, {d['gbs']:.0f} GB/s = "
              f"{d['ratio_to_copy']:.3f} of a same-size copy_ ({d['copy_gbs']:.0f} GB/s)")
        if d.get("sweep"):
            table(["launch", "ms", "ratio to copy"], [[str(r["launch"]), r["ms"], r["ratio_to_copy"]] for r in d["sweep"]])
    if "peer" in res:
        _report_peer(res["peer"], table)


def _report_peer(p: dict[str, Any], table: Any) -> None:
    print(f"sparse MLA vs {p['name']} (same inputs, indices {p['pattern']}, alternating rounds): cpkv / {p['name']} min "
          f"{p['min_ratio']:.3f}, geometric mean {p['geo_mean_ratio']:.3f}")
    table(["s_q", "s_kv", "h_q", f"{p['name']} ms", f"{p['name']} TFLOP/s", "cpkv ms", "cpkv TFLOP/s",
           f"cpkv / {p['name']}", "out cos diff", "out max diff", "lse max diff", "cpkv rel err"],
          [[c["s_q"], c["s_kv"], c["h_q"], c["peer_ms"], c["peer_tflops"], c["cpkv_ms"], c["cpkv_tflops"],
            c["cpkv_over_peer"], c["out_cos_diff"], c["out_max_diff_rel"], c["lse_max_diff"], c["rel_err"]]
           for c in p["cases"]])
