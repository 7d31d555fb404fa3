"""``cpkv replay``: replay a trace through the real prefix cache and admission code; report TTFT."""
from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Sequence

from cpkv.cli import args as a
from cpkv.cli.args import as_flags, atomic_output, atomic_path, flags_of
from cpkv.files import check_outputs
from cpkv.cli.fmt import Progress, emit_json, finite, table
from cpkv.config import DEFAULT_PAGE_SIZE, SIZES as PRESETS
from cpkv.errors import ConfigError
from cpkv.scheduler.admission import POLICIES
from cpkv.scheduler.batch import Batch
from cpkv.scheduler.costs import CostModel
from cpkv.scheduler.replay import KV_MODES, ReplayConfig, ReplayResult, replay
from cpkv.scheduler.trace import TraceRequest, builtin_trace, ideal_hit_ratio, load_trace, write_trace

HELP = "Replay a request trace through the real prefix cache and admission code; report time to first token."
BUILTIN = {"requests": 2000, "seed": 0, "scale": 1.0}  # the built-in trace's options and their defaults
SIZES = PRESETS["model"]  # a real model's batch sizes (the cost model's is GLM-5 on H200s)
FLAGS = {**flags_of(["cp", "chunk_size", "page_size", "max_requests", "kv_tokens_per_rank", "policy"]), "kv": "--kv"}
OUTPUTS = ("save_trace", "log_batches", "plot")
REPLAY_PAGE_BYTES = 96  # host bytes of one simulated page: its id in the free heap and its reference count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="JSONL trace (docs/trace-format.md); default: the built-in trace")
    p.add_argument("--policy", choices=(*POLICIES, "both"), default="solo", help="admission policy (default solo)")
    p.add_argument("--kv", choices=(*KV_MODES, "both"), default="shared",
                   help="KV capacity: shared (each page once in the group) or replicated (on every rank)")
    p.add_argument("--cp", type=a.sim_ranks, default=SIZES.cp, help=f"context-parallel ranks (default {SIZES.cp})")
    p.add_argument("--chunk-size", type=a.tokens, default=SIZES.chunk_size,
                   help=f"new tokens per batch, and the chunk a long prompt is cut into (default {SIZES.chunk_size})")
    p.add_argument("--kv-tokens-per-rank", type=a.bounded_int(1, a.MAX_KV_TOKENS), default=None,
                   help="KV budget of one rank in tokens (default: an H200 after GLM-5 weights, per the cost model)")
    p.add_argument("--costs", metavar="COSTS.json", action="append",
                   help="cost-model fields to replace, or a `cpkv bench ... --json` report (repeatable; applied in order)")
    p.add_argument("--page-size", type=a.page_size, default=DEFAULT_PAGE_SIZE, help=f"tokens per KV page (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--max-requests", type=a.batch_requests, default=SIZES.max_requests,
                   help=f"requests per batch cap (default {SIZES.max_requests})")
    p.add_argument("--requests", type=a.trace_requests, help="built-in trace: number of requests (default 2000)")
    p.add_argument("--seed", type=a.seed, help="built-in trace: random seed (default 0)")
    p.add_argument("--scale", type=a.bounded_float(0.0, a.MAX_SCALE), help="built-in trace: length multiplier (default 1.0)")
    p.add_argument("--save-trace", metavar="FILE.jsonl", help="write the replayed trace to this file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG of the TTFT distribution per run (matplotlib)")
    p.add_argument("--log-batches", metavar="FILE.jsonl",
                   help="write one JSON line per batch: t_start, t_end, requests, policy, kv")


