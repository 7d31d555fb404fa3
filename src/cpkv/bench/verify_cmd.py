"""``cpkv check verify``: ``cpkv run``'s verification over a matrix of models, weights, precisions, cp and seeds.

Each cp's runs share one set of rank processes (``run_jobs``: a model is made once per (model, seed, weights,
precision) and reused), every run records its discrete decisions, and each is then verified on one process
against the single-rank reference under those decisions (``cpkv.engine.engine.verify_run``): one row per run
with its logit difference, tolerance, the decisions that differed and their largest margins, the first-token
ties, and why a failed row failed.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

HELP = "cpkv run's verification over models x weights x precisions x cp x seeds (decisions, margins, ties)."


@dataclass(frozen=True)
class Case:
    model: str
    weights: str
    precision: str
    cp: int
    seed: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli import args as a

    p.add_argument("--models", default="tiny", help="comma-separated presets (default tiny; e.g. glm5,deepseek-v32)")
    p.add_argument("--weights", default="bf16", help="comma-separated: bf16, fp8 (default bf16)")
    p.add_argument("--precision", default="fp8", help="comma-separated: fp8, exact (default fp8)")
    p.add_argument("--cp", type=_ints(1, 64), default=[1, 2], help="comma-separated rank counts (default 1,2)")
    p.add_argument("--seeds", type=_ints(0, 2**31 - 1), default=[0], help="comma-separated seeds (default 0)")
    p.add_argument("--num-layers", type=a.layers, default=4, help="layers of each model (default 4)")
    p.add_argument("--requests", type=a.trace_requests, default=12, help="requests of the built-in trace (default 12)")
    p.add_argument("--long", type=a.bounded_int(0, 1 << 20), default=0, metavar="N",
                   help="add a two-turn conversation of N and N + 512 tokens (its second turn hits the first's pages): "
                        "prompts past the model's index top-k run sparse selection (GLM-5's top-k is 2048; default 0: "
                        "none)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--timeout", type=a.timeout_s, default=1800.0, help="seconds before one cp's ranks are ended")
    p.add_argument("--json", action="store_true", help="print JSON")


def _ints(low: int, high: int):
    """'1,2,4' -> [1, 2, 4], each in low..high (argparse type)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or min(values) < low or max(values) > high:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers in {low}..{high}, got {text[:40]!r}")
        return list(dict.fromkeys(values))
    parse.bounds = (low, high)  # type: ignore[attr-defined]
    parse.range_text = f"each {low}..{high}"  # type: ignore[attr-defined]
    return parse


def cases_of(args: argparse.Namespace) -> list[Case]:
    from cpkv.errors import ConfigError

    models, weights, precisions = (_names(getattr(args, k), k) for k in ("models", "weights", "precision"))
    bad = [w for w in weights if w not in ("bf16", "fp8")] + [p for p in precisions if p not in ("fp8", "exact")]
    if bad:
        raise ConfigError(f"unknown --weights / --precision value(s) {', '.join(bad)}: expected bf16, fp8 / fp8, exact")
    return [Case(m, w, p, cp, s) for cp, m, w, p, s in itertools.product(args.cp, models, weights, precisions,
                                                                             args.seeds)]


def _names(text: str, flag: str) -> list[str]:
    from cpkv.errors import ConfigError

    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ConfigError(f"--{flag} {text!r}: expected one or more comma-separated names")
    return list(dict.fromkeys(names))


def engine_config(case: Case, num_layers: int, device: str, pages: int = 256):
    from cpkv.engine.config import EngineConfig, default_graph_tokens

    return EngineConfig(model=case.model, seed=case.seed, num_layers=num_layers, cp=case.cp, device=device,
                        precision=case.precision, weights=case.weights, record=True, pages_per_rank=pages,
                        graph_tokens=default_graph_tokens(device, None, case.precision))


def make_trace(requests: int, long: int = 0) -> list:
    """The built-in trace of ``requests`` requests, plus a two-turn conversation of ``long`` and ``long`` + 512
    tokens when ``long`` > 0 (``cpkv.cli.traces.default_trace``)."""
    from cpkv.cli.traces import default_trace

    return default_trace(requests, long=long)


