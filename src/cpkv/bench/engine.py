"""``cpkv bench engine``: prefill throughput of long prompts through the whole CP engine, and where it goes.

Real GLM-5 shapes (64 heads, 576-dim absorbed scores, indexer 32 x 128, top-k 2048) and its layer pattern:
the first ``--layers`` of its 78 layers, full and shared indexer layers, dense then MoE layers. Cases, in one
trace: ``cold`` (a fresh prompt, default 32K tokens), ``cached`` (the same length with a 90 % cached prefix:
a parent request caches the prefix first) and ``long`` (a fresh 128K prompt, chunked at ``--chunk`` tokens
as ``cpkv run`` chunks it; its batches add up). In one set of rank processes the trace runs once untimed
(JIT, autotuning), ``--runs`` times timed (per batch, device synchronised at both ends) and once under
torch's profiler (CUDA kernel activity, one profiler over the run, so that its batches chain as the timed runs'
do), whose kernels give each case's breakdown by part (``cpkv.bench.breakdown``) against the profiled run's own
wall time, the median timed one beside it. Ceiling, measured in the same run: the bf16
GEMM rate of this GPU; the ratio is the model FLOPs of a case / its time against it. TTFT of 32K / 64K /
128K prompts through every layer of the model (64K is the long prompt's first two chunks): when the measured
layers hold both dense and MoE layers, the cold and long prompts also run through the dense layers alone,
and the model's dense and MoE layers are each weighted by their own measured time (per dense layer: the
dense-only time / its layers, which carries the batch's fixed cost; per MoE layer: the difference / the MoE
layers measured); else the measured time is scaled by the layer count. ``--weights fp8,bf16`` runs the whole
measurement with each kind of linear weights in the same rank processes (fp8: block-scaled GEMMs, the
presets' weights quantised at load) and reports each case's speed-up of fp8 over bf16. ``--host-load [N]`` then repeats the timed runs in fresh rank processes with N busy-loop
processes holding the host's cores (``cpkv.bench.host_load``) and reports each case's slowdown: a forward
pass bound by the host shows it at once.
"""
from __future__ import annotations

import argparse
import os
import statistics