def run(args: argparse.Namespace) -> int:
    """Every option and output path is checked before the trace is read; output files appear whole or not at all."""
    if args.trace == "":
        raise ConfigError("TRACE '': expected a trace file name, got an empty string (leave it out to replay the "
                          "built-in trace)")
    _check_trace_options(args)
    combos = [(p, k) for p in _choices(args.policy, POLICIES) for k in _choices(args.kv, KV_MODES)]
    with as_flags(FLAGS):
        configs = [_config(args, p, k) for p, k in combos]
    outputs = {"--" + o.replace("_", "-"): getattr(args, o) for o in OUTPUTS}
    check_outputs(outputs, {"TRACE": args.trace, "--costs": args.costs})  # the output policy (cpkv.files)
    plt = _pyplot(args.plot) if args.plot else None
    costs = CostModel.from_json(*args.costs) if args.costs else CostModel()
    _check_kv_budget(args, costs)
    _check_replay_memory(args, costs, len(configs))
    trace, source = _trace(args)
    if args.save_trace:
        try:
            write_trace(trace, args.save_trace)
        except OSError as exc:
            raise ConfigError(f"--save-trace {args.save_trace!r}: cannot write it ({exc.strerror})") from None
    try:
        results = _replay_all(trace, configs, args, costs)
    except OSError as exc:
        raise ConfigError(f"--log-batches {args.log_batches!r}: cannot write it ({exc.strerror})") from None
    if args.json:
        emit_json({"trace": _trace_summary(trace, source, args), "cp": args.cp, "chunk_size": args.chunk_size,
                   "page_size": args.page_size, "max_requests": args.max_requests,
                   "runs": [r.summary() for r in results]})
    else:
        _print_report(results, trace, source, args)
    if plt is not None:
        _plot(plt, results, args.plot, source)
    return 0


def _choices(value: str, names: Sequence[str]) -> list[str]:
    return list(names) if value == "both" else [value]


