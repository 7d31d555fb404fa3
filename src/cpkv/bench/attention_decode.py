"""``cpkv bench attention --decode``: the sparse decode MLA kernel over paged fp8 token rows at GLM-5's shapes.

Per batch B (``--batches``): B generations of one query token (``--heads``, 512 + 64 dims), each with ``--topk``
distinct rows drawn uniformly from ``--pools`` pools of ``--pool-rows`` 656-byte rows (one buffer, standing for
the CP ranks' pools of one layer), about 1/16 of them -1 (no key). Timed in device time per call, in alternating
rounds: on CUDA as GRAPH_CALLS calls in one CUDA graph, each after an L2 flush whose own time is subtracted
(``graph_ms(flush=True)``: as the decode step's graph runs a layer, no launch cost, its rows not in L2), ours and
the peer's alike; a call that cannot be captured call by call (``do_bench``, the L2 flushed); ``timing`` says
which:

    cpkv      ``cpkv.kernels.sparse_mla.decode`` (rows read in place, split-K)
    current   the paged step's path today: gather the rows (``paged_rows_ref``), dequantise (``dequant_token_kv``),
              the prefill sparse MLA (``sparse_mla``, FlashMLA excluded); also each part alone
    peer      ``--peer flashmla``: FlashMLA's ``flash_mla_with_kvcache`` with ``indices`` and
              ``is_fp8_kvcache=True`` over the same bytes (its V3.2 fp8 layout is cpkv's: 512 fp8 | 4 float32
              scales | 64 bf16 rope; it rounds a scale to bf16, exact only for the power-of-two scales its tests
              use, so its output differs from cpkv's by rounding)

Bytes read per call: B K 656 (the rows; masked keys counted too, as an upper bound) + q + out (bf16); GB/s over
the copy rate measured in the same run. cpkv's output is checked against the float64 reference
(``sparse_decode_mla_ref``) and, with a peer, against the peer's.

``--sweep``: at every B, the launch shapes of :func:`sweep_configs` side by side (the first kernel's, the default
of ``decode.DEFAULTS`` and the candidates around it), each with its speed-up over the first kernel's, so that one
run on a GPU picks the table's rows. Each shape is timed as GRAPH_CALLS calls in one CUDA graph (``graph_ms``: device
time, as the captured decode step runs it; timed call by call, session 23's sweep measured launches: the same
shape from 56 to 168 µs).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

from cpkv.bench.timing import copy_gbs, do_bench_ms, graph_ms

ROW_BYTES = 656
GRAPH_CALLS = 20  # calls per captured graph in --sweep
DROP = 1 / 16  # the share of selected keys set to -1


def check_args(args: argparse.Namespace) -> None:
    """AttentionError (a usage error) for decode options that cannot make a case."""
    from cpkv.errors import AttentionError

    if args.pool_rows % 64:
        raise AttentionError(f"--pool-rows {args.pool_rows}: expected a multiple of 64 (whole 64-row pages)")
    if args.topk > args.pools * args.pool_rows:
        raise AttentionError(f"--topk {args.topk}: expected at most --pools x --pool-rows "
                             f"({args.pools * args.pool_rows}) distinct rows per generation")


def run(args: argparse.Namespace, peer_name: str | None) -> dict[str, Any]:
    """The decode cases (inputs checked, CUDA and Triton present): the result dict ``report`` prints."""
    import torch

    peer = _load_peer(peer_name) if peer_name else None
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs(), "heads": args.heads,
                           "topk": args.topk, "pools": args.pools, "pool_rows": args.pool_rows,
                           "peer": peer_name, "cases": [], "sweep": []}
    for b in args.batches:
        inp = _inputs(b, args.heads, args.topk, args.pools, args.pool_rows)
        res["cases"].append(_case(inp, res["copy_gbs"], args.rep_ms, args.peer_rounds, peer))
        if args.sweep:
            res["sweep"] += _sweep(inp, res["copy_gbs"], args.rep_ms)
        del inp
        torch.cuda.empty_cache()
    return res


def _inputs(b: int, h: int, k: int, cp: int, pool_rows: int, device: str = "cuda") -> dict[str, Any]:
    import torch

    from cpkv.attention import pool_bases, quant_token_kv
    from cpkv.attention.ref import GLM5_TOKEN

    gen = torch.Generator(device=device).manual_seed(b)
    buf = torch.empty(cp * pool_rows, ROW_BYTES, dtype=torch.uint8, device=device)
    for r0 in range(0, buf.shape[0], 1 << 16):
        r1 = min(buf.shape[0], r0 + (1 << 16))
        buf[r0:r1] = quant_token_kv(torch.randn(r1 - r0, 576, device=device, generator=gen), GLM5_TOKEN)
    pools = list(buf.view(cp, pool_rows, ROW_BYTES).unbind(0))
    flat = torch.stack([torch.rand(cp * pool_rows, device=device, generator=gen).topk(k).indices for _ in range(b)])
    drop = torch.rand(b, k, device=device, generator=gen) < DROP
    owner = (flat // pool_rows).masked_fill(drop, 0).to(torch.int32)
    row = (flat % pool_rows).masked_fill(drop, -1).to(torch.int32)
    return {"buf": buf, "pools": pools, "bases": pool_bases(pools, device), "owner": owner, "row": row,
            "flat": flat.masked_fill(drop, -1).to(torch.int32), "fmt": GLM5_TOKEN, "scale": (192 + 64) ** -0.5,
            "q": torch.randn(b, h, 576, device=device, generator=gen).to(torch.bfloat16),
            "out": torch.empty(b, h, 512, dtype=torch.bfloat16, device=device)}


def _ours(inp: dict[str, Any], config: Any = None) -> Callable[[], Any]:
    from cpkv.kernels.sparse_mla import decode as kernel

    return lambda: kernel.sparse_decode_mla(inp["q"], inp["bases"], inp["owner"], inp["row"], inp["scale"], 512,
                                            inp["fmt"], inp["out"], config=config)


def _current(inp: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The paged step's attention today, whole and by part (each part's input made once, outside its timing)."""
    import dataclasses

    import torch

    from cpkv.attention import dequant_token_kv, sparse_mla
    from cpkv.kernels.paged_rows.ref import paged_rows_ref
    from cpkv.kernels.platform import backends_for

    backends = dataclasses.replace(backends_for(inp["q"]), sparse_mla="cpkv")
    owner, row = inp["owner"].reshape(-1).long(), inp["row"].reshape(-1).long()
    valid = inp["row"] >= 0
    ind = torch.arange(row.shape[0], dtype=torch.int32, device=row.device).view(inp["row"].shape)
    ind = torch.where(valid, ind, -1)
    gather = lambda: paged_rows_ref(inp["pools"], owner, row)  # noqa: E731
    dequant = lambda rows: dequant_token_kv(rows, inp["fmt"], backends)  # noqa: E731
    mla = lambda kv: sparse_mla(inp["q"], kv, ind, inp["scale"], 512, backends)  # noqa: E731
    rows = gather()
    kv = dequant(rows)
    return {"current": lambda: mla(dequant(gather())), "gather": gather, "dequant": lambda: dequant(rows),
            "mla": lambda: mla(kv)}


