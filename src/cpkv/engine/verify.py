"""Verification: every completed request rerun on one process (no CP, no cache) under the run's own discrete
decisions, and compared (docs/design.md §8, "Verification").

Non-finite logits (NaN or Inf) are a failed run, verified or not: ``check_finite(result, trace)`` raises
NonFiniteError naming the first such request and the first layer after which its hidden states stop being
finite. The layer is found by rerunning that one request on the single-process reference with a check after
each layer (``first_nonfinite``): the engine's forward pays nothing (no extra reduction, no host sync) for
the check; the rerun happens only when a run already failed. If the reference stays finite, the message says
that the non-finite values arose in the CP path itself. ``verify_run`` never passes a request whose logits
(the run's or the reference's) are not finite, and its ``max_logit_diff`` covers finite requests only.

Where the reference runs (``EngineConfig.reference``): ``parent``, a second model loaded by the parent process
after the ranks end; ``rank``, at cp 1 only, rank 0's own model after its run (``verify_on_rank``: one copy of the
weights, the reference sharing them; the engine's recorder tap set aside while it runs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from cpkv.engine.config import EngineConfig
from cpkv.engine.result import RequestResult, RunResult, merge
from cpkv.errors import NonFiniteError
from cpkv.scheduler.trace import TraceRequest, materialize_tokens

# |logit difference| allowed against the single-rank reference: atol + rtol * max |reference logit|.
# float32 on CPU leaves only fp8 rounding flips of near-tie values; bf16 on CUDA, more.
TOLERANCE = {"cpu": (1e-2, 1e-2), "cuda": (5e-2, 5e-2)}
UNMEASURED = "the reference rerun at other row counts equals itself bit for bit"


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
    lend_floors(report)
    for entry in report.requests:
        entry.pop("diff_only", None)
    report.ok = all(x["ok"] for x in report.requests)
    return report


def verify_on_rank(cfg: EngineConfig, trace: Sequence[TraceRequest], out, model, on_request=None) -> VerifyReport:
    """cp 1 (``cfg.reference == "rank"``): the run of ``out`` (rank 0's RankOutput, every request's logits) verified
    on the rank's own ``model``, the report ``verify_run`` makes in the parent. The model's tap (the run's
    recorder) is set aside meanwhile: the reference's decisions go through its ``Forced`` tap only.
    ``on_request(n, total)``: after each request (progress)."""
    kept = model.tap
    model.set_tap(None)
    result = merge(cfg, trace, [out])
    try:
        return verify_run(result, trace, model=model, on_request=None if on_request is None else
                          (lambda n: on_request(n, len(result.requests))))
    finally:
        model.set_tap(kept)


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
        note = {"id": r.id, "floor": round(floor, 6), "diff": round(diff, 6), "tolerance": round(tol, 6)}
        if floor > 0:
            tol += floor
        else:  # the reruns equal the reference bit for bit: the floor measured nothing (lend_floors)
            note.update(floor=None, unmeasured=UNMEASURED)
        entry["numerics_floor"] = note["floor"]
        report.floors.append(note)
    entry.update(diff=round(diff, 6), tolerance=round(tol, 6))
    if diff >= report.max_logit_diff:
        report.max_logit_diff, report.worst, report.tolerance = diff, r.id, tol
    why = list(unexplained)
    if diff > tol:
        unmeasured = entry.get("numerics_floor", 0) is None
        why.append(f"max |logit diff| {diff:.3g} > {tol:.3g}" + (f" (numerics floor unmeasured: {UNMEASURED})"
                                                                 if unmeasured else ""))
        if not unexplained:
            entry["diff_only"] = True  # a floor lent later may still pass it (lend_floors)
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
    if len(why) != 1:
        entry.pop("diff_only", None)


def lend_floors(report: VerifyReport) -> None:
    """A request whose floor measured nothing (its reruns at other row counts equal the reference bit for bit: a
    short prompt whose every row takes the dense path, batch-invariant on its own, where the run's batches mixed
    it with others) and which failed on its logit difference alone is judged again with the largest floor the
    run's other requests measured, lent and reported as such; with none measured it stays failed, saying so."""
    measured = [f["floor"] for f in report.floors if f["floor"]]
    if not measured:
        return
    lent = max(measured)
    for note in (f for f in report.floors if f["floor"] is None):
        entry = next(e for e in report.requests if e["id"] == note["id"])
        if not entry.pop("diff_only", False):
            continue
        tol = entry["tolerance"] + lent
        note["lent"] = entry["numerics_floor_lent"] = round(lent, 6)
        if entry["diff"] <= tol:
            entry.update(ok=True, tolerance=round(tol, 6))
            entry.pop("why")
            if report.worst == entry["id"]:
                report.tolerance = tol
