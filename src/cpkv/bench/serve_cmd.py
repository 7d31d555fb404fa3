"""``cpkv bench serve``: an open-loop HTTP load generator against ``cpkv serve`` (or any server with SGLang's
``/generate`` or OpenAI's streamed ``/v1/completions``), like SGLang's ``bench_serving``.

It sends a trace's requests at their arrival times (``--rate R``: Poisson arrivals instead;
``--closed-loop``: ``--concurrency`` requests in flight), follow-ups of a conversation once their parent
has answered, and reports TTFT and end-to-end latency percentiles, throughput and the cache-hit ratio the
server reported; ``--out-jsonl`` keeps every request, ``--plot`` draws the TTFT histogram. Without
``--trace`` it sends the seed-shaped trace (``scheduler.trace.SERVE_SHAPE``: 16K-128K-token multi-turn
conversations, short cache-hit continuations, prompts that need chunked prefill; ``--scale`` shrinks it
for the CPU tiny model); ``--make-trace FILE`` only writes that trace.

The engine options (``--cp``, ``--chunk-size``, ``--page-size``, ``--max-requests``, ``--pages-per-rank``,
``--policy``, ``--model``) describe the server as it was started: they set the synthetic tokens'
vocabulary, the calibration's batch geometry and ``cpkv replay``'s prediction for the same requests,
reported beside the measured TTFT of an open-loop run (``--costs FILE``: the unit costs to predict with,
e.g. the ``--json`` report of an earlier ``--closed-loop`` run; default: the costs fitted on this run's
requests that ran alone). A closed-loop run is not replayed (its send times hang on its own answers, so
any error of the model would pile up); its report gives the fitted TTFT of its requests instead.

While it waits (for an arrival, for answers) the progress line on stderr says for what, refreshed at least every
5 s (``CPKV_PROGRESS_S``); a trace whose arrivals span more than 10 minutes is announced before the load starts.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cpkv.config import DEFAULT_PAGE_SIZE, TOY_SIZES

if TYPE_CHECKING:
    from cpkv.bench.serve import Clock
    from cpkv.cli.fmt import Progress

HELP = "Open-loop HTTP load generator for cpkv serve: TTFT percentiles, throughput, cache hits, replay prediction."
# cpkv serve's defaults, the "toy" size preset (cpkv.config.SIZES) with its cp
GEOMETRY = {"cp": 2, "chunk_size": TOY_SIZES.chunk_size, "page_size": DEFAULT_PAGE_SIZE,
            "max_requests": TOY_SIZES.max_requests, "pages_per_rank": TOY_SIZES.pages_per_rank}
# option -> the server's /get_server_info field (cpkv serve's; SGLang's names where they exist)
SERVER_INFO = {"cp": "cp_size", "chunk_size": "chunked_prefill_size", "page_size": "page_size",
               "max_requests": "max_running_requests", "pages_per_rank": "pages_per_rank", "policy": "schedule_policy",
               "model": "model_path"}
BUILTIN = {"requests": 200, "seed": 0, "scale": 1.0}
LONG_SPAN_S = 600.0  # a trace whose arrivals span longer is announced (one stderr line) before the load starts


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.bench.serve import ENDPOINTS, PROMPT_FORMATS
    from cpkv.cli.args import bounded_float, bounded_int, nonneg_int, positive_float, positive_int, seed
    from cpkv.scheduler.admission import POLICIES

    p.add_argument("--url", help="the server, e.g. http://127.0.0.1:30000")
    p.add_argument("--trace", help="JSONL trace (docs/trace-format.md); default: the seed-shaped trace")
    p.add_argument("--requests", type=positive_int, help=f"seed-shaped trace: requests (default {BUILTIN['requests']})")
    p.add_argument("--seed", type=seed, help="seed-shaped trace and --rate arrivals: random seed (default 0)")
    p.add_argument("--scale", type=positive_float, help="seed-shaped trace: length multiplier (default 1.0)")
    p.add_argument("--make-trace", metavar="FILE.jsonl", help="write the seed-shaped trace to FILE and exit")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=positive_float, help="Poisson arrivals at R requests/s instead of the trace's")
    load.add_argument("--closed-loop", action="store_true", help="--concurrency requests in flight, no arrival times")
    p.add_argument("--concurrency", type=positive_int, help="closed loop: requests in flight (default 1)")
    p.add_argument("--duration", type=positive_float, metavar="S", help="send nothing after S seconds")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="completions",
                   help="completions: streamed /v1/completions, TTFT measured here (default); generate: /generate")
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="ids",
                   help="send prompts as token ids (default) or as text: each request's synthetic tokens turned "
                        "into text by the server's POST /detokenize (needs a server with a tokenizer)")
    p.add_argument("--max-tokens", type=positive_int, default=1, help="tokens to generate per request (default 1)")
    p.add_argument("--temperature", type=bounded_float(0.0, 1e6, low_open=False), default=0.0,
                   help="sampling temperature sent with every request (default 0: greedy)")
    p.add_argument("--top-p", type=bounded_float(0.0, 1.0), help="top_p sent with every request")
    p.add_argument("--top-k", type=bounded_int(-1, 1 << 31), help="top_k sent with every request (-1, 0: off)")
    p.add_argument("--min-p", type=bounded_float(0.0, 1.0, low_open=False), help="min_p sent with every request")
    p.add_argument("--warmup", type=nonneg_int, default=0, metavar="N",
                   help="first send N unrecorded requests of fresh tokens, one at a time (kernel compilation)")
    p.add_argument("--served-model", help="the 'model' field sent (default: the first of GET /v1/models)")
    p.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds a request may wait for its next answer byte before it fails (default 600)")
    p.add_argument("--model", help="the server's model preset: vocabulary, top-k (default: the server's "
                   "/get_server_info, else tiny)")
    for k, v in GEOMETRY.items():
        p.add_argument("--" + k.replace("_", "-"), type=positive_int,
                       help=f"as the server was started (default: the server's /get_server_info, else {v})")
    p.add_argument("--policy", choices=POLICIES, help="as the server was started (default: the server's "
                   "/get_server_info, else solo)")
    p.add_argument("--costs", metavar="COSTS.json", action="append",
                   help="unit costs for the replay prediction (a cost object or a bench --json report; repeatable)")
    p.add_argument("--out-jsonl", metavar="FILE.jsonl", help="write one JSON line per request")
    p.add_argument("--sent-trace", metavar="FILE.jsonl", help="write the completed requests as a replay trace")
    p.add_argument("--plot", metavar="FILE.png", help="write a TTFT histogram (matplotlib)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def sampling_fields(args: argparse.Namespace) -> dict[str, float]:
    """The sampling fields every request carries: temperature when not 0, and each of top_p, top_k, min_p given."""
    out = {"temperature": args.temperature} if args.temperature else {}
    out.update({name: getattr(args, name) for name in ("top_p", "top_k", "min_p") if getattr(args, name) is not None})
    return out


def run(args: argparse.Namespace) -> int:
    from cpkv.errors import ConfigError
    from cpkv.files import check_inputs

    check_inputs({"--trace": args.trace, "--costs": args.costs})  # the input policy, before anything is opened
    trace, source = _trace(args)
    if args.make_trace:
        _write(args.make_trace, "--make-trace", lambda path: _write_trace(trace, path))
        print(f"wrote {len(trace)} requests ({source}) to {args.make_trace}", file=sys.stderr)
        return 0
    if importlib.util.find_spec("httpx") is None:
        raise ConfigError("needs httpx, which is not installed: pip install 'cpkv[serve]' (or pip install httpx)")
    if not args.url:
        raise ConfigError("--url: required (the server to load, e.g. http://127.0.0.1:30000), or --make-trace FILE")
    url = check_url(args.url)
    if args.concurrency is not None and not args.closed_loop:
        raise ConfigError(f"--concurrency {args.concurrency}: only with --closed-loop")
    from_server(args, _server_info(url, args.timeout))
    plt, costs, rcfg, model = _prepare(args)
    report, records = _measure(args, url, trace, source, model, costs, rcfg)
    _outputs(args, records, report, plt)
    if args.json:
        from cpkv.cli.fmt import emit_json
        emit_json(report)
    else:
        _print(report)
    return 0 if report["summary"]["completed"] else 1


def check_url(text: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing slash, or ConfigError."""
    import httpx

    from cpkv.errors import ConfigError

    try:
        u = httpx.URL(text)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise ConfigError(f"--url {text!r}: expected http://HOST:PORT, got an invalid URL ({exc})") from None
    if u.scheme not in ("http", "https") or not u.host:
        raise ConfigError(f"--url {text!r}: expected http://HOST:PORT (or https), got "
                          f"{'no host' if u.scheme in ('http', 'https') else 'scheme ' + repr(u.scheme or '')}")
    if u.query or u.fragment:
        raise ConfigError(f"--url {text!r}: expected no query or fragment")
    return str(u).rstrip("/")