def _peer(inp: dict[str, Any], peer: Any) -> Callable[[], Any] | None:
    """FlashMLA's sparse decode over the same rows (its k cache the pools' buffer as 64-row pages), or None where it
    does not take the head count (64 or 128)."""
    import torch

    if inp["q"].shape[1] not in (64, 128):
        return None
    with_kvcache, get_mla_metadata = peer
    cache = inp["buf"].view(torch.float8_e4m3fn).view(-1, 64, 1, ROW_BYTES)
    q4, idx = inp["q"][:, None].contiguous(), inp["flat"][:, None, :].contiguous()
    meta = get_mla_metadata()[0]  # filled on the first call, reused (same shapes)
    return lambda: with_kvcache(q4, cache, None, None, 512, meta, None, inp["scale"], False, True, indices=idx)


def _case(inp: dict[str, Any], copy_rate: float, rep_ms: int, rounds: int, peer: Any) -> dict[str, Any]:
    from cpkv.kernels.sparse_mla import decode as kernel

    b, h, _ = inp["q"].shape
    k = inp["row"].shape[1]
    calls = {"cpkv": _ours(inp), **_current(inp)}
    theirs = _peer(inp, peer) if peer is not None else None
    if theirs is not None:
        calls["peer"] = theirs
    ours = calls["cpkv"]()
    case: dict[str, Any] = {"batch": b, "heads": h, "topk": k, "rel_err": _rel_err(inp, ours[0]),
                            "config": kernel.default_config(h, b).tag(), "splits": _splits(inp)}
    if theirs is not None:
        case.update(_compare(theirs(), ours))
    ms, how = _timed(calls, rep_ms, rounds, graphed=inp["q"].is_cuda)
    case["timing"] = how
    moved = b * k * ROW_BYTES + 2 * inp["q"].numel() + 2 * inp["out"].numel()
    case.update({f"{name}_ms": t for name, t in ms.items()})
    case.update(bytes=moved, gbs=moved / ms["cpkv"] / 1e6, ratio_to_copy=moved / ms["cpkv"] / 1e6 / copy_rate,
                current_over_cpkv=ms["current"] / ms["cpkv"])
    if "peer" in ms:
        case.update(peer_gbs=moved / ms["peer"] / 1e6, cpkv_over_peer=ms["peer"] / ms["cpkv"])
    return case


