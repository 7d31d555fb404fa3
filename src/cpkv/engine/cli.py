"""``cpkv run``: CP prefill of a trace on rank processes, verified against a single rank.

Defaults: CPU, cp 2, the tiny model, a built-in multi-turn trace (prefix hits and a chunked prompt
included), verification on. ``torchrun --nproc-per-node N -m cpkv run ...`` runs one rank per process.
"""
from __future__ import annotations

import argparse
import os
import sys

HELP = "Run CP prefill of a trace (KV shared across ranks) and verify it against a single rank."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv import envs
    from cpkv.cli.args import nonneg_int, positive_float, positive_int
    from cpkv.engine.config import MODES

    p.add_argument("--cp", type=int, default=2, help="rank processes (default 2; WORLD_SIZE under torchrun)")
    p.add_argument("--mode", choices=MODES, default=envs.get("CPKV_COMPOSE_MODE"),
                   help="compose mode (default CPKV_COMPOSE_MODE, symm); prefetch runs batches of one")
    p.add_argument("--trace", help="replay-format JSONL trace (default: a built-in multi-turn trace)")
    p.add_argument("--requests", type=positive_int, default=12, help="requests of the built-in trace (default 12)")
    p.add_argument("--model", default="tiny", help="preset name (tiny, glm5, deepseek-v32) or checkpoint dir")
    p.add_argument("--num-layers", type=positive_int, help="override the model's depth")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="rerun on one rank without CP and compare (default on; a failure exits 1)")
    p.add_argument("--policy", choices=("solo", "mix"), default="solo", help="admission policy")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pages-per-rank", type=int, default=256, help="device pool pages per rank (page 0 reserved)")
    p.add_argument("--host-pages", type=nonneg_int, default=0, help="host-tier page slots (CP-wide; each rank reserves as many): evicted pages spill there and reload on a hit")
    p.add_argument("--chunk-size", type=int, default=512, help="extend cap / chunk size in tokens")
    p.add_argument("--max-requests", type=int, default=8)
    p.add_argument("--strategy", choices=("zigzag", "contiguous", "round-robin"), default="zigzag")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the trace once untimed first (default: on with --device cuda, so that kernel JIT and "
                        "autotuning stay out of TTFT)")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds before the ranks are ended")
    p.add_argument("--precision", choices=("fp8", "exact"), default="fp8",
                   help="fp8 KV rows (default), or exact: rows, indexer keys and queries in the model dtype")
    p.add_argument("--logits-out", metavar="FILE",
                   help="write each finished request's last-token logits (float32 safetensors, keyed by request id)")
    p.add_argument("--json", action="store_true", help="print JSON")


def engine_config(args: argparse.Namespace, cp: int):
    from cpkv.engine.config import EngineConfig

    return EngineConfig(model=args.model, seed=args.seed, num_layers=args.num_layers, cp=cp, mode=args.mode,
                        device=args.device, page_size=args.page_size, strategy=args.strategy,
                        pages_per_rank=args.pages_per_rank, host_pages=args.host_pages, policy=args.policy,
                        chunk_size=args.chunk_size, max_requests=args.max_requests, precision=args.precision,
                        warmup=args.device == "cuda" if args.warmup is None else args.warmup)


def load_requests(args: argparse.Namespace):
    from cpkv.engine.traces import default_trace
    from cpkv.scheduler.trace import load_trace

    return load_trace(args.trace) if args.trace else default_trace(args.requests)


def run(args: argparse.Namespace) -> int:
    from cpkv.engine.engine import run_engine, run_under_torchrun, verify_run

    from cpkv.cli.args import check_output

    check_output(args.logits_out, "--logits-out")
    engine_config(args, args.cp)  # validates every option before the trace is read or a rank starts
    trace = load_requests(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        result = run_under_torchrun(engine_config(args, int(os.environ["WORLD_SIZE"])), trace)
        if result is None:
            return 0
    else:
        result = run_engine(engine_config(args, args.cp), trace, timeout_s=args.timeout)
    if args.logits_out:
        from cpkv.engine.engine import write_logits
        write_logits(args.logits_out, result)
    report = verify_run(result, trace) if args.verify else None
    if args.json:
        emit(result, report)
    else:
        show(result, report)
    return 1 if report is not None and not report.ok else 0


def emit(result, report) -> None:
    from cpkv.cli.fmt import emit_json

    emit_json({"requests": [r.to_json() for r in result.requests], "rejected": result.rejected,
               "summary": result.summary, "verify": report.to_json() if report else None})


def show(result, report) -> None:
    from cpkv.cli.fmt import table

    rows = [(r.id, r.prompt_len, r.cached_len, f"{r.ttft_s * 1e3:.1f} ms", r.first_token) for r in result.requests]
    rows += [(x["id"], x["prompt_len"], "-", "rejected", x["reason"]) for x in result.rejected]
    table(("id", "prompt", "cached", "ttft", "first token"), rows)
    s, cfg = result.summary, result.cfg
    print(f"\ncp {cfg.cp} ({cfg.device}, mode {s['mode']}, policy {cfg.policy}), model {cfg.model} ({cfg.precision}): "
          f"{s['batches']} batches, {len(result.requests)} requests done, {s['rejected']} rejected")
    print(f"wall {s['wall_s']:.3f} s, {s['tokens_per_s']:.0f} computed tokens/s, cache-hit ratio "
          f"{s['cache_hit_ratio']:.3f}")
    print(f"KV pages per rank {s['kv_pages_per_rank']} (a replicated layout would hold "
          f"{s['kv_pages_replicated']} on every rank); host tier: {s['pages_spilled']} spilled, "
          f"{s['pages_reloaded']} reloaded")
    att = s["attention_calls"]
    print(f"attention calls: {att['sparse']} sparse (indexer top-k), {att['dense']} dense (short rows)")
    if report is None:
        print("verification: off")
    else:
        verdict = "PASSED" if report.ok else "FAILED"
        print(f"verification against a single rank: {verdict} (first tokens "
              f"{'equal' if report.tokens_equal else 'DIFFER'}, max |logit diff| {report.max_logit_diff:.3g} "
              f"<= {report.tolerance:.3g} needed, {report.checked} requests)", file=sys.stdout)