def _trace(args: argparse.Namespace):
    from cpkv.errors import ConfigError
    from cpkv.scheduler.trace import SERVE_SHAPE, builtin_trace, load_trace

    given = [f"--{k}" for k in BUILTIN if getattr(args, k) is not None and k != "seed"]
    if args.trace and (given or args.make_trace):
        raise ConfigError(f"{', '.join(given) or '--make-trace'}: only for the seed-shaped trace, but --trace "
                          f"{args.trace!r} was given: drop one of them")
    seed = 0 if args.seed is None else args.seed
    if args.trace:
        return load_trace(args.trace), args.trace
    n, scale = args.requests or BUILTIN["requests"], args.scale or BUILTIN["scale"]
    return builtin_trace(n, seed=seed, scale=scale, shape=SERVE_SHAPE), \
        f"seed-shaped trace (n={n}, seed={seed}, scale={scale:g})"


def _write_trace(trace, path: str) -> None:
    from cpkv.scheduler.trace import write_trace
    write_trace(trace, path)


def _write(path: str, option: str, write) -> None:
    from cpkv.errors import ConfigError

    try:
        write(path)
    except OSError as exc:
        raise ConfigError(f"{option} {path!r}: cannot write it ({exc.strerror})") from None


def _prepare(args: argparse.Namespace):
    """Every option and output checked before any request: (pyplot or None, costs or None, replay config, model)."""
    from cpkv.cli.args import as_flags, check_distinct, check_output, flags_of
    from cpkv.cli.replay_cmd import _pyplot
    from cpkv.config import PRESETS
    from cpkv.model.config import load_model_config
    from cpkv.scheduler.costs import CostModel
    from cpkv.scheduler.replay import ReplayConfig

    outputs = {"--out-jsonl": args.out_jsonl, "--sent-trace": args.sent_trace, "--plot": args.plot}
    check_distinct(outputs, {"--trace": args.trace})
    for option, path in outputs.items():
        check_output(path, option)
    model = load_model_config(args.model)
    with as_flags({**flags_of([*GEOMETRY, "policy"]), "kv_tokens_per_rank": "--pages-per-rank"}):
        rcfg = ReplayConfig(policy=args.policy, kv="shared", cp=args.cp, page_size=args.page_size,
                            chunk_size=args.chunk_size, max_requests=args.max_requests,
                            kv_tokens_per_rank=(args.pages_per_rank - 1) * args.page_size,
                            model=args.model if args.model in PRESETS else "glm5")
    costs = CostModel.from_json(*args.costs) if args.costs else None
    return (_pyplot(args.plot) if args.plot else None), costs, rcfg, model