def _timed(calls: dict[str, Callable[[], Any]], rep_ms: int, rounds: int, graphed: bool) -> tuple[dict, dict]:
    """Median over ``rounds`` alternating rounds of each call's time (ms) -> (times, how each was timed).
    ``graphed`` (CUDA): GRAPH_CALLS calls in one CUDA graph, the L2 flushed before each (``graph_ms``): device time
    as the decode step's graph runs it, for cpkv's kernel and the peer's alike (timed call by call, a launch's host
    work counts: cpkv's Python wrapper read 0.17 ms at every batch where FlashMLA's read 0.02 ms, 2026-12-04);
    a call that cannot be captured is timed call by call (``do_bench``, the L2 flushed)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    how = {name: "graph" if graphed else "calls" for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            budget = max(10, rep_ms // rounds)
            if how[name] == "graph":
                try:
                    times[name].append(graph_ms(fn, GRAPH_CALLS, budget, flush=True))
                    continue
                except Exception:  # noqa: BLE001 -- not capturable (a host sync inside): timed call by call
                    import torch

                    torch.cuda.synchronize()
                    how[name] = "calls"
            times[name].append(do_bench_ms(fn, budget, warmup_ms=5))
    return {name: statistics.median(t) for name, t in times.items()}, how


def _splits(inp: dict[str, Any], config: Any = None) -> int:
    """The split count a launch of ``config`` (None: the default) takes on these inputs."""
    from cpkv.kernels.sparse_mla import decode as kernel

    b, h, _ = inp["q"].shape
    cfg = config or kernel.default_config(h, b)
    return kernel.split_plan(cfg, b, h, inp["row"].shape[1], 512, kernel.sm_count_of(inp["q"]))[0]


def _rel_err(inp: dict[str, Any], out: Any) -> float:
    """||out - ref|| / ||ref|| over every generation, the reference in float64 on the device."""
    import torch

    from cpkv.attention.ref import sparse_decode_mla_ref

    ref, _ = sparse_decode_mla_ref(inp["q"], inp["pools"], inp["owner"], inp["row"], inp["scale"], 512, inp["fmt"],
                                   dtype=torch.float64)
    return float((out.double() - ref).norm() / ref.norm())


def _compare(theirs: tuple, ours: tuple) -> dict[str, Any]:
    """FlashMLA's (out [B, 1, H, 512], lse [B, H, 1]) against cpkv's, as ``cpkv.bench.attention`` compares them."""
    from cpkv.bench.compare import compare_outputs

    out_p, lse_p = theirs
    return compare_outputs((out_p.reshape(ours[0].shape), None, lse_p.reshape(ours[1].shape)), ours)


def first_kernel(b: int, h: int, k: int, sms: int) -> Any:
    """The first kernel's launch (its default until the tiles of ``decode.DEFAULTS``): all heads up to 64 a
    program over 64-key tiles, 8 warps, 2 stages, the owner after the row and the base gathered by it, one combine
    program a head, and its plan's splits (about one program an SM, rounded up: B = 32 takes 5 x 32)."""
    from cpkv.kernels.grid import cdiv
    from cpkv.kernels.sparse_mla import decode as kernel

    block_h = min(64, max(16, 1 << max(0, (h - 1).bit_length())))
    tiles = cdiv(max(k, 1), 64)
    want = max(1, min(tiles, cdiv(sms, b * cdiv(h, block_h))))
    splits = cdiv(max(k, 1), cdiv(tiles, want) * 64)
    return kernel.DecodeConfig(block_h, 64, 8 if block_h == 64 else 4, 2, splits=splits, chained=True,
                               combine_d=512)