def _check_trace_options(args: argparse.Namespace) -> None:
    """--requests/--seed/--scale shape the built-in trace: with a TRACE file they would be silently ignored."""
    given = [f"--{k}" for k in BUILTIN if getattr(args, k) is not None]
    if args.trace and given:
        raise ConfigError(f"{', '.join(given)}: only for the built-in trace, but a TRACE file ({args.trace!r}) was "
                          "given: drop them, or drop the file")
    for k, v in BUILTIN.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _check_replay_memory(args: argparse.Namespace, costs: CostModel, runs: int) -> None:
    """The simulated pools (a page id and a reference count per page, every rank's) must fit this machine:
    ConfigError naming --kv-tokens-per-rank (or --cp) otherwise."""
    from cpkv.cli.hostmem import host_memory, size_text

    tokens = args.kv_tokens_per_rank if args.kv_tokens_per_rank is not None else costs.kv_tokens_per_rank(args.cp)
    pages = args.cp * (tokens // args.page_size + 1)
    need = pages * REPLAY_PAGE_BYTES
    free = host_memory().available
    if free is not None and need > free // 2:
        option = (f"--kv-tokens-per-rank {args.kv_tokens_per_rank}" if args.kv_tokens_per_rank is not None
                  else f"--cp {args.cp}")
        raise ConfigError(f"{option}: the simulated pools hold {pages} pages ({args.cp} ranks x {tokens} tokens / "
                          f"--page-size {args.page_size}), about {size_text(need)} of host memory; this machine has "
                          f"{size_text(free)} available (at most half of it is used); lower {option.split()[0]}"
                          + (" or --cp" if not option.startswith("--cp") else "") + ", or raise --page-size")


def _check_kv_budget(args: argparse.Namespace, costs: CostModel) -> None:
    """Without --kv-tokens-per-rank, the cost model's memory budget must leave room for KV at this --cp."""
    if args.kv_tokens_per_rank is None:
        try:
            costs.kv_tokens_per_rank(args.cp)
        except ConfigError as exc:
            raise ConfigError(f"--cp {args.cp}: {exc}; give a budget with --kv-tokens-per-rank, or raise --cp "
                              "(or pass --costs with a smaller weight_bytes)") from None


def _trace(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    if args.trace is not None:
        return load_trace(args.trace), args.trace
    trace = builtin_trace(args.requests, seed=args.seed, scale=args.scale)
    return trace, f"built-in trace (n={args.requests}, seed={args.seed}, scale={args.scale:g})"


def _trace_summary(trace: list[TraceRequest], source: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"source": source, "file": args.trace, "requests": len(trace),
            "prompt_tokens": sum(r.prompt_len for r in trace),
            "ideal_hit_ratio": round(ideal_hit_ratio(trace, args.page_size), 4),
            "builtin": None if args.trace else {k: getattr(args, k) for k in BUILTIN}}


def _config(args: argparse.Namespace, policy: str, kv: str) -> ReplayConfig:
    """The run's ReplayConfig (which validates every value)."""
    return ReplayConfig(policy=policy, kv=kv, cp=args.cp, page_size=args.page_size, chunk_size=args.chunk_size,
                        max_requests=args.max_requests, kv_tokens_per_rank=args.kv_tokens_per_rank)


def _replay_all(trace, configs: list[ReplayConfig], args, costs: CostModel) -> list[ReplayResult]:
    bar = Progress(len(trace) * len(configs), "cpkv replay")
    results = []
    try:
        with ExitStack() as stack:
            log_file = stack.enter_context(atomic_output(args.log_batches)) if args.log_batches else None
            for cfg in configs:
                log = _batch_logger(log_file, cfg.policy, cfg.kv) if log_file else None
                results.append(replay(trace, cfg, costs, log=log, progress=bar.update))
    finally:
        bar.close()
    return results


def _batch_logger(f, policy: str, kv: str):
    def log(batch: Batch, t_start: float, t_end: float) -> None:
        f.write(json.dumps(finite({"t_start": t_start, "t_end": t_end, "requests": [e.to_dict() for e in batch.entries],
                                   "policy": policy, "kv": kv}), allow_nan=False) + "\n")
    return log


def _print_report(results: list[ReplayResult], trace, source: str, args: argparse.Namespace) -> None:
    rows = []
    for r in results:
        s = r.summary()
        t = {k: "-" if v is None else v for k, v in s["ttft_s"].items()}  # "-": no request completed
        rows.append([s["policy"], s["kv"], s["requests"], s["rejected"], round(s["cache_hit_ratio"], 4),
                     t["p50"], t["p90"], t["p99"], t["max"], s["batches"], round(s["mean_batch_requests"], 3),
                     s["mean_queue_s"]])
    table(["policy", "kv", "requests", "rejected", "hit ratio", "ttft p50 s", "p90 s", "p99 s", "max s", "batches",
           "req/batch", "queue s"], rows)
    kv_tokens = results[0].kv_tokens_per_rank if results else 0
    print(f"\n{source}: {len(trace)} requests, {sum(r.prompt_len for r in trace)} prompt tokens, "
          f"ideal hit ratio {ideal_hit_ratio(trace, args.page_size):.3f}; cp={args.cp}, chunk={args.chunk_size}, "
          f"page={args.page_size}, KV {kv_tokens} tokens per rank")
    for r in results:
        if r.rejected:
            print(f"{r.policy}/{r.kv}: rejected {dict(sorted(r.rejected.items()))}")


def _pyplot(path: str) -> Any:
    """matplotlib.pyplot (Agg), after checking that it can write ``path``'s format."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed: pip install 'cpkv[plot]' "
                          "(or pip install matplotlib)") from None
    fmt = Path(path).suffix.lstrip(".").lower()
    supported = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if fmt not in supported:
        raise ConfigError(f"--plot {path!r}: expected a file name ending in one of "
                          f"{', '.join('.' + k for k in sorted(supported))}, got {'.' + fmt if fmt else 'no suffix'}")
    return plt


def _plot(plt: Any, results: list[ReplayResult], path: str, source: str) -> None:
    """Empirical CDF of TTFT per run, log time axis, p90/p99 marked."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        t = sorted(r.ttft)
        if not t:
            continue
        s = r.summary()["ttft_s"]  # not None: some request completed
        ax.step(t, [(i + 1) / len(t) for i in range(len(t))], where="post",
                label=f"{r.policy}/{r.kv}: p90 {s['p90']:.3g} s, p99 {s['p99']:.3g} s")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    for q in (0.9, 0.99):
        ax.axhline(q, color="grey", lw=0.5, ls=":")
    ax.set_title(f"TTFT distribution — {source}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".").lower())
    plt.close(fig)