def _measure(args, url: str, trace, source: str, model, costs, rcfg) -> tuple[dict[str, Any], list]:
    import asyncio

    from dataclasses import replace

    from cpkv.bench.serve import (Clock, LoadConfig, detokenize_plan, plan_requests, poisson_due, run_load, trace_due,
                                  warmup_plan)
    from cpkv.bench.serve_report import Geometry, fit_costs, predict, summary
    from cpkv.cli.fmt import Progress
    from cpkv.scheduler.costs import CostModel

    seed = 0 if args.seed is None else args.seed
    due = None if args.closed_loop else poisson_due(len(trace), args.rate, seed) if args.rate else trace_due(trace)
    plan = plan_requests(trace, model.vocab_size, due)
    served = args.served_model or _served_model(url, args.timeout)
    warm = warmup_plan(trace, args.warmup, model.vocab_size)
    if args.prompt_format == "text":
        plan = detokenize_plan(plan, url, served, args.timeout)
        warm = detokenize_plan(warm, url, served, args.timeout)
    cfg = LoadConfig(url=url, endpoint=args.endpoint, model=served, max_tokens=args.max_tokens,
                     prompt_format=args.prompt_format, sampling=sampling_fields(args),
                     duration_s=args.duration, concurrency=(args.concurrency or 1) if args.closed_loop else None,
                     timeout_s=args.timeout)
    bar = Progress(len(warm) + len(plan), "cpkv bench serve")
    waiting = Waiting(sorted(due or []))
    _announce_span(waiting.dues, args.duration)

    async def both():
        beat = asyncio.ensure_future(heartbeat(bar, waiting.note, tick_s(bar)))
        try:
            warm_cfg = replace(cfg, concurrency=1, duration_s=None)
            w = await run_load(warm, warm_cfg, on_done=lambda r: bar.update(1, "warm-up"))
            waiting.clock = Clock()
            return w, await run_load(plan, cfg, waiting.clock, on_done=lambda r: bar.update(1, _note(r)))
        finally:
            beat.cancel()

    try:
        warmed, records = asyncio.run(both())
    finally:
        bar.close()
    geometry = Geometry(args.cp, args.chunk_size, args.page_size, model.index_topk)
    fitted = fit_costs(records, geometry)
    use = costs if costs is not None else (CostModel().updated(fitted["costs"]) if fitted["costs"] else None)
    summ = summary(records)
    # replay models arrivals: a closed loop's send times hang on its own answers, so any error would pile up
    pred = predict(records, use, rcfg) if use is not None and not args.closed_loop else None
    if pred is not None:
        pred["costs_from"] = "--costs" if costs is not None else "this run"
        pred["ratio_to_measured"] = {q: (pred["ttft_s"][q] / summ["ttft_s"][q]
                                         if pred["ttft_s"][q] is not None and summ["ttft_s"][q] else None)
                                     for q in ("p50", "p90", "p99")}
    report = {
        "url": url, "endpoint": args.endpoint, "prompt_format": args.prompt_format, "served_model": served, "max_tokens": args.max_tokens,
        "sampling": sampling_fields(args),
        "warmup": {"requests": len(warmed), "failed": sum(r.status != "ok" for r in warmed)},
        "load": _load(args), "trace": {"source": source, "file": args.trace, "requests": len(trace)},
        "server": {"model": args.model, "policy": args.policy, **{k: getattr(args, k) for k in GEOMETRY}},
        "summary": summ, "costs": fitted["costs"], "calibration": fitted["calibration"], "prediction": pred,
    }
    return report, records