def sweep_configs(b: int, h: int, k: int, sms: int) -> list[Any]:
    """The launch shapes ``--sweep`` times at B generations of H heads: the first kernel's, the default, then one
    change from the default at a time: pipelining depth (3: rows single-buffered, 7: triple), key tile, the first
    kernel's address chain, value blocks (the rows re-read, the scores recomputed), smaller head blocks (mma.sync,
    several programs an SM), split counts, the per-value scale load, one combine program a head. Every one fits
    Hopper's shared memory (``tests/kernels/test_sparse_decode_sm90.py`` compiles them all offline)."""
    from dataclasses import replace

    from cpkv.kernels.sparse_mla import decode as kernel

    base = kernel.default_config(h, b)
    planned = kernel.split_plan(base, b, h, k, 512, sms)[0]
    variants = [
        replace(base, num_stages=3), replace(base, num_stages=7), replace(base, block_k=64, num_stages=3),
        replace(base, block_k=16), replace(base, chained=True),
        replace(base, block_v=256), replace(base, block_v=128, num_warps=4),
        replace(base, block_h=32, block_k=16), replace(base, block_h=16, block_k=16, num_warps=4, per_sm=2),
        replace(base, per_sm=2), replace(base, splits=max(1, planned // 2)), replace(base, splits=2 * planned),
        replace(base, block_k=16, scale_gather=True), replace(base, combine_d=512),
    ]
    configs = [first_kernel(b, h, k, sms), base]
    return configs + [v for v in variants if v not in configs and v.block_h <= base.block_h]


def _sweep(inp: dict[str, Any], copy_rate: float, rep_ms: int) -> list[dict[str, Any]]:
    """Every launch shape of :func:`sweep_configs` at this batch: ms, GB/s, the first kernel's ms over its."""
    from cpkv.kernels.sparse_mla import decode as kernel

    b, h, _ = inp["q"].shape
    k = inp["row"].shape[1]
    moved = b * k * ROW_BYTES + 2 * inp["q"].numel() + 2 * inp["out"].numel()
    rows: list[dict[str, Any]] = []
    for i, cfg in enumerate(sweep_configs(b, h, k, kernel.sm_count_of(inp["q"]))):
        row: dict[str, Any] = {"batch": b, "role": ("first", "default")[i] if i < 2 else "", "config": cfg.tag(),
                               "splits": _splits(inp, cfg)}
        try:
            call = _ours(inp, cfg)
            out = call()[0]
            graphed = inp["q"].is_cuda  # launch-free (off CUDA, the interpreter's tests: call by call)
            ms = graph_ms(call, GRAPH_CALLS, rep_ms) if graphed else do_bench_ms(call, rep_ms, warmup_ms=10)
            row.update(ms=ms, timing="graph" if graphed else "calls", gbs=moved / ms / 1e6, ratio_to_copy=moved / ms / 1e6 / copy_rate,
                       rel_err=_rel_err(inp, out))
            first = rows[0].get("ms") if rows else ms  # the first kernel's row leads
            if first is not None:
                row["first_over"] = first / ms
        except Exception as exc:  # a shape that does not compile or fit is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
    return rows


def _load_peer(name: str) -> tuple[Any, Any]:
    """FlashMLA's (flash_mla_with_kvcache, get_mla_metadata); AttentionError (one line) when it does not import."""
    from cpkv.errors import AttentionError

    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except Exception as exc:  # ImportError, or a build that fails to load its CUDA library
        raise AttentionError(f"--peer {name}: expected the flash_mla package (FlashMLA built from source) on "
                             f"PYTHONPATH, got {type(exc).__name__}: {str(exc)[:200]}") from None
    return flash_mla_with_kvcache, get_mla_metadata


def report(res: dict[str, Any], as_json: bool) -> None:
    from cpkv.cli.fmt import emit_json, table

    if as_json:
        emit_json(res)
        return
    print(f"{res['device']}: copy {res['copy_gbs']:.0f} GB/s; sparse decode MLA H={res['heads']} topk={res['topk']} "
          f"over {res['pools']} pools of {res['pool_rows']} 656-byte rows (device time per call, L2 flushed)")
    if res["sweep"]:
        keys = ["batch", "role", "config", "splits", "ms", "first_over", "gbs", "ratio_to_copy", "rel_err", "error"]
        table(keys, [[r.get(k, "") for k in keys] for r in res["sweep"]])
    peer = res["peer"]
    head = ["B", "splits", "cpkv ms", "GB/s", "of copy", "rel err", "current ms", "current / cpkv", "gather ms",
            "dequant ms", "mla ms"]
    if peer:
        head += [f"{peer} ms", f"cpkv / {peer}", "out cos diff", "lse max diff"]
    rows = []
    for c in res["cases"]:
        row = [c["batch"], c["splits"], c["cpkv_ms"], c["gbs"], c["ratio_to_copy"], c["rel_err"], c["current_ms"],
               c["current_over_cpkv"], c["gather_ms"], c["dequant_ms"], c["mla_ms"]]
        if peer:
            row += [c.get("peer_ms", "n/a"), c.get("cpkv_over_peer", ""), c.get("out_cos_diff", ""),
                    c.get("lse_max_diff", "")]
        rows.append(row)
    table(head, rows)
