"""``cpkv run``: CP prefill of a trace on rank processes, verified against a single rank.

Defaults: CPU, cp 2, the tiny model, a built-in multi-turn trace (prefix hits and a chunked prompt
included), verification on. ``torchrun --nproc-per-node N -m cpkv run ...`` runs one rank per process.

Before any rank starts: every option, the memory plan (``cpkv plan``: a configuration that does not fit its
GPUs is refused, naming the option to change), the trace (token ids within the model's vocabulary) and the
requests that can never run under these options (too long for the model, more pages than every pool holds, ...).
A run in which a request was rejected neither passes nor exits 0 unless ``--allow-rejected`` is given;
the error names the option to change. A run with NaN/Inf logits is an error, verified or not (``--no-verify``):
it names the first such request and the layer where its values first went non-finite (engine.nonfinite_failure).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from cpkv.cli.fmt import Progress
from cpkv.errors import ConfigError

from cpkv.cli.args import MODES_EPILOG as EPILOG  # noqa: F401  (shown under --help)

HELP = "Run CP prefill of a trace (KV shared across ranks) and verify it against a single rank."
FLAGS = ("cp", "reference", "page_size", "strategy", "pages_per_rank", "host_pages", "chunk_size", "max_requests", "num_layers")
# what to change for each rejection reason (scheduler.admission.REASONS, and "parent")
HINTS = {
    "max_context": "the model's context is fixed: shorten those prompts or pick a --model with a longer context",
    "pool_pages": "raise --pages-per-rank (now {pages_per_rank}) or --cp (now {cp})",
    "cached_tokens": "raise --pages-per-rank (now {pages_per_rank}) or --cp (now {cp})",
    "pages": "raise --pages-per-rank (now {pages_per_rank})",
    "buffer_bytes": "lower --chunk-size (now {chunk_size})",
    "logits_budget": "raise CPKV_MQA_LOGITS_CHUNK_MAX_GB (one indexer logits row of the prompt exceeds it; "
                     "--chunk-size does not change it)",
    "chunk_size": "raise --chunk-size (now {chunk_size})",
    "parent": "their parent requests were rejected",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv import envs
    from cpkv.cli import args as a
    from cpkv.config import DEFAULT_PAGE_SIZE, SIZES as PRESETS, STRATEGIES, compose_mode

    SIZES = PRESETS["toy"]  # the tiny preset on a CPU, the default model's sizes
    from cpkv.engine.config import MODES

    p.add_argument("--cp", type=a.ranks, default=SIZES.cp,
                   help=f"rank processes (default {SIZES.cp}; WORLD_SIZE under torchrun)")
    p.add_argument("--mode", type=compose_mode, choices=MODES, default=envs.get("CPKV_COMPOSE_MODE"),
                   help="compose mode, listed below (default CPKV_COMPOSE_MODE, symm)")
    p.add_argument("--trace", help="replay-format JSONL trace (default: a built-in multi-turn trace)")
    p.add_argument("--requests", type=a.trace_requests, default=12, help="requests of the built-in trace (default 12)")
    p.add_argument("--long", type=a.bounded_int(0, 1 << 20), default=0, metavar="N",
                   help="add to the built-in trace a two-turn conversation of N and N + 512 tokens (its second turn "
                        "hits the first's pages): prompts past the model's index top-k run sparse selection (GLM-5's "
                        "top-k is 2048; default 0: none)")
    p.add_argument("--model", default="tiny",
                   help="preset:NAME (preset:tiny, preset:glm5, preset:deepseek-v32) or a checkpoint directory; a "
                        "plain preset name is accepted while no directory of that name exists (default tiny)")
    p.add_argument("--num-layers", type=a.layers, help="override the model's depth")
    p.add_argument("--experts", type=a.experts, help="routed experts per MoE layer: fewer than the model's keeps every dimension and the depth and routes over that many (one rank's share at cp N on one GPU, e.g. --model glm5 --experts 32); presets only")
    p.add_argument("--seed", type=a.seed, default=0, help="seed of a preset's random weights")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="rerun on one rank without CP and compare (default on; a failure exits 1)")
    p.add_argument("--reference", choices=("auto", "rank", "parent"), default="auto",
                   help="where --verify's reference runs: rank (cp 1 only: rank 0's own model after its run, one copy "
                        "of the weights), parent (a second model loaded by this process after the ranks end), auto "
                        "(default: rank at cp 1 on CUDA, else parent)")
    p.add_argument("--policy", choices=("solo", "mix"), default="solo", help="admission policy")
    p.add_argument("--page-size", type=a.page_size, default=DEFAULT_PAGE_SIZE,
                   help=f"tokens per KV page, a power of two (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--pages-per-rank", type=a.bounded_int(2, a.MAX_PAGES), default=SIZES.pages_per_rank,
                   help=f"device pool pages per rank (page 0 reserved; checked against the machine's memory; default "
                        f"{SIZES.pages_per_rank})")
    p.add_argument("--host-pages", type=a.bounded_int(0, a.MAX_PAGES), default=0,
                   help="host-tier page slots (CP-wide; each rank reserves as many): evicted pages spill there and "
                        "reload on a hit (checked against the machine's memory)")
    p.add_argument("--chunk-size", type=a.tokens, default=SIZES.chunk_size,
                   help=f"new tokens per batch, and the chunk a long prompt is cut into (default {SIZES.chunk_size})")
    p.add_argument("--max-requests", type=a.batch_requests, default=SIZES.max_requests,
                   help=f"requests per batch (default {SIZES.max_requests})")
    p.add_argument("--strategy", choices=STRATEGIES, default="zigzag", help="how new pages split over ranks")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the trace once untimed first (default: on with --device cuda, so that kernel JIT and "
                        "autotuning stay out of TTFT)")
    p.add_argument("--timeout", type=a.timeout_s, default=600.0, help="seconds before the ranks are ended")
    p.add_argument("--precision", choices=("fp8", "exact"), default="fp8",
                   help="fp8 KV rows (default), or exact: rows, indexer keys and queries in the model dtype")
    p.add_argument("--weights", choices=("auto", "fp8", "bf16"), default="auto",
                   help="linear weights: fp8 (kept / quantised to 128x128 block-scaled fp8, block-scaled GEMMs), bf16 "
                        "(widened to the compute dtype), auto (default: fp8 for an fp8 checkpoint on CUDA at fp8 "
                        "precision, else bf16)")
    p.add_argument("--graph-tokens", type=a.bounded_int(0, 1 << 16), default=None, metavar="N",
                   help="a rank's batches of up to N tokens run each layer's token-only pieces as CUDA graphs, "
                        "captured for every token bucket at start (default: 1024 with --device cuda at fp8 "
                        "precision, else 0: off; memory: cpkv plan --graph-tokens)")
    p.add_argument("--logits-out", metavar="FILE",
                   help="write each finished request's last-token logits (float32 safetensors, keyed by request id; "
                        "docs/reliability.md: the output policy)")
    p.add_argument("--allow-rejected", action="store_true",
                   help="accept a run in which some requests were rejected (default: such a run fails, exit 2)")
    p.add_argument("--json", action="store_true", help="print JSON")


def engine_config(args: argparse.Namespace, cp: int):
    from cpkv.engine.config import EngineConfig, default_graph_tokens

    return EngineConfig(model=args.model, seed=args.seed, num_layers=args.num_layers, experts=args.experts, cp=cp, mode=args.mode,
                        device=args.device, page_size=args.page_size, strategy=args.strategy,
                        pages_per_rank=args.pages_per_rank, host_pages=args.host_pages, policy=args.policy,
                        chunk_size=args.chunk_size, max_requests=args.max_requests, precision=args.precision,
                        weights=args.weights, record=bool(getattr(args, "verify", False)),
                        reference=reference_of(args, cp),
                        graph_tokens=default_graph_tokens(args.device, getattr(args, "graph_tokens", None),
                                                          args.precision),
                        warmup=args.device == "cuda" if args.warmup is None else args.warmup)


def reference_of(args: argparse.Namespace, cp: int) -> str:
    """Where verification's reference runs: ``--reference``, auto resolved (rank 0's own model at cp 1 on CUDA,
    where a second copy of the weights would cost a second load and a second CUDA context; else the parent)."""
    asked = getattr(args, "reference", "auto")
    if not getattr(args, "verify", False):
        return "parent"  # nothing to verify: the ranks do nothing extra
    if asked == "auto":
        return "rank" if cp == 1 and args.device == "cuda" else "parent"
    return asked


def load_requests(args: argparse.Namespace, vocab_size: int):
    """The trace (every listed token id checked against the model's vocabulary)."""
    from cpkv.cli.traces import default_trace
    from cpkv.scheduler.trace import check_vocab, load_trace

    if args.trace is None:
        return default_trace(args.requests, long=args.long)
    if args.long:
        raise ConfigError("--long adds to the built-in trace: leave it out with --trace")
    trace = load_trace(args.trace)
    check_vocab(trace, vocab_size, f"--trace {args.trace}", args.model)
    return trace


def never_runs(trace, cfg, model_cfg) -> dict:
    """id -> why, for the requests that can never run under ``cfg`` (the ranks' own admission rules), and
    their descendants."""
    from cpkv.scheduler.admission import Admission

    adm = Admission.build(cfg.caps(), model_cfg, cfg.cp_config, policy=cfg.policy, full_hit=cfg.full_hit)
    pool_pages = cfg.cp * (cfg.pages_per_rank - 1)
    never: dict = {}
    for r in trace:
        if r.parent is not None and r.parent in never:
            never[r.id] = f"parent: its parent {r.parent!r} can never run"
            continue
        why = adm.never_reason(r.prompt_len, pool_pages)
        if why is not None:
            never[r.id] = f"{why.reason}: {why.detail}"
    return never


def rejection_error(rejected: list, total: int, cfg, before: bool) -> str:
    """The one-line error of a run with rejected requests: how many, the first and why, what to change."""
    first = rejected[0]
    reasons = list(dict.fromkeys(x["reason"].split(":", 1)[0] for x in rejected))
    hints = "; ".join(HINTS.get(r, "see the reasons above").format(**vars(cfg)) for r in reasons)
    when = "can never run under these options" if before else "were rejected"
    return (f"{len(rejected)} of {total} requests {when} (request {first['id']!r}: {first['reason']}): {hints}; "
            "or pass --allow-rejected to accept a partial run")


def check_inputs_and_outputs(args: argparse.Namespace) -> None:
    """--trace '' is an error (leave it out for the built-in trace); --logits-out follows the output policy
    (cpkv.files) and names no input: the trace, nor any file of a checkpoint --model."""
    from cpkv.files import check_outputs

    if args.trace == "":
        raise ConfigError("--trace '': expected a trace file name, got an empty string (leave --trace out to run "
                          "the built-in trace)")
    check_outputs({"--logits-out": args.logits_out}, {"--trace": args.trace, "--model": checkpoint_inputs(args.model)})


def checkpoint_inputs(model: str) -> list[str]:
    """Every file a checkpoint --model is read from (config.json, the index, every shard); [] for a preset."""
    from cpkv.config import model_source

    try:
        kind, where = model_source(model)
    except ConfigError:
        return []
    if kind != "dir":
        return []
    from pathlib import Path

    from cpkv.errors import CheckpointError
    from cpkv.model.checkpoint import INDEX_FILE, checkpoint_files

    folder = Path(where)
    try:
        shards = [str(f) for f in checkpoint_files(folder)]
    except (CheckpointError, OSError):
        shards = []
    return [str(folder / "config.json"), str(folder / INDEX_FILE), *shards, *map(str, folder.glob("*.safetensors"))]


def run(args: argparse.Namespace) -> int:
    from cpkv.cli.args import as_flags, flags_of
    from cpkv.cli.hostmem import check_shm_fits
    from cpkv.cli.plan_cmd import check_run, plan_vs_peak
    from cpkv.engine.engine import nonfinite_failure, run_engine, run_under_torchrun, verify_run
    from cpkv.files import string_keys

    check_inputs_and_outputs(args)
    t0 = time.monotonic()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    with as_flags(flags_of(FLAGS)):  # every option checked before the trace is read or a rank starts
        cfg = engine_config(args, int(os.environ["WORLD_SIZE"]) if torchrun else args.cp)
    model_cfg = cfg.model_config()  # the config the ranks run (precision applied)
    check_run(cfg, model_cfg, torchrun, args.verify and cfg.reference == "parent")  # does not fit its GPUs (CPU: the host): one line, the option
    if not torchrun:
        check_shm_fits(cfg, model_cfg)  # CPU: the ranks' pools in /dev/shm
    trace = load_requests(args, model_cfg.vocab_size)
    if args.logits_out:
        string_keys([r.id for r in trace], f"--logits-out {args.logits_out!r}")
    never = never_runs(trace, cfg, model_cfg)
    gone = [{"id": r.id, "prompt_len": r.prompt_len, "reason": never[r.id]} for r in trace if r.id in never]
    if gone and not args.allow_rejected:
        raise ConfigError(rejection_error(gone, len(trace), cfg, before=True))
    runnable = [r for r in trace if r.id not in never]
    if not runnable:
        raise ConfigError(f"nothing to run: {rejection_error(gone, len(trace), cfg, before=True)}")
    bar = Progress(len(runnable), "cpkv run")
    bar.set(0, f"starting {cfg.cp} rank processes")
    try:
        if torchrun:
            result = run_under_torchrun(cfg, runnable)
            if result is None:
                return 0
        else:
            result = run_engine(cfg, runnable, timeout_s=args.timeout,
                                on_progress=lambda done, batches: bar.set(done, f"batch {batches}"))
        t_ranks = time.monotonic()
        bar.set(bar.done, "verifying against one rank" if args.verify else "done")
        def checked(n: int) -> None:
            bar.set(bar.done, f"verified {n} of {len(result.requests)} on one rank")

        report = result.verify if result.verify is not None else \
            verify_run(result, runnable, on_request=checked) if args.verify else None
        nonfinite = nonfinite_failure(result, runnable, report)  # NaN/Inf logits fail a run, verified or not
    finally:
        bar.close()
    if args.logits_out:
        from cpkv.engine.engine import write_logits
        write_logits(args.logits_out, result)
    order = {(type(r.id).__name__, r.id): i for i, r in enumerate(trace)}  # 1 and "1" are different ids
    result.rejected = sorted(result.rejected + gone, key=lambda x: order[(type(x["id"]).__name__, x["id"])])
    times = {"command_s": round(time.monotonic() - t0, 3), "ranks_s": round(t_ranks - t0, 3),
             "verify_s": round(time.monotonic() - t_ranks, 3), "load_s_per_rank": result.stats.get("load_s_per_rank")}
    if result.verify is not None:  # verified on rank 0 (inside ranks_s): its own seconds
        times["verify_s"] = result.stats.get("verify_s", times["verify_s"])
    result.stats["plan_vs_peak"] = plan_vs_peak(cfg, model_cfg, result.stats.get("gpu_memory_per_rank"))
    ok = (report is None or report.ok) and (not result.rejected or args.allow_rejected) and nonfinite is None
    if args.json:
        emit(result, report, args, trace, times, ok)
    else:
        show(result, report, args, times)
    if nonfinite is not None:
        raise nonfinite
    if result.rejected and not args.allow_rejected:
        raise ConfigError(rejection_error(result.rejected, len(trace), cfg, before=False))
    return 1 if report is not None and not report.ok else 0


def emit(result, report, args, trace, times, ok) -> None:
    from cpkv.cli.fmt import emit_json

    cfg = result.cfg
    emit_json({"ok": ok, "cp": cfg.cp, "experts_per_rank": result.stats.get("experts_per_rank"),
               "gpu_memory_per_rank": result.stats.get("gpu_memory_per_rank") if cfg.device == "cuda" else None,
               "plan_vs_peak": result.stats.get("plan_vs_peak"), "reference": cfg.reference if report else None,
               "graph_tokens": cfg.graph_tokens, "graphs_per_rank": result.stats.get("graphs_per_rank"),
               "device": cfg.device, "model": cfg.model, "precision": cfg.precision,
               "routed_experts": cfg.model_config().n_routed_experts, "experts_option": cfg.experts,
               "weights_dtype": result.summary["weights_dtype"], "mode": result.summary["mode"],
               "policy": cfg.policy, "page_size": cfg.page_size, "chunk_size": cfg.chunk_size,
               "pages_per_rank": cfg.pages_per_rank, "allow_rejected": args.allow_rejected,
               "trace": {"file": args.trace, "requests": len(trace)},
               "requests": [r.to_json() for r in result.requests], "rejected": result.rejected,
               "summary": {**result.summary, **times}, "verify": report.to_json() if report else None})


def show(result, report, args, times) -> None:
    from cpkv.cli.fmt import table

    rows = [(r.id, r.prompt_len, r.cached_len, f"{r.ttft_s * 1e3:.1f} ms", r.first_token) for r in result.requests]
    rows += [(x["id"], x["prompt_len"], "-", "rejected", _clip(x["reason"])) for x in result.rejected]
    table(("id", "prompt", "cached", "ttft", "first token"), rows)
    s, cfg = result.summary, result.cfg
    print(f"\ncp {cfg.cp} ({cfg.device}, mode {s['mode']}, policy {cfg.policy}), model {cfg.model} ({cfg.precision}, "
          f"{s['weights_dtype']} weights): {s['batches']} batches, {len(result.requests)} requests done, "
          f"{len(result.rejected)} rejected")
    print(f"wall {s['wall_s']:.3f} s in rank 0's batch loop, {s['tokens_per_s']:.0f} computed tokens/s, cache-hit "
          f"ratio {s['cache_hit_ratio']:.3f}; the command took {times['command_s']:.1f} s ({times['ranks_s']:.1f} s "
          f"with rank processes: start-up, model load, warm-up and batches; {times['verify_s']:.1f} s verification)")
    loads = [x for x in times.get("load_s_per_rank") or [] if x is not None]
    if loads:
        print(f"model load {', '.join(f'{x:.2f}' for x in loads)} s per rank")
    for rank, pv in enumerate(result.stats.get("plan_vs_peak") or []):
        if pv:
            print(f"rank {rank} GPU memory: plan {pv['plan_total_bytes'] / 1e9:.2f} GB, peak allocated "
                  f"{pv['peak_allocated_bytes'] / 1e9:.2f} GB ({pv['allocated_ratio']:.2f} of the plan), reserved "
                  f"{pv['peak_reserved_bytes'] / 1e9:.2f} GB ({pv['reserved_ratio']:.2f}): the plan "
                  f"{'bounds' if pv['bounds'] else 'does NOT bound'} it")
    print(f"KV pages per rank {s['kv_pages_per_rank']} (a replicated layout would hold "
          f"{s['kv_pages_replicated']} on every rank); host tier: {s['pages_spilled']} spilled, "
          f"{s['pages_reloaded']} reloaded")
    att = s["attention_calls"]
    print(f"attention calls: {att['sparse']} sparse (indexer top-k), {att['dense']} dense (short rows)")
    experts = result.stats.get("experts_per_rank") or []
    if any(experts):
        print(f"routed experts per rank {experts}" + (" (expert parallelism)" if cfg.cp > 1 else "")
              + (f"; routing over {cfg.experts} experts per MoE layer (--experts)" if cfg.experts else ""))
    if report is None:
        print("verification: off")
        return
    if report.nonfinite:
        print(f"verification against a single rank: FAILED ({len(report.nonfinite)} of {report.checked} requests "
              f"with non-finite logits: see the error below; max |logit diff| of the finite ones "
              f"{report.max_logit_diff:.3g})")
        return
    verdict = "PASSED" if report.ok else "FAILED"
    if report.ok and result.rejected:
        verdict = "PASSED (rejected requests allowed by --allow-rejected)" if args.allow_rejected else \
            "INCOMPLETE (requests were rejected: see the error below)"
    where = "rank 0's own model" if result.cfg.reference == "rank" else "a second model in this process"
    print(f"verification against a single rank: {verdict} (first tokens "
          f"{'equal' if report.tokens_equal else 'DIFFER'}, max |logit diff| {report.max_logit_diff:.3g} "
          f"<= {report.tolerance:.3g} needed, {report.checked} requests checked, {len(result.rejected)} rejected; the "
          f"reference on {where})",
          file=sys.stdout)
    print(decisions_line(report))
    for t in report.ties:
        print(f"  request {t['id']!r}: first token {t['run']} where the reference's is {t['reference']}, a tie "
              f"(its logit {t['gap']:.3g} below the reference's largest, within the tolerance)")
    for f in report.floors:
        print(f"  request {f['id']!r}: max |logit diff| {f['diff']:.3g} over the tolerance {f['tolerance']:.3g}, checked "
              f"against it plus the numerics floor {f['floor']:.3g} (the reference's own spread at other row counts)")
    for f in report.failures:
        print(f"  request {f['id']!r} FAILED: {f.get('why')}")


def decisions_line(report) -> str:
    """One line: the run's discrete decisions that differed from the reference's, and their largest margins."""
    if not report.decisions:
        return "decisions: not recorded (the reference took its own)"
    parts = []
    for kind, name in (("route", "expert choices"), ("index", "indexer selections")):
        c = report.decisions[kind]
        noise = f", score noise {c.noise:.2g}" if kind == "route" else ""
        parts.append(f"{c.differed} of {c.compared} {name} differ (largest margin {c.max_margin:.2g}{noise}, "
                     f"{c.unexplained} beyond rounding)")
    return "decisions, the reference under the run's own: " + "; ".join(parts)


def _clip(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