class Waiting:
    """The note of the progress line between answers: the warm-up, then (``clock`` set when the load starts) the
    next request's due time or the answers still awaited."""

    def __init__(self, dues: list[float]) -> None:
        self.dues: list[float] = dues
        self.clock: Clock | None = None

    def note(self) -> str:
        from cpkv.bench.serve import waiting_note

        return "warm-up" if self.clock is None else waiting_note(self.dues, self.clock.now())


def tick_s(bar: Progress) -> float:
    """Seconds between refreshes of the progress line while waiting: CPKV_PROGRESS_S, within 0.5..5."""
    return min(max(bar.interval_s, 0.5), 5.0)


async def heartbeat(bar: Progress, note: Callable[[], str], tick: float) -> None:
    """Refresh ``bar`` with ``note()`` every ``tick`` seconds until cancelled: a wait for a far arrival or a slow
    server is a progress line on stderr (Progress prints it at its own interval), never silence."""
    import asyncio

    while True:
        await asyncio.sleep(tick)
        bar.set(bar.done, note())


def _announce_span(dues: list[float], duration: float | None) -> None:
    """One line on stderr when the trace's arrivals span more than LONG_SPAN_S (and --duration does not cut it)."""
    span = dues[-1] if dues else 0.0
    if span > LONG_SPAN_S and (duration is None or duration > LONG_SPAN_S):
        print(f"cpkv bench serve: the trace's requests arrive over {span:.0f} s ({span / 86400:.1f} days); "
              "--duration S stops sending after S seconds", file=sys.stderr, flush=True)


def _note(rec) -> str:
    return f"last {rec.id!r}: {rec.status}"


def _load(args: argparse.Namespace) -> dict[str, Any]:
    if args.closed_loop:
        return {"mode": "closed-loop", "concurrency": args.concurrency or 1, "duration_s": args.duration}
    if args.rate:
        return {"mode": "poisson", "rate": args.rate, "duration_s": args.duration}
    return {"mode": "trace", "duration_s": args.duration}


def _server_info(url: str, timeout: float) -> dict[str, Any]:
    """GET /get_server_info, or {} when the server does not answer it."""
    import httpx

    try:
        info = httpx.get(url + "/get_server_info", timeout=min(timeout, 30.0)).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def from_server(args: argparse.Namespace, info: dict[str, Any]) -> None:
    """Fill the server options not given from the server's ``info`` (values of the wrong kind or unknown to this
    command are ignored), the rest from the defaults."""
    from cpkv.config import PRESETS
    from cpkv.scheduler.admission import POLICIES

    defaults = {**GEOMETRY, "policy": "solo", "model": "tiny"}
    for option, key in SERVER_INFO.items():
        if getattr(args, option) is not None:
            continue
        v = info.get(key)
        ok = v in POLICIES if option == "policy" else v in PRESETS if option == "model" else \
            type(v) is int and v > 0
        setattr(args, option, v if ok else defaults[option])


