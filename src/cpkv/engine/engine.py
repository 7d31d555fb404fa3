"""Run the CP engine over a trace (rank processes or torchrun) and verify it against one rank.

    result = run_engine(cfg, trace)                  # RunResult; launches cfg.cp rank processes
    report = verify_run(result, trace)               # VerifyReport: single-process reference prefill, no CP, no cache
    results = run_jobs([(cfg, trace), (cfg, trace, measure)])  # several runs in one set of rank processes
                                                     # (measure: a MeasureConfig, what a benchmark or test asks)

A run's outcome per request: prompt and cached lengths, TTFT (time from its release into the queue to
the end of the batch that computed its last token; a conversation's next turn is released when the
previous one finishes), the first token (argmax of the last-token logits) and the logits themselves.

Non-finite logits (NaN or Inf) are a failed run, verified or not: ``check_finite(result, trace)`` raises
NonFiniteError naming the first such request and the first layer after which its hidden states stop being
finite. The layer is found by rerunning that one request on the single-process reference with a check after
each layer (``first_nonfinite``): the engine's forward pays nothing (no extra reduction, no host sync) for
the check; the rerun happens only when a run already failed. If the reference stays finite, the message says
that the non-finite values arose in the CP path itself. ``verify_run`` never passes a request whose logits
(the run's or the reference's) are not finite, and its ``max_logit_diff`` covers finite requests only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from cpkv.engine.config import EngineConfig
from cpkv.errors import ConfigError, NonFiniteError
from cpkv.engine.rank import Job, RankOutput, job_parts, rank_main
from cpkv.scheduler.trace import TraceRequest, materialize_tokens

# |logit difference| allowed against the single-rank reference: atol + rtol * max |reference logit|.
# float32 on CPU leaves only fp8 rounding flips of near-tie values; bf16 on CUDA, more.
TOLERANCE = {"cpu": (1e-2, 1e-2), "cuda": (5e-2, 5e-2)}


@dataclass
class RequestResult:
    id: Hashable
    prompt_len: int
    cached_len: int
    ttft_s: float
    first_token: int
    logits: torch.Tensor = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "prompt_len": self.prompt_len, "cached_len": self.cached_len,
                "ttft_s": round(self.ttft_s, 6), "first_token": self.first_token}

    @property
    def finite(self) -> bool:
        return bool(torch.isfinite(self.logits).all())


@dataclass
class RunResult:
    """Merged outcome of one run over every rank."""

    cfg: EngineConfig
    requests: list[RequestResult]
    rejected: list[dict[str, Any]]
    wall_s: float
    pages_used: list[int]
    stats: dict[str, Any]
    decisions: list = field(default_factory=list)  # cfg.record: every rank's BatchDecisions (cpkv.engine.taps)

    @property
    def summary(self) -> dict[str, Any]:
        prompt = sum(r.prompt_len for r in self.requests)
        cached = sum(r.cached_len for r in self.requests)
        return {
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round((prompt - cached) / self.wall_s, 1) if self.wall_s else 0.0,
            "prompt_tokens": prompt,
            "cache_hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
            "kv_pages_per_rank": self.pages_used,
            "kv_pages_replicated": sum(self.pages_used),
            "pages_spilled": self.stats.get("spilled", 0),
            "pages_reloaded": self.stats.get("reloaded", 0),
            "batches": self.stats.get("batches", 0),
            "rejected": len(self.rejected),
            "mode": self.stats.get("mode"),
            "weights_dtype": self.stats.get("weights_dtype"),
            "attention_calls": self.stats.get("attention"),
        }


def merge(cfg: EngineConfig, trace: Sequence[TraceRequest], outs: Sequence[RankOutput]) -> RunResult:
    """Per-rank outputs of one run -> RunResult in trace order (TTFT and wall time from rank 0's clock)."""
    logits: dict[Hashable, torch.Tensor] = {}
    for o in outs:
        logits.update({k: torch.from_numpy(v) for k, v in o.logits.items()})
    zero = outs[0]
    reqs = []
    for r in trace:
        if r.id in zero.done_s and r.id in logits:
            lg = logits[r.id]
            reqs.append(RequestResult(r.id, r.prompt_len, zero.cached[r.id], zero.done_s[r.id], int(lg.argmax()), lg))
    rejected = [{"id": r.id, "prompt_len": r.prompt_len, "reason": zero.rejected[r.id]}
                for r in trace if r.id in zero.rejected]
    stats = dict(zero.stats)
    stats["attention"] = {k: sum(o.stats["attention"][k] for o in outs) for k in ("dense", "sparse")}
    stats["experts_per_rank"] = [o.stats.get("experts", 0) for o in outs]  # routed experts each rank holds
    stats["gpu_memory_per_rank"] = [o.stats.get("gpu_memory") for o in outs]  # CUDA: setup and peak bytes
    stats["graphs_per_rank"] = [o.stats.get("graphs") for o in outs]  # graph_tokens: each rank's graph counts
    decisions = [d for o in outs for d in o.decisions]
    return RunResult(cfg, reqs, rejected, zero.wall_s, zero.pages_used, stats, decisions)


def run_jobs(jobs: Sequence[Job], *, timeout_s: float = 600.0, grace_s: float = 2.0,
             on_progress=None) -> list[RunResult]:
    """Run several jobs (same cp and device) in one set of rank processes, one after the other. A job is
    (EngineConfig, trace) or (EngineConfig, trace, MeasureConfig | None) (``cpkv.engine.rank.Job``).
    ``on_progress(requests_done, batches)`` follows rank 0 through the current job."""
    from cpkv.dist import launch

    jobs = [job_parts(j) for j in jobs]
    if any(m is not None and m.plant and c.graph_tokens for c, _, m in jobs):
        raise ConfigError("a planted fault runs eagerly: graph_tokens must be 0")
    cp, device = jobs[0][0].cp, jobs[0][0].device
    if any(c.cp != cp or c.device != device for c, _, _ in jobs):
        raise ValueError("run_jobs: every job must use the same cp and device")
    report = (lambda rank, msg: on_progress(*msg)) if on_progress else None
    per_rank = launch(rank_main, cp, device=device, args=(list(jobs),), timeout_s=timeout_s, grace_s=grace_s,
                      on_progress=report)
    return [merge(cfg, trace, [per_rank[r][i] for r in range(cp)]) for i, (cfg, trace, _) in enumerate(jobs)]


def run_engine(cfg: EngineConfig, trace: Sequence[TraceRequest], *, timeout_s: float = 600.0,
               on_progress=None) -> RunResult:
    return run_jobs([(cfg, trace)], timeout_s=timeout_s, on_progress=on_progress)[0]


def run_under_torchrun(cfg: EngineConfig, trace: Sequence[TraceRequest]) -> RunResult | None:
    """This process is one rank of a torchrun group (cp = WORLD_SIZE): rank 0 gets the merged result."""
    from cpkv.dist import context_from_env

    ctx = context_from_env(cfg.device)
    outs = rank_main(ctx, [(cfg, trace)])
    every = ctx.all_gather_object(outs[0])
    ctx.barrier()
    return merge(cfg, trace, every) if ctx.rank == 0 else None


# -- verification ----------------------------------------------------------------------------------
@dataclass
class VerifyReport:
    ok: bool
    tokens_equal: bool
    max_logit_diff: float  # over the requests whose logits are finite on both sides
    tolerance: float
    worst: Hashable | None
    checked: int
    # requests with NaN/Inf logits: {"id", "run" / "reference": what is non-finite (None: finite), "where": the
    # reference's first non-finite layer (None: the reference stays finite)}
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    # the run's discrete decisions against the reference's own (cpkv.engine.taps): {"route" | "index":
    # DecisionCount}; empty when the run recorded none (the reference then took its own)
    decisions: dict[str, Any] = field(default_factory=dict)
    decision_tolerance: dict[str, float] = field(default_factory=dict)
    ties: list[dict[str, Any]] = field(default_factory=list)  # first tokens that differ within the tolerance
    floors: list[dict[str, Any]] = field(default_factory=list)  # requests checked against tolerance + numerics floor
    requests: list[dict[str, Any]] = field(default_factory=list)  # per request: diff, tolerance, verdict, why

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The requests that failed, each with its reason."""
        return [r for r in self.requests if not r["ok"]]

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "tokens_equal": self.tokens_equal, "max_logit_diff": self.max_logit_diff,
                "tolerance": self.tolerance, "worst_request": self.worst, "checked": self.checked,
                "nonfinite": self.nonfinite, "ties": self.ties, "numerics_floors": self.floors,
                "decisions": {k: c.to_json(self.decision_tolerance[k]) for k, c in self.decisions.items()},
                "requests": self.requests}


def describe_nonfinite(logits: torch.Tensor) -> str:
    """'3 NaN and 1 Inf of 512 logits' for a float [vocab] tensor."""
    nan, inf = int(torch.isnan(logits).sum()), int(torch.isinf(logits).sum())
    parts = [f"{n} {k}" for n, k in ((nan, "NaN"), (inf, "Inf")) if n]
    return f"{' and '.join(parts)} of {logits.numel()} logits"


class FirstNonFinite:
    """An ``after_layer`` callback for ``reference_prefill``: the first layer (-1: the embeddings) whose hidden
    states hold a NaN or an Inf (a host check per layer: reference path only, never the engine's forward)."""

    def __init__(self) -> None:
        self.layer: int | None = None

    def __call__(self, n: int, h: torch.Tensor) -> None:
        if self.layer is None and not bool(torch.isfinite(h).all()):
            self.layer = n

    def where(self, logits: torch.Tensor, num_layers: int) -> str | None:
        """Where the reference's values first went non-finite; None when its logits are finite too."""
        if self.layer is not None:
            return "in the embeddings" if self.layer < 0 else f"after layer {self.layer} (of {num_layers})"
        if not bool(torch.isfinite(logits).all()):
            return "in the final norm / LM head (every layer's hidden states finite)"
        return None


def first_nonfinite(model, tokens: Sequence[int]) -> str | None:
    """Rerun one request on the single-process reference: where its values first stop being finite (None:
    nowhere, its logits are finite)."""
    probe = FirstNonFinite()
    logits = model.reference_prefill(tokens, after_layer=probe)
    return probe.where(logits, len(model.layers))


def nonfinite_failure(result: RunResult, trace: Sequence[TraceRequest], report: VerifyReport | None = None,
                      model=None) -> NonFiniteError | None:
    """The error of a run with NaN/Inf logits, None when every request's logits are finite. With a verify
    ``report`` its findings are used; without, the first bad request is rerun on the single-process reference
    (``model``, loaded here if None) to name the layer."""
    if report is not None:
        entries = report.nonfinite
    else:
        bad = [r for r in result.requests if not r.finite]
        if not bad:
            return None
        model = model or _reference_model(result.cfg)
        tokens = materialize_tokens(trace, vocab_size=model.cfg.vocab_size)
        entries = [{"id": bad[0].id, "run": describe_nonfinite(bad[0].logits), "reference": None,
                    "where": first_nonfinite(model, tokens[bad[0].id])}]
        entries += [{"id": r.id} for r in bad[1:]]
    if not entries:
        return None
    e = entries[0]
    what = e["run"] if e["run"] else f"finite logits, but the single-process reference has {e['reference']}"
    located = (f"first non-finite hidden state {e['where']}, found by rerunning it on the single-process reference"
               if e["where"] else "its single-process rerun stays finite: the CP path produced them")
    return NonFiniteError(f"request {e['id']!r}: {what} ({located}); {len(entries)} of {len(result.requests)} "
                          "requests have non-finite logits")


def check_finite(result: RunResult, trace: Sequence[TraceRequest], model=None) -> None:
    """NonFiniteError unless every request's logits are finite (``nonfinite_failure``)."""
    err = nonfinite_failure(result, trace, model=model)
    if err is not None:
        raise err


def _reference_model(cfg: EngineConfig):
    from cpkv.model.model import load_model

    device = "cuda" if cfg.device == "cuda" else "cpu"
    return load_model(cfg.model, seed=cfg.seed, device=device, num_layers=cfg.num_layers, precision=cfg.precision,
                      weights=cfg.weights_dtype, routed_experts=cfg.experts)


def write_logits(path: str, result: RunResult) -> None:
    """Each finished request's last-token logits, float32 [vocab], into a safetensors file keyed by request id
    (``str(id)``: ids that become one key, ``1`` and ``"1"``, are a ConfigError naming both; written under the
    output policy of ``cpkv.files``: beside ``path``, renamed onto it, no partial output)."""
    from safetensors.torch import save_file

    from cpkv.files import atomic_path, string_keys

    keys = string_keys([r.id for r in result.requests], f"logits file {path!r}")
    tensors = {k: r.logits.float().contiguous() for k, r in zip(keys, result.requests)}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={"model": str(result.cfg.model), "precision": result.cfg.precision})


def verify_run(result: RunResult, trace: Sequence[TraceRequest], model=None, on_request=None) -> VerifyReport:
    """Rerun every completed request on one process (no CP, no cache) under the run's own discrete decisions,
    and compare (docs/design.md, "Verification").

    When the run recorded its decisions (``EngineConfig.record``), the reference makes its own, counts those that
    differ with their margins (``cpkv.engine.taps.Forced``) and then takes the run's, so that the logits compare
    numerics alone. A request passes when: its logits are finite on both sides; every |logit difference| <= atol
    + rtol * max |reference logit|; every differing decision's margin is within what rounding explains; its first
    token is the reference's, or (a tie) the reference's logit of it lies within the tolerance of its largest.
    A request with NaN/Inf logits is listed in ``nonfinite`` with the first layer where its reference values went
    non-finite; it takes no part in ``max_logit_diff`` (a NaN would compare as "no difference").
    ``on_request(n)`` is called after the n-th request is compared (progress).
    """
    from cpkv.engine.decisions import DecisionLog
    from cpkv.engine.taps import INDEX_MARGIN, ROUTE_MARGIN, DecisionCount, Forced

    cfg = result.cfg
    device = "cuda" if cfg.device == "cuda" else "cpu"
    model = model or _reference_model(cfg)
    tokens = materialize_tokens(trace, vocab_size=model.cfg.vocab_size)
    log = DecisionLog.build(result.decisions, {r.id: tokens[r.id] for r in result.requests}) \
        if result.decisions else None
    atol, rtol = TOLERANCE[device]
    report = VerifyReport(True, True, 0.0, atol, None, len(result.requests))
    if log is not None:
        report.decisions = {"route": DecisionCount(), "index": DecisionCount()}
        report.decision_tolerance = {"route": ROUTE_MARGIN[device], "index": INDEX_MARGIN[device]}
    for n, r in enumerate(result.requests, start=1):
        def reference(cuts=(), rid=r.id):  # the request's reference under the run's decisions (chunked: ``cuts``)
            tap = Forced(*log.for_request(rid), device) if log is not None else None
            return model.reference_prefill(tokens[rid], tap=tap, cuts=cuts).cpu(), tap

        ref, forced = reference()
        _check_request(report, r, ref, forced, model, tokens[r.id], atol, rtol, reference)
        if on_request is not None:
            on_request(n)
    report.ok = all(x["ok"] for x in report.requests)
    return report


def numerics_floor(ref: torch.Tensor, reference, n: int) -> float:
    """How far the reference lands from itself when the same prompt runs at other row counts (cut in two, and
    at a third: each GEMM then sees other shapes, so other kernels and summation orders), under the same
    decisions: max |logit difference| -> the rounding a run's batches can show on their own."""
    return max(float((reference(cuts=cut)[0] - ref).abs().max()) for cut in ((n // 2,), (n // 3, 2 * n // 3)))


def _check_request(report: VerifyReport, r: RequestResult, ref: torch.Tensor, forced, model, tokens, atol: float,
                   rtol: float, reference=None) -> None:
    """Compare one request's logits with its reference's ``ref``; its entry into ``report`` (module docstring).
    ``reference(cuts)``: the reference again, as chunks: a request whose logits miss the tolerance gets it added
    the numerics floor, how far the reference at other row counts lands from itself (``numerics_floor``)."""
    entry: dict[str, Any] = {"id": r.id, "ok": True}
    report.requests.append(entry)
    unexplained = []
    if forced is not None:
        for kind, count in forced.summary().items():
            report.decisions[kind].merge(count)
            entry[f"{kind}_differed"] = count.differed
            if count.unexplained:
                unexplained.append(f"{count.unexplained} {kind} decision(s) differ beyond rounding (margin "
                                   f"{count.worst[0][2]:.3g} > {count.worst[0][3]:.3g} allowed"
                                   f", layer {count.worst[0][0]}, position {count.worst[0][1]})")
    ref_finite = bool(torch.isfinite(ref).all())
    if not (ref_finite and r.finite):  # rerun once, checking each layer, to say where it went non-finite
        report.nonfinite.append({"id": r.id, "run": None if r.finite else describe_nonfinite(r.logits),
                                 "reference": None if ref_finite else describe_nonfinite(ref),
                                 "where": first_nonfinite(model, tokens)})
        report.tokens_equal = False
        entry.update(ok=False, why="non-finite logits")
        return
    diff = float((ref - r.logits).abs().max())
    tol = atol + rtol * float(ref.abs().max())
    gap = float(ref.max() - ref[r.first_token])
    if max(diff, gap) > tol and reference is not None and len(tokens) > 1:
        floor = numerics_floor(ref, reference, len(tokens))
        entry["numerics_floor"] = round(floor, 6)
        report.floors.append({"id": r.id, "floor": round(floor, 6), "diff": round(diff, 6),
                              "tolerance": round(tol, 6)})
        tol += floor
    entry.update(diff=round(diff, 6), tolerance=round(tol, 6))
    if diff >= report.max_logit_diff:
        report.max_logit_diff, report.worst, report.tolerance = diff, r.id, tol
    why = list(unexplained)
    if diff > tol:
        why.append(f"max |logit diff| {diff:.3g} > {tol:.3g}")
    if int(ref.argmax()) != r.first_token:
        report.tokens_equal = False
        if gap <= tol:
            report.ties.append({"id": r.id, "run": r.first_token, "reference": int(ref.argmax()),
                                "gap": round(gap, 6)})
            entry["first_token"] = "tie"
        else:
            why.append(f"first token {r.first_token} where the reference's is {int(ref.argmax())}, {gap:.3g} "
                       f"above it (> {tol:.3g})")
    if why:
        entry.update(ok=False, why="; ".join(why))