HELP = "Prefill throughput of long prompts through the CP engine, with a per-part breakdown of each batch."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli import args as a
    from cpkv.config import DEFAULT_PAGE_SIZE
    from cpkv.config import compose_mode
    from cpkv.engine.config import MODES

    p.add_argument("--model", default="glm5", help="preset or checkpoint dir (default glm5)")
    p.add_argument("--layers", type=a.layers, default=4, help="decoder layers (default 4)")
    p.add_argument("--experts", type=a.experts, help="routed experts per MoE layer: fewer than the model's keeps every dimension and the depth and routes over that many (one rank's share at cp N on one GPU, e.g. --model glm5 --experts 32); presets only")
    p.add_argument("--prompt", type=a.tokens, default=32768, help="prompt tokens of cold/cached (default 32768)")
    p.add_argument("--long", type=a.bounded_int(0, a.MAX_TOKENS), default=131072, help="tokens of the long prompt (default 131072; 0: none)")
    p.add_argument("--chunk-size", type=a.tokens, default=32768, help="chunk size (default 32768)")
    p.add_argument("--cached", type=a.share, default=0.9, help="cached share of the warm case (default 0.9)")
    p.add_argument("--turn", type=a.bounded_int(0, a.MAX_TOKENS), default=448,
                   help="new tokens of the turn case, a follow-up turn on the cold case's whole prompt (default 448: "
                        "a rank's share of a 3.6K-token turn at cp 8, a host-bound size; 0: none)")
    p.add_argument("--runs", type=a.bounded_int(1, 10_000), default=3, help="timed runs (default 3)")
    p.add_argument("--cp", type=a.ranks, default=1, help="rank processes (default 1: the whole GPU)")
    p.add_argument("--mode", type=compose_mode, default="symm", choices=MODES, help="compose mode (default symm)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--page-size", type=a.page_size, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--no-profile", action="store_true", help="skip the profiled run (no breakdown)")
    p.add_argument("--no-chain", action="store_true",
                   help="wait for each batch to end before launching the next (batches planned ahead are otherwise "
                        "chained on the one before: engine.executor); to measure what chaining gives")
    p.add_argument("--host-profile", action="store_true",
                   help="one more run with each batch's host side under cProfile: each case's top host functions")
    p.add_argument("--marks", action="store_true",
                   help="one more run recording each batch's timeline marks: per milestone of the forward, when the "
                        "host had launched it and when the GPU ran it (ms from the batch start; cpkv.timeline)")
    p.add_argument("--mark-clocks", action="store_true",
                   help="--marks with the SM clock at each mark (a ~30 us spin probe each; implies --marks)")
    p.add_argument("--trace-dir", metavar="DIR",
                   help="one more profiled run, with Python stacks, writing each batch's timeline (host ops and "
                        "kernels) to DIR as gzipped Chrome traces (its own timings, inflated by the stacks, are unused)")
    p.add_argument("--trace-plain", action="store_true",
                   help="--trace-dir without the Python stacks (host ops by name, at the profiler's own overhead)")
    p.add_argument("--weights", default="auto", metavar="W[,W]",
                   help="linear weights, comma-separated to compare in one run: fp8, bf16, auto (default auto)")
    p.add_argument("--host-load", type=a.bounded_int(1, 4096), nargs="?", const=-1, default=0, metavar="N",
                   help="then run the timed runs again with N busy-loop processes on the host (no N: one per "
                        "core) and report each case's slowdown under that load")
    p.add_argument("--graph-tokens", type=a.bounded_int(0, 1 << 16), default=None, metavar="N",
                   help="a rank's batches of up to N tokens run each layer's token-only pieces as CUDA graphs "
                        "(cpkv.engine.graphs; default: as cpkv run, 1024 on CUDA; 0: off)")
    p.add_argument("--extrapolate-from", type=a.layers, default=None, metavar="K",
                   help="in the same rank processes, also measure the first K layers and extrapolate them to --layers "
                        "as a K-layer run does: each TTFT measured at depth beside that extrapolation, the difference "
                        "between them (e.g. --layers 78 --extrapolate-from 4)")
    p.add_argument("--decode", action="store_true",
                   help="then the paged decode step's cases (cpkv bench decode) per weights mode, in fresh rank "
                        "processes: each batch of --decode-batches generations at each --decode-keys context, "
                        "against its floor")
    p.add_argument("--decode-keys", default="1024,32768,131072", metavar="L[,L]",
                   help="--decode's context lengths (default 1024,32768,131072)")
    p.add_argument("--decode-batches", default="1,8,32", metavar="B[,B]",
                   help="--decode's generations per step (default 1,8,32)")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from cpkv.bench import timing
    from cpkv.cli.args import require_cuda
    from cpkv.engine.engine import run_jobs

    cfg, cfg_m, cfg_full, trace = _setup(args)
    modes = weights_modes(args.weights)
    check_diagnostics(args)
    check_extrapolation(args)
    if getattr(args, "decode", False):
        decode_lists(args)  # a bad list is refused before anything runs
    require_cuda(args.device, "cpkv bench engine")
    ceiling = gemm_tflops(args.device)
    copy = round(timing.copy_gbs(device=args.device), 1)  # the ceiling of this run's byte rates
    sustained = sustained_gemm() if args.device == "cuda" else None
    release_parent_cache(args.device)
    dense = dense_split(cfg_m)
    slices, jobs, skipped = [], [], {}
    for mode in modes:  # every mode's jobs in one set of rank processes, one model in memory at a time
        mcfg, mtrace, skipped[mode] = fit_cases(_replace(cfg, weights=mode), cfg_m, trace)
        sl = {}
        for key, js in _mode_jobs(args, mcfg, mtrace, dense).items():
            sl[key] = slice(len(jobs), len(jobs) + len(js))
            jobs += js
        if args.extrapolate_from:  # the first K layers of the same config, timed only, after the depth's jobs
            k = args.extrapolate_from
            few = _replace(mcfg, num_layers=k)
            for key, js in _mode_jobs(_few_args(args, k), few, mtrace, dense_split(_layers_cfg(args, k))).items():
                if key in ("timed", "dense"):
                    sl["few_" + key] = slice(len(jobs), len(jobs) + len(js))
                    jobs += js
        slices.append(sl)
    results = run_jobs(jobs, timeout_s=getattr(args, "timeout", None) or 590)
    reports = []
    for mode, sl in zip(modes, slices):
        got = {k: results[s] for k, s in sl.items()}
        rep = _report(args, cfg_m, cfg_full, ceiling, got["timed"], (got.get("prof") or [None])[0],
                      got.get("dense"), dense, (got.get("hprof") or [None])[0], (got.get("marks") or [None])[0])
        rep["skipped"] = skipped[mode]
        if args.extrapolate_from:
            k = args.extrapolate_from
            few = _report(_few_args(args, k), _layers_cfg(args, k), cfg_m, ceiling, got["few_timed"], None,
                          got.get("few_dense"), dense_split(_layers_cfg(args, k)))
            at_depth = ttft({c["case"]: c for c in rep["cases"]}, args.layers, args.layers)  # measured, unscaled
            rep["extrapolation"] = depth_vs_extrapolation(at_depth, few["ttft_s"], k)
        reports.append(rep)
    for rep in reports:
        add_sustained(rep, sustained)
        add_floor(rep, cfg_m, copy)
    report = reports[0]
    if len(reports) > 1:
        report["other_weights"] = reports[1:]
        report["speedup"] = speedups(reports)
    if args.host_load:
        report["host_load"] = _loaded(args, _replace(cfg, weights=modes[0]), cfg_m, trace, ceiling, report)
    if getattr(args, "decode", False):
        from cpkv.bench.decode import decode_cases

        report["decode"] = decode_cases(args.model, args.layers, args.experts, args.cp, args.device, args.page_size,
                                        *decode_lists(args), 5, modes, getattr(args, "graph_tokens", None))[0]
    _print(report, args.json)
    return 0


def decode_lists(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """``--decode-keys`` and ``--decode-batches`` (ConfigError naming the flag on a bad list)."""
    from cpkv.bench.decode import _ints

    return _ints(args.decode_keys, "--decode-keys"), _ints(args.decode_batches, "--decode-batches")


def check_diagnostics(args: argparse.Namespace) -> None:
    """``--trace-dir``'s folder made now, before any rank starts (ConfigError naming the flag when it cannot be);
    ``--trace-plain`` without it is an error too, and so are ``--marks`` / ``--mark-clocks`` off CUDA."""
    from cpkv.errors import ConfigError

    marks = [f for f, on in (("--marks", getattr(args, "marks", False)),
                             ("--mark-clocks", getattr(args, "mark_clocks", False))) if on]
    if marks and args.device != "cuda":
        raise ConfigError(f"{marks[0]}: expected --device cuda (the marks are CUDA events), got --device {args.device}")
    where = getattr(args, "trace_dir", None)
    if getattr(args, "trace_plain", False) and not where:
        raise ConfigError("--trace-plain: expected --trace-dir too (it says how the traces there are recorded)")
    if where:
        try:
            os.makedirs(where, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--trace-dir: expected a folder that can be made, got {where!r} ({exc.strerror})") from None


def check_extrapolation(args: argparse.Namespace) -> None:
    """``--extrapolate-from K``: fewer layers than ``--layers`` (ConfigError naming both flags otherwise)."""
    from cpkv.errors import ConfigError

    k = getattr(args, "extrapolate_from", None)
    if k is not None and k >= args.layers:
        raise ConfigError(f"--extrapolate-from: expected fewer layers than --layers {args.layers}, got {k}")


def _few_args(args: argparse.Namespace, k: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "layers": k, "extrapolate_from": None})


def _layers_cfg(args: argparse.Namespace, k: int):
    from cpkv.model.config import load_model_config

    return load_model_config(args.model, k, args.experts)


def depth_vs_extrapolation(measured: dict, few: dict, k: int) -> dict:
    """Each prompt length's TTFT measured at depth beside the K-layer run's extrapolation to that depth:
    {"from_layers": K, "weighting": how, "32768": {"measured_s", "extrapolated_s", "difference": measured /
    extrapolated - 1}, ...}."""
    out: dict = {"from_layers": k, "weighting": few.get("weighting")}
    for key, t in measured.items():
        if key.isdigit() and key in few:
            e = few[key]
            out[key] = {"measured_s": t, "extrapolated_s": e, "difference": round(t / e - 1, 4) if e else None}
    return out


def fit_cases(cfg, cfg_m, trace) -> tuple:
    """(cfg, trace, skipped): the cases whose pool and buffers fit each rank's memory (``cpkv plan``'s plan at
    ``cfg``'s pool), dropping the long prompt, then the cached turn, while they do not; each skipped case with its
    reason. On a machine that does not say its memory, everything is kept."""
    from cpkv.cli.plan_cmd import rank_budget, run_setup
    from cpkv.memplan import GB, plan_memory

    got = rank_budget(cfg)
    skipped: list[dict] = []
    if got is None:
        return cfg, trace, skipped
    budget = got[0] // got[1]
    model = cfg.model_config()
    for drop in ("long", "turn"):
        plan = plan_memory(run_setup(cfg, model, budget))
        if plan.fits or not any(r.id == drop for r in trace):
            continue
        skipped.append({"case": drop, "reason": f"the plan with it needs {plan.total / GB:.1f} GB per rank, "
                                                  f"{budget / GB:.1f} GB there"})
        gone = next(r for r in trace if r.id == drop)
        trace = [r for r in trace if r.id != drop]
        cfg = _replace(cfg, pages_per_rank=max(cfg.pages_per_rank - -(-gone.prompt_len // cfg.page_size), 32))
    plan = plan_memory(run_setup(cfg, model, budget))
    if not plan.fits:
        from cpkv.errors import ConfigError
        raise ConfigError(f"even the cold and cached cases need {plan.total / GB:.1f} GB per rank, {budget / GB:.1f} "
                          "GB there: lower --prompt, --layers or --experts")
    return cfg, trace, skipped


def release_parent_cache(device: str) -> None:
    """The ceilings' tensors (this process's cached GPU memory) back before the ranks load their models."""
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def weights_modes(spec: str) -> list[str]:
    """``--weights`` -> the modes to run, in order (ConfigError naming the flag on a bad value)."""
    from cpkv.bench.decode import weights_list

    return weights_list(spec)


def dense_split(cfg_m) -> int | None:
    """The number of leading dense layers when the measured layers hold dense and MoE layers, else None."""
    kinds = cfg_m.mlp_layer_types
    d = kinds.index("sparse") if "sparse" in kinds else len(kinds)
    return d if 0 < d < len(kinds) and "dense" not in kinds[d:] else None


def _mode_jobs(args, cfg, trace, dense: int | None) -> dict[str, list]:
    """One weights mode's jobs: timed runs, the profiled run, timed runs through the dense layers alone; each
    measured run's MeasureConfig beside its EngineConfig."""
    from cpkv.engine.instruments import MeasureConfig

    jobs = {"timed": _timed_jobs(cfg, trace, args.runs)}
    if not args.no_profile:
        jobs["prof"] = [(cfg, trace, MeasureConfig(profile=True))]
    if getattr(args, "host_profile", False):
        jobs["hprof"] = [(cfg, trace, MeasureConfig(host_profile=True))]
    if getattr(args, "marks", False) or getattr(args, "mark_clocks", False):
        jobs["marks"] = [(cfg, trace, MeasureConfig(marks=True, mark_clocks=bool(getattr(args, "mark_clocks", False))))]
    if getattr(args, "trace_dir", None):
        where = os.path.join(os.path.abspath(args.trace_dir), cfg.weights)
        stacks = not getattr(args, "trace_plain", False)
        jobs["trace"] = [(cfg, trace, MeasureConfig(profile=True, trace_dir=where, trace_stacks=stacks))]
    if dense:
        fresh = [r for r in trace if r.id in ("cold", "long")]
        # the dense layers alone hold no MoE layer: routed over the model's own count (no expert weights drawn)
        jobs["dense"] = _timed_jobs(_replace(cfg, num_layers=dense, experts=None), fresh, args.runs)
    return jobs


def speedups(reports: list[dict]) -> dict:
    """Each case's batch time and TTFT under the other weights / under the first (> 1: the first is faster)."""
    first, out = reports[0], {}
    for other in reports[1:]:
        key = f"{first['weights_dtype']}_over_{other['weights_dtype']}"
        a = {r["case"]: r["batch_s"] for r in first["cases"]}
        b = {r["case"]: r["batch_s"] for r in other["cases"]}
        row = {case: round(b[case] / a[case], 4) for case in a if case in b}
        row.update({f"ttft_{k}": round(other["ttft_s"][k] / first["ttft_s"][k], 4)
                    for k in first["ttft_s"] if k.isdigit() and k in other["ttft_s"]})
        out[key] = row
    return out


def _loaded(args, cfg, cfg_m, trace, ceiling: float, report: dict) -> dict:
    """The timed runs again (fresh rank processes, one untimed pass first) with busy-loop processes holding
    the host's cores: each case's median batch time under load against the quiet runs of this call."""
    from cpkv.bench.host_load import default_procs, host_load
    from cpkv.engine.engine import run_jobs

    procs = default_procs() if args.host_load < 0 else args.host_load  # -1: the flag without a count
    with host_load(procs):
        loaded = run_jobs(_timed_jobs(cfg, trace, args.runs), timeout_s=590)
    quiet = {r["case"]: r for r in report["cases"]}
    cases = []
    for name, rid in CASES:
        row = case_row(name, loaded, rid, cfg_m, ceiling)
        if row is not None and name in quiet:
            q = quiet[name]["batch_s"]
            cases.append({"case": name, "quiet_s": q, "loaded_s": row["batch_s"], "loaded_s_runs": row["batch_s_runs"],
                          "slowdown": round(row["batch_s"] / q - 1, 4), "ratio_to_gemm": row["ratio_to_gemm"]})
    return {"procs": procs, "cases": cases}


def _timed_jobs(cfg, trace, runs: int) -> list:
    """``runs`` timed passes of the trace, the first after one untimed pass (JIT, autotuning)."""
    return [(_replace(cfg, warmup=True), trace)] + [(cfg, trace)] * (runs - 1)


def _replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def _setup(args: argparse.Namespace):
    from cpkv.cli.args import as_flags, flags_of
    from cpkv.config import CPConfig, check_batch_sizes
    from cpkv.engine.config import EngineConfig, default_graph_tokens
    from cpkv.errors import ConfigError
    from cpkv.model.config import load_model_config

    if not 0.0 <= args.cached < 1.0:
        raise ConfigError(f"--cached: expected a share in [0, 1), got {args.cached}")
    if args.long < 0:
        raise ConfigError(f"--long: expected 0 (no long prompt) or a token count, got {args.long}")
    CPConfig(args.cp, args.page_size)  # validates cp and page_size before they size anything
    cfg_m = load_model_config(args.model, args.layers, args.experts)
    P = args.page_size
    with as_flags(flags_of(("chunk_size", "page_size"))):
        check_batch_sizes(P, args.chunk_size, 1)
    prefix = int(args.prompt * args.cached) // P * P
    turn = getattr(args, "turn", 0)
    trace = bench_trace(args.prompt, prefix, args.long, turn)
    tokens = 2 * args.prompt + args.long + turn
    pages = -(-tokens // P) + 16
    chunk = min(args.chunk_size, -(-max(args.prompt, args.long) // P) * P)
    cfg = EngineConfig(model=args.model, num_layers=args.layers, experts=args.experts, cp=args.cp, mode=args.mode, device=args.device,
                       page_size=P, pages_per_rank=pages // args.cp + 16, chunk_size=chunk, max_requests=1,
                       chain=not getattr(args, "no_chain", False),
                       graph_tokens=default_graph_tokens(args.device, getattr(args, "graph_tokens", None)))
    return cfg, cfg_m, load_model_config(args.model, None, args.experts), trace


def bench_trace(prompt: int, prefix: int, long: int = 0, turn: int = 0):
    """cold: a fresh prompt; base: the prefix alone (fills the cache); hit: base + the rest; long: a fresh
    long prompt (several chunks); turn: cold + ``turn`` new tokens (its whole prompt cached: a small batch)."""
    from cpkv.scheduler.trace import TraceRequest

    trace = [TraceRequest("cold", 0.0, prompt), TraceRequest("base", 0.0, prefix),
             TraceRequest("hit", 0.0, prompt, None, "base")]
    trace += [TraceRequest("long", 0.0, long)] if long else []
    # the turn follows the cold prompt, which finishes first: a turn waiting on a later request would keep the
    # engine from planning ahead (and chaining the long prompt's chunks) until that request ends
    return trace + ([TraceRequest("turn", 0.0, prompt + turn, None, "cold")] if turn else [])


CASES = (("cold", "cold"), ("cached", "hit"), ("long", "long"), ("turn", "turn"))


def _batches(res, rid: str) -> list[int]:
    """Indices of the batches that computed request ``rid`` (its chunks, in order)."""
    return [k for k, b in enumerate(res.stats["batch_log"]) if b[0][0] == rid]


def case_row(name: str, runs, rid: str, cfg, ceiling: float, prof=None, hprof=None, marked=None) -> dict | None:
    """One case over the timed runs (median, per run), with its breakdown from the profiled run, its host
    functions (``host_profile``: the first batch's, under cProfile) from the host-profiled run and its first
    batch's timeline marks from the marked run."""
    from cpkv.bench.breakdown import parts

    idx = _batches(runs[0], rid)
    if not idx:
        return None
    chunks = [runs[0].stats["batch_log"][k][0][1:3] for k in idx]  # (prefix, extend) per chunk
    flops = sum(prefill_flops(cfg, p, e) for p, e in chunks)
    per_run = [sum(r.stats["batch_s"][k] for k in idx) for r in runs]
    secs = statistics.median(per_run)
    prompt, cached = chunks[-1][0] + chunks[-1][1], chunks[0][0]
    row = {"case": name, "prompt": prompt, "cached": cached, "batches": len(idx), "batch_s": round(secs, 4),
           "batch_s_runs": [round(s, 4) for s in per_run], "spread": round(max(per_run) / min(per_run) - 1, 4),
           "prompt_tokens_per_s": round(prompt / secs, 1), "computed_tokens_per_s": round((prompt - cached) / secs, 1),
           "tflops": round(flops / secs / 1e12, 1), "ratio_to_gemm": round(flops / secs / 1e12 / ceiling, 4),
           "ratio_runs": [round(flops / s / 1e12 / ceiling, 4) for s in per_run],
           "chunk_s": [round(statistics.median(r.stats["batch_s"][k] for r in runs), 4) for k in idx],
           # until the host had launched the whole forward (the same runs): near batch_s = bound by the host
           "host_s": round(statistics.median(sum(r.stats["host_s"][k] for k in idx) for r in runs), 4),
           "chunks": [list(c) for c in chunks],
           # per chunk: planned during the batch before (its plan and launch hidden behind that batch's GPU work, its
           # time from that batch's end) or not (from its own start: its plan, and any launch the GPU waits for, count)
           "planned_ahead": [bool(runs[0].stats["batch_ahead"][k]) for k in idx]}
    if prof is not None and prof.stats.get("kernels"):
        med = {k: statistics.median(r.stats["batch_s"][k] for r in runs) for k in idx}
        row["breakdown"] = parts([(prof.stats["kernels"][k], med[k]) for k in idx])
        row["breakdown"]["host_ops"] = [prof.stats["host_ops"][k] for k in idx]
    if hprof is not None and hprof.stats.get("host_funcs"):
        row["host_profile"] = hprof.stats["host_funcs"][idx[0]]
    if marked is not None and marked.stats.get("marks"):
        row["marks"] = marks_of(marked.stats, idx)
    return row


def add_sustained(rep: dict, sustained: dict | None) -> None:
    """The sustained GEMM measurement (``sustained_gemm``) and each case's ratio against it."""
    if not sustained or not sustained.get("tflops"):
        return
    rep["gemm_sustained"] = sustained
    for c in rep["cases"]:
        c["ratio_to_sustained_gemm"] = round(c["tflops"] / sustained["tflops"], 4)


def add_floor(rep: dict, cfg, copy: float) -> None:
    """Each case's floor and its ratio to it (cp 1 only: a rank's weights and FLOPs are the whole batch's): per
    chunk the longer of its FLOPs at the bf16 GEMM rate and the weights it reads once (``weight_floor_bytes``) at
    the device's copy rate, summed. A small batch reads more bytes than it has FLOPs for (a 448-token turn's MoE layer
    reads every expert), so its ratio to the GEMM rate alone says little of how near it runs to what it can."""
    rep["copy_gbs"] = copy
    if rep["cp"] != 1 or not copy:
        return
    gemm, stored = rep["gemm_tflops"], rep.get("weights_dtype") or "bf16"
    # the memory plan's terms: fp8 linear weights, or weights widened to the compute dtype (float32 on the CPU)
    weights, compute = ("fp8", "bfloat16") if stored == "fp8" else ("bf16", "float32" if stored == "float32" else
                                                                    "bfloat16")
    for c in rep["cases"]:
        last = len(c["chunks"]) - 1  # the chunk with the request's last token: the only one that reads the head
        floor = sum(max(prefill_flops(cfg, p, e) / (gemm * 1e12),
                        weight_floor_bytes(cfg, weights, e, head=i == last, compute=compute) / (copy * 1e9))
                    for i, (p, e) in enumerate(c["chunks"]))
        c["floor_s"] = float(f"{floor:.4g}")
        c["ratio_to_floor"] = round(floor / c["batch_s"], 4)


def weight_floor_bytes(cfg, weights: str, tokens: int, head: bool = True, compute: str = "bfloat16") -> float:
    """Bytes of weights a cp-1 batch of ``tokens`` new tokens reads at least once, stored as ``weights`` with
    ``compute`` the model dtype (``memplan.weight_bytes``' terms): every tensor but the embedding table (it reads its tokens' rows), kv_b_proj (the layers read their
    W_UK / W_UV copies of it, counted instead) and, unless ``head`` (the batch ends a request: its last token's
    logits), the LM head; and of each MoE layer's routed experts those its tokens' top-k pairs are expected to hit
    under uniform routing, E (1 - (1 - k/E)^T). Skewed routing hits fewer, so for a batch of few tokens this can
    exceed what it must read; from T k >= 8 E (a 448-token batch of GLM-5 at cp 1: 14 E) every expert is hit
    unless the router leaves some without a single pair."""
    from cpkv.memplan import tensor_bytes, weight_bytes
    from cpkv.model.checkpoint import expected_shapes

    wb = weight_bytes(cfg, weights, compute)  # replicated: all but the routed experts, W_UK / W_UV copies included
    unread = sum(tensor_bytes(n, sh, weights, compute) for n, sh in expected_shapes(cfg).items()
                 if n == "model.embed_tokens.weight" or n.endswith("kv_b_proj.weight")
                 or (n == "lm_head.weight" and not head))
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = e * (1 - (1 - k / e) ** tokens) if e and wb.moe_layers else 0.0
    return float(wb.replicated - unread + wb.expert * wb.moe_layers * hit)


AHEAD_MS = 0.1  # a mark the GPU reached within this of the host issuing it: the GPU was waiting for the host


def marks_of(stats: dict, idx: list[int]) -> dict:
    """A case's timeline marks from the marked run: its first batch's rows, and per later batch (chunk) the
    GPU's idle before it: from the previous batch's last mark (its last kernel) to this one's first mark."""
    got = [stats["marks"][k] for k in idx]
    columns = ["label", "host_ms", "gpu_ms"] + (["sm_mhz"] if got[0]["rows"] and len(got[0]["rows"][0]) > 3 else [])
    out = {"columns": columns, "unix_start": got[0]["unix_start"], "rows": got[0]["rows"],
           "batch_s": round(stats["batch_s"][idx[0]], 4)}
    rows = got[0]["rows"]
    waited = [r[2] for r in rows if r[2] - r[1] < AHEAD_MS]
    out["gpu_waits_for_host_until_ms"] = max(waited) if waited else 0.0  # then the host stays ahead
    clocks = sorted(r[3] for r in rows if len(r) > 3 and r[2] - r[1] >= AHEAD_MS)  # probes queued behind work
    if clocks:
        out["sm_mhz_median"] = clocks[len(clocks) // 2]
    if len(got) > 1:
        out["chunk_start_idle_ms"] = [
            round(b["gpu_start_ms"] + b["rows"][0][2] - a["gpu_start_ms"] - a["rows"][-1][2], 3)
            for a, b in zip(got, got[1:]) if a["rows"] and b["rows"]]
    return out


def ttft(rows: dict, layers: int, full_layers: int, dense_rows: dict | None = None,
         split: tuple[int, int] | None = None) -> dict:
    """TTFT of 32K / 64K / 128K prompts through ``full_layers`` layers, from the cold and long cases.

    ``dense_rows`` (the same cases through the first ``split[0]`` layers, all dense, alone) and ``split`` =
    (dense layers measured alone, dense layers of the full model): each kind of layer weighted by its own
    measured time (module docstring); without them the measured time is scaled by the layer count."""
    out = {"layers_measured": layers, "layers": full_layers, "extrapolated": layers != full_layers}
    weighted = dense_rows is not None and split is not None

    def total(case: str, k: int | None) -> float:
        t = _secs(rows[case], k)
        if not weighted:
            return t * full_layers / layers
        (d, full_d), t_d = split, _secs(dense_rows[case], k)
        return t_d / d * full_d + max(t - t_d, 0.0) / (layers - d) * (full_layers - full_d)

    if weighted:
        d, full_d = split
        out["weighting"] = (f"dense and MoE layers by their own measured times ({d} dense layer{'s' * (d != 1)} "
                            "also run alone)")
        if "cold" in rows and "cold" in dense_rows:
            t, t_d = rows["cold"]["batch_s"], dense_rows["cold"]["batch_s"]
            out["per_layer_s"] = {"dense": round(t_d / d, 5), "moe": round(max(t - t_d, 0.0) / (layers - d), 5),
                                  "dense_layers": full_d, "moe_layers": full_layers - full_d}
    else:
        out["weighting"] = "measured layers scaled by the layer count"
    have = (lambda case: case in rows and (not weighted or case in dense_rows))
    if have("cold"):
        out[str(rows["cold"]["prompt"])] = round(total("cold", None), 3)
    if have("long"):
        c = rows["long"]["chunk_s"]
        per_chunk = rows["long"]["prompt"] // len(c)
        for n in range(2, len(c) + 1, 2):
            out[str(n * per_chunk)] = round(sum(total("long", k) for k in range(n)), 3)
    return out


def _secs(row: dict, chunk: int | None) -> float:
    """A case's median batch time, or one chunk's."""
    return row["batch_s"] if chunk is None else row["chunk_s"][chunk]


def _report(args, cfg_m, cfg_full, ceiling: float, timed, prof, dense_runs=None, dense: int | None = None,
            hprof=None, marked=None) -> dict:
    import torch

    from cpkv.model.config import load_model_config

    rows = {}
    for name, rid in CASES:
        row = case_row(name, timed, rid, cfg_m, ceiling, prof, hprof, marked)
        if row is not None:
            rows[name] = row
    dense_rows, split = None, None
    if dense_runs and dense:
        cfg_d = load_model_config(args.model, dense)  # dense layers only: --experts does not apply
        dense_rows = {name: r for name, rid in CASES
                      if (r := case_row(name, dense_runs, rid, cfg_d, ceiling)) is not None}
        split = (dense, cfg_full.mlp_layer_types.count("dense"))
    full_layers = cfg_full.num_layers
    st = timed[0].stats
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"model": cfg_m.name, "layers": args.layers, "indexer_layers": list(cfg_m.full_layers),
            "moe_layers": cfg_m.mlp_layer_types.count("sparse"), "cp": args.cp, "mode": st["mode"], "barrier": st["barrier"],
            "device": device, "gemm_tflops": ceiling, "runs": args.runs, "chunk_size": args.chunk_size,
            "weights_dtype": st.get("weights_dtype"), "chained_batches": st.get("chained"),
            "sparse_mla": sparse_mla_used(args.device),
            "graph_tokens": timed[0].cfg.graph_tokens, "graphs": (st.get("graphs_per_rank") or [None])[0],
            "load_s": (st.get("load_s_per_rank") or [None])[0],
            "gpu_memory": (st.get("gpu_memory_per_rank") or [None])[0],
            "cases": list(rows.values()), "ttft_s": ttft(rows, args.layers, full_layers, dense_rows, split),
            "breakdown_from": None if prof is None else (
                "rank 0's kernels in a profiled run (one profiler over the run: batches chain as in the timed runs); "
                "shares of its walls; timed_wall_ms: median timed run")}


def sparse_mla_used(device: str) -> str:
    """The sparse attention backend the ranks run (they inherit this process's environment): flashmla where
    ``CPKV_SPARSE_MLA`` allows it and ``flash_mla`` imports (GLM-5's shapes are FlashMLA's), else cpkv."""
    from cpkv.attention import flashmla
    from cpkv.attention.sparse import sparse_backend

    use = device == "cuda" and sparse_backend() != "cpkv" and flashmla.load() is not None
    return "flashmla" if use else "cpkv"


def _print(rep: dict, as_json: bool) -> None:
    from cpkv.cli.fmt import emit_json

    if as_json:
        emit_json(rep)
        return
    for r in [rep] + rep.get("other_weights", []):
        if "other_weights" in rep:
            print(f"\n== {r['weights_dtype']} weights")
        _print_mode(r)
    for key, row in rep.get("speedup", {}).items():
        a, b = key.split("_over_")
        print(f"\n{a} weights over {b} (time with {b} / time with {a}): "
              + ", ".join(f"{k.replace('ttft_', 'TTFT ')} {v:.2f}x" for k, v in row.items()))
    load = rep.get("host_load")
    if load:
        print(f"\nwith {load['procs']} busy-loop processes on the host: "
              + ", ".join(f"{c['case']} {c['loaded_s']} s ({c['slowdown']:+.1%}, {c['ratio_to_gemm']:.1%} of GEMM)"
                          for c in load["cases"]))
    sus = rep.get("gemm_sustained")
    if sus:
        print(f"sustained GEMM {sus['tflops']} TFLOP/s over {sus['seconds']} s (SM clock {sus['sm_mhz_start']} -> "
              f"{sus['sm_mhz_end']} MHz); of it: " + ", ".join(f"{c['case']} {c['ratio_to_sustained_gemm']:.1%}"
                                                              for c in rep["cases"]))
    print(f"{rep['model']} shapes, {rep['layers']} layers (indexer on {len(rep['indexer_layers'])}, MoE on "
          f"{rep['moe_layers']}), cp {rep['cp']} ({rep['device']}, mode {rep['mode']}, "
          f"barrier {rep['barrier']}); ceiling: GEMM {rep['gemm_tflops']:.3g} TFLOP/s measured in this run; floor "
          f"(cp 1): the longer of a chunk's FLOPs at that rate and its weights read once at the copy rate "
          f"({rep.get('copy_gbs') or 0:.4g} GB/s)")
    if rep.get("load_s") is not None:
        print(f"model load {rep['load_s']} s (rank 0)")
    for sk in rep.get("skipped") or []:
        print(f"case {sk['case']} skipped: {sk['reason']}")
    ex = rep.get("extrapolation")
    if ex:
        print(f"TTFT at {rep['layers']} layers measured / extrapolated from {ex['from_layers']} layers: " + ", ".join(
            f"{k} tokens {v['measured_s']} s / {v['extrapolated_s']} s ({v['difference']:+.1%})"
            for k, v in ex.items() if k.isdigit() and v["difference"] is not None))
    if rep.get("decode"):
        from cpkv.bench.decode import print_cases

        print("\npaged decode steps (cpkv bench decode's cases; floor: the busiest rank's bytes at the copy rate):")
        print_cases(rep["decode"])
    gr = rep.get("graphs")
    if gr:
        print(f"CUDA graphs up to {gr['max_tokens']} tokens: {gr['batches']} batches of the timed run through them, "
              f"{gr['graphs_held']} pieces captured in {gr['warm_s']} s, {gr['eager_pieces']} run eagerly, "
              f"{gr['device_bytes'] / 2**20:.0f} MiB of buffers and pool")


def _print_mode(rep: dict) -> None:
    """One weights mode's tables and TTFT line."""
    from cpkv.cli.fmt import table
    from cpkv.bench.breakdown import LABELS, PARTS

    rows = rep["cases"]
    floor = lambda r: f"{r['ratio_to_floor']:.1%}" if "ratio_to_floor" in r else "-"  # noqa: E731
    ahead = lambda r: f"{sum(r['planned_ahead'])}/{r['batches']}" if "planned_ahead" in r else "-"  # noqa: E731
    table(("case", "prompt", "cached", "batches", "planned ahead", "batch s", "runs s", "prompt tok/s", "TFLOP/s",
           "of GEMM", "of floor", "spread"),
          [(r["case"], r["prompt"], r["cached"], r["batches"], ahead(r), r["batch_s"],
            " ".join(map(str, r["batch_s_runs"])), r["prompt_tokens_per_s"], r["tflops"], f"{r['ratio_to_gemm']:.1%}",
            floor(r), f"{r['spread']:.1%}") for r in rows])
    with_parts = [r for r in rows if "breakdown" in r]
    if with_parts:
        print()
        table(("part", *(f"{r['case']} ms (share)" for r in with_parts)),
              [(LABELS[p], *(f"{r['breakdown']['parts'][p]['ms']:.2f} ({r['breakdown']['parts'][p]['share']:.1%})"
                             for r in with_parts)) for p in PARTS]
              + [("GPU busy / wall ms (profiled)",
                  *(f"{r['breakdown']['gpu_busy_ms']:.2f} / {r['breakdown']['wall_ms']:.2f}" for r in with_parts)),
                 ("wall ms (timed runs)", *(f"{r['breakdown']['timed_wall_ms']:.2f}" for r in with_parts))])
    marked = [r for r in rows if "marks" in r]
    if marked:
        print()
        for r in marked:
            m = r["marks"]
            extra = (f", SM clock {m['sm_mhz_median']} MHz" if "sm_mhz_median" in m else "") + \
                (f", GPU idle before chunks 2.. {m['chunk_start_idle_ms']} ms" if "chunk_start_idle_ms" in m else "")
            print(f"marks, {r['case']}: the GPU waits for the host until {m['gpu_waits_for_host_until_ms']} ms into "
                  f"the batch, then the host is ahead{extra}")
    t = rep["ttft_s"]
    sizes = [k for k in t if k.isdigit()]
    how = f"extrapolated from {t['layers_measured']} layers" if t["extrapolated"] else "measured"
    per = t.get("per_layer_s")
    weighting = (f"; per layer: dense {per['dense'] * 1e3:.1f} ms x {per['dense_layers']}, MoE {per['moe'] * 1e3:.1f} ms "
                 f"x {per['moe_layers']}" if per else "")
    print(f"\nTTFT through {t['layers']} layers on this device ({how}, {t['weighting']}{weighting}): "
          + ", ".join(f"{int(k) / 1024:g}K {t[k]} s" for k in sizes))


def prefill_flops(cfg, prefix: int, extend: int) -> float:
    """Model FLOPs of computing tokens [prefix, prefix + extend): linear layers (MoE: the routed experts a
    token runs plus the shared ones), the indexer on full indexer layers only, sparse attention."""
    d, h, qr, kr = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    nope, rope, v, hi, di = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.index_n_heads, cfg.index_head_dim
    attn = d * qr + qr * h * (nope + rope) + d * (kr + rope) + h * nope * kr + h * kr * v + h * v * d
    moe = 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) + d * cfg.n_routed_experts
    mlp = {"dense": 3 * d * cfg.intermediate_size, "sparse": moe}
    seq = prefix + extend
    keys = (seq * (seq + 1) - prefix * (prefix + 1)) // 2          # sum of visible keys over the queries
    sparse = seq > cfg.index_topk
    attended = sum(min(p + 1, cfg.index_topk) for p in range(prefix, seq))
    total = 0
    for kind, full in zip(cfg.mlp_layer_types, (t == "full" for t in cfg.indexer_types)):
        linear = attn + mlp[kind] + ((qr * hi * di + d * di + d * hi) if full else 0)
        indexer = 2 * keys * hi * di if sparse and full else 0
        total += 2 * linear * extend + 2 * attended * h * (kr + rope + kr) + indexer
    return float(total)


def sustained_gemm(seconds: float = 1.5) -> dict:
    """The bf16 GEMM rate this GPU keeps up: 8192^3 GEMMs back to back for ``seconds``, the rate over the last
    third, and the SM clock at the start and at the end (a spin probe, ``cpkv.timeline``). A burst of a few
    GEMMs (``gemm_tflops``) runs at boost clocks; a batch that follows a second of GEMMs runs where the power cap
    holds the clock (700 W on an H200), and its ratio against the burst mixes the two."""
    import time

    import torch

    from cpkv.timeline import sm_clock_mhz

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    first = sm_clock_mhz()
    t0 = time.perf_counter()
    marks = []
    while (now := time.perf_counter()) - t0 < seconds:
        for _ in range(8):
            a @ b
        torch.cuda.synchronize()
        marks.append((time.perf_counter(), 8))
    last = sm_clock_mhz()
    tail = [m for m in marks if m[0] - t0 >= seconds * 2 / 3]
    span = tail[-1][0] - tail[0][0]
    reps = sum(k for _, k in tail[1:])
    del a, b
    torch.cuda.empty_cache()
    return {"tflops": round(2 * n ** 3 * reps / span / 1e12, 1) if span > 0 else None, "seconds": seconds,
            "sm_mhz_start": first, "sm_mhz_end": last}


def gemm_tflops(device: str) -> float:
    """bf16 (CUDA) / float32 (CPU) square GEMM rate, TFLOP/s."""
    import time

    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 20 if device == "cuda" else 3
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    rate = 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12
    del a, b
    if device == "cuda":
        torch.cuda.empty_cache()
    return round(rate, 4)