def _served_model(url: str, timeout: float) -> str:
    """The first model id of GET /v1/models; "default" when the server does not say."""
    import httpx

    try:
        data = httpx.get(url + "/v1/models", timeout=min(timeout, 30.0)).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def _outputs(args, records, report: dict[str, Any], plt) -> None:
    from cpkv.cli.args import atomic_output

    if args.out_jsonl:
        def lines(path: str) -> None:
            with atomic_output(path) as f:
                for r in records:
                    f.write(json.dumps(r.to_json(), default=str) + "\n")
        _write(args.out_jsonl, "--out-jsonl", lines)
    if args.sent_trace:
        from cpkv.bench.serve_report import sent_trace
        _write(args.sent_trace, "--sent-trace", lambda path: _write_trace(sent_trace(records), path))
    if plt is not None:
        _plot(plt, records, report, args.plot)


def _plot(plt: Any, records, report: dict[str, Any], path: str) -> None:
    """TTFT histogram of the completed requests, p50/p90/p99 marked (measured, and replay's when present)."""
    from cpkv.cli.args import atomic_path

    ttft = [r.ttft_s for r in records if r.status == "ok" and r.ttft_s is not None]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.hist(ttft or [0.0], bins=min(60, max(10, len(ttft) // 4)), color="tab:blue", alpha=0.8, label="measured")
    s, pred = report["summary"]["ttft_s"], report.get("prediction")
    for q, ls in (("p50", "-"), ("p90", "--"), ("p99", ":")):
        if s[q] is not None:
            ax.axvline(s[q], color="black", ls=ls, lw=1, label=f"measured {q} {s[q]:.3g} s")
        if pred and pred["ttft_s"][q] is not None:
            ax.axvline(pred["ttft_s"][q], color="tab:red", ls=ls, lw=1, label=f"replay {q} {pred['ttft_s'][q]:.3g} s")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("requests")
    ax.set_title(f"cpkv bench serve — {report['trace']['source']}, {report['load']['mode']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".").lower())
    plt.close(fig)


def _print(report: dict[str, Any]) -> None:
    from cpkv.cli.fmt import table

    s, pred = report["summary"], report["prediction"]
    cols = ("p50", "p90", "p99", "mean", "max")
    rows = [["measured TTFT", *(s["ttft_s"][q] for q in cols)], ["measured e2e", *(s["e2e_s"][q] for q in cols)]]
    rows += [[name, *(s[key][q] for q in cols)] for name, key in (("measured TPOT", "tpot_s"),
                                                                  ("inter-token latency", "itl_s"))
             if s[key]["p50"] is not None]
    if pred:
        rows.append([f"replay TTFT ({pred['costs_from']})", *(pred["ttft_s"][q] for q in cols)])
    table(["seconds", "p50", "p90", "p99", "mean", "max"], [[("-" if v is None else v) for v in r] for r in rows])
    if pred:
        ratio = pred["ratio_to_measured"]
        print("replay / measured TTFT: "
              + ", ".join(f"{q} {'-' if v is None else f'{v:.3f}'}" for q, v in ratio.items())
              + (f"; replay rejected {pred['rejected']} of {pred['requests']}" if pred["rejected"] else ""))
    hit = "-" if s["cache_hit_ratio"] is None else f"{s['cache_hit_ratio']:.3f}"
    tput = "-" if s["request_throughput"] is None else f"{s['request_throughput']:.3g} req/s, " \
        f"{s['input_token_throughput']:.4g} prompt tok/s, {s['output_token_throughput']:.3g} output tok/s"
    print(f"\n{report['trace']['source']} against {report['url']} ({report['endpoint']}, {report['load']['mode']}): "
          f"{s['completed']} of {s['requests']} completed, {s['failed']} failed, {s['not_sent']} not sent, "
          f"{s['skipped_parent_failed']} skipped (parent failed); {s['duration_s']:.1f} s, {tput}; "
          f"cache-hit ratio {hit} ({s['cached_tokens']} of {s['prompt_tokens']} prompt tokens)")
    for err, n in s["errors"].items():
        print(f"  {n} x {err}")
    cal = report["calibration"]
    if report["costs"]:
        fit = " / ".join(f"{cal['fitted_ttft_s'][q]:.3g}" for q in ("p50", "p90", "p99"))
        print(f"calibrated costs ({cal['requests_used']} requests ran alone, rmse {cal['rmse_s']:.3g} s, their TTFT "
              f"p50/p90/p99 as fitted {fit} s): " + ", ".join(f"{k} {v:.3g}" for k, v in report["costs"].items()))
    else:
        print(f"no calibration: {cal['reason']}")
    if s["follow_ups_without_parent_output"]:
        print(f"{s['follow_ups_without_parent_output']} follow-ups were sent without their parent's output "
              "(the server's stream carried no token_ids)")