def run_matrix(cases: Sequence[Case], *, num_layers: int = 4, requests: int = 12, device: str = "cpu",
               timeout_s: float = 1800.0, on_progress: Callable[[str], None] | None = None,
               long: int = 0) -> list[dict[str, Any]]:
    """One row per case (module docstring), in ``cases``' order."""
    from cpkv.engine.engine import run_jobs

    trace = make_trace(requests, long)
    results: dict[Case, Any] = {}
    for cp in dict.fromkeys(c.cp for c in cases):
        todo = [c for c in cases if c.cp == cp]
        if on_progress:
            on_progress(f"cp {cp}: {len(todo)} runs")
        t0 = time.monotonic()
        pages = max(256, 2 * (2 * long + 512) // (64 * cp) + 64)  # the long conversation's pages, twice, per rank
        outs = run_jobs([(engine_config(c, num_layers, device, pages), trace) for c in todo], timeout_s=timeout_s)
        for c, res in zip(todo, outs):
            results[c] = (res, (time.monotonic() - t0) / len(todo))
    return _verify_all(cases, results, trace, num_layers, device, on_progress)


def _verify_all(cases, results, trace, num_layers: int, device: str, on_progress) -> list[dict[str, Any]]:
    """Verify each run, one reference model at a time (the runs of every cp that share it)."""
    from cpkv.engine.engine import verify_run
    from cpkv.model.model import load_model

    rows: dict[Case, dict[str, Any]] = {}
    key = lambda c: (c.model, c.seed, c.weights, c.precision)  # noqa: E731
    for k in dict.fromkeys(key(c) for c in cases):
        model = None
        for c in [c for c in cases if key(c) == k]:
            res, run_s = results[c]
            if model is None:
                model = load_model(c.model, seed=c.seed, device=device, num_layers=num_layers, precision=c.precision,
                                   weights=res.cfg.weights_dtype)
            t0 = time.monotonic()
            rep = verify_run(res, trace, model=model)
            rows[c] = _row(c, res, rep, run_s, time.monotonic() - t0)
            if on_progress:
                on_progress(f"verified {len(rows)} of {len(cases)}: {_brief(rows[c])}")
        del model
        if device == "cuda":
            import torch
            torch.cuda.empty_cache()
    return [rows[c] for c in cases]


def _row(c: Case, res, rep, run_s: float, verify_s: float) -> dict[str, Any]:
    d = rep.to_json()
    return {"model": c.model, "weights": c.weights, "precision": c.precision, "cp": c.cp, "seed": c.seed,
            "ok": rep.ok, "requests": rep.checked, "rejected": len(res.rejected),
            "max_logit_diff": rep.max_logit_diff, "tolerance": rep.tolerance, "tokens_equal": rep.tokens_equal,
            "ties": d["ties"], "numerics_floors": d["numerics_floors"], "decisions": d["decisions"],
            "failures": rep.failures,
            "graph_tokens": res.cfg.graph_tokens, "run_s": round(run_s, 2), "verify_s": round(verify_s, 2)}


def _brief(r: dict[str, Any]) -> str:
    """A row in one line (the progress log keeps every run's verdict, even if the command is ended early)."""
    d = r["decisions"]
    return (f"{r['model']} {r['weights']} weights {r['precision']} cp {r['cp']} seed {r['seed']}: "
            f"{'ok' if r['ok'] else 'FAILED'}, diff {r['max_logit_diff']:.3g} <= {r['tolerance']:.3g}, experts "
            f"{d['route']['differed']}/{d['route']['compared']} differ (margin {d['route']['max_margin']:.2g}, noise "
            f"{d['route']['score_noise']:.2g}, {d['route']['unexplained']} unexplained), "
            f"selections {d['index']['differed']}/{d['index']['compared']} ({d['index']['max_margin']:.2g}, "
            f"{d['index']['unexplained']} unexplained), "
            f"{len(r['ties'])} ties, {len(r['numerics_floors'])} past the tolerance within the numerics floor "
            f"(largest floor {max([f['floor'] for f in r['numerics_floors']], default=0):.3g}), run {r['run_s']} s, "
            f"verify {r['verify_s']} s")


def run(args: argparse.Namespace) -> int:
    from cpkv.cli.args import require_cuda
    from cpkv.cli.fmt import Progress, emit_json

    cases = cases_of(args)
    if args.device == "cuda":
        require_cuda(args.device, "cpkv check verify")
    for c in {(c.model, c.weights, c.precision, c.cp) for c in cases}:  # every option checked before any rank
        engine_config(Case(*c, 0), args.num_layers, args.device)
    bar = Progress(len(cases), "cpkv check verify")

    def progress(msg: str) -> None:
        bar.set(bar.done + msg.startswith("verified"), msg.split(":")[0])
        print(msg, file=sys.stderr, flush=True)

    try:
        rows = run_matrix(cases, num_layers=args.num_layers, requests=args.requests, device=args.device,
                          timeout_s=args.timeout, on_progress=progress, long=args.long)
    finally:
        bar.close()
    ok = all(r["ok"] for r in rows)
    if args.json:
        emit_json({"ok": ok, "device": args.device, "num_layers": args.num_layers, "requests": args.requests,
                   "long": args.long,
                   "runs": rows})
    else:
        show(rows)
    return 0 if ok else 1


def show(rows: list[dict[str, Any]]) -> None:
    from cpkv.cli.fmt import table

    def dec(r, kind):
        d = r["decisions"][kind]
        return f"{d['differed']}/{d['compared']} ({d['max_margin']:.2g})"

    table(("model", "weights", "precision", "cp", "seed", "verify", "max diff", "tolerance", "experts differ (margin)",
           "selections differ (margin)", "ties"),
          [(r["model"], r["weights"], r["precision"], r["cp"], r["seed"], "ok" if r["ok"] else "FAILED",
            r["max_logit_diff"], r["tolerance"], dec(r, "route"), dec(r, "index"), len(r["ties"])) for r in rows])
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} runs verified")
    for r in bad:
        for f in r["failures"][:3]:
            print(f"  {r['model']} {r['weights']} {r['precision']} cp {r['cp']} seed {r['seed']}: request "
                  f"{f['id']!r}: {f.get('why')}")
