"""Verification that tells numerics from decisions (cpkv.engine.taps, cpkv.engine.decisions, engine.verify_run):
the run's decisions recorded and assembled per request, the reference forced onto them, margins, ties, the numerics
floor, and planted faults that must fail on real rank processes."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from cpkv.cli.traces import default_trace
from cpkv.config import preset
from cpkv.engine.config import EngineConfig
from cpkv.engine.decisions import DecisionLog
from cpkv.engine.engine import RequestResult, VerifyReport, _check_request, run_jobs, verify_run
from cpkv.engine.instruments import MeasureConfig
from cpkv.errors import ConfigError
from cpkv.engine.taps import BatchDecisions, Forced, route_margin
from cpkv.model.model import load_model
from cpkv.model.moe import pick_experts, route_scores

BASE = EngineConfig(page_size=16, pages_per_rank=128, chunk_size=256, max_requests=4, record=True)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [1, 2])
def test_planted_faults_fail_and_the_clean_run_passes(cp):
    """One expert's weight dropped for one token, one MoE output row zeroed, one indexer selection replaced by the
    query's worst key, one KV page of one rank stale: each run fails verification; the same run without a fault
    passes with every decision compared and none differing beyond rounding."""
    trace = default_trace(6)
    clean = dataclasses.replace(BASE, cp=cp)
    plants = ["expert", "combine", "index", "page"]
    results = run_jobs([(clean, trace)] + [(clean, trace, MeasureConfig(plant=p)) for p in plants], timeout_s=600)
    ok = verify_run(results[0], trace)
    assert ok.ok and ok.decisions["route"].compared > 0 and ok.decisions["index"].compared > 0, ok.failures
    assert ok.decisions["route"].unforced == ok.decisions["index"].unforced == 0
    for plant, res in zip(plants, results[1:]):
        rep = verify_run(res, trace)
        assert not rep.ok and rep.failures, plant
        if plant == "index":  # the logits may stay close: the margin tells
            assert rep.decisions["index"].unexplained >= 1 and "index decision" in rep.failures[0]["why"]
        else:
            assert rep.max_logit_diff > rep.tolerance, plant


def test_a_planted_fault_needs_an_eager_run():
    """Both refused before any rank starts."""
    with pytest.raises(ConfigError, match="graph_tokens must be 0"):
        run_jobs([(dataclasses.replace(BASE, graph_tokens=64), default_trace(2), MeasureConfig(plant="page"))])
    with pytest.raises(ConfigError, match="unknown planted fault"):
        MeasureConfig(plant="nope")


def _batch(batch: int, runs, route: dict, values: dict | None = None) -> BatchDecisions:
    return BatchDecisions(batch, tuple(runs), route, {}, values or {n: a.astype(np.float32) for n, a in route.items()})


def test_a_cached_prefix_takes_the_decisions_of_the_request_that_computed_it():
    """B hits A's first 8 tokens: its positions 0..7 come from A (batch 0); C computed the same prefix later (batch
    3, after B's first batch), so it is not B's source; B's own positions are its own."""
    toks = {"A": list(range(10)), "B": list(range(8)) + [50, 51, 52, 53], "C": list(range(9))}
    a = np.arange(20, dtype=np.int16).reshape(10, 2)
    c = np.full((9, 2), 99, np.int16)
    b = np.full((4, 2), 7, np.int16)
    log = DecisionLog.build([_batch(0, [("A", 0, 10, 0)], {3: a}), _batch(3, [("C", 0, 9, 0)], {3: c}),
                             _batch(2, [("B", 8, 12, 16)], {3: b})], toks)
    route, select = log.for_request("B")
    ids, values = route[3]
    assert ids.tolist() == a[:8].tolist() + b.tolist() and values.dtype == np.float32 and select == {}
    ids_c, _ = log.for_request("C")[0][3]  # C computed everything itself
    assert ids_c.tolist() == c.tolist()


def test_a_position_nobody_recorded_stays_unknown():
    toks = {"A": [1, 2, 3, 4], "B": [1, 2, 9, 9]}
    log = DecisionLog.build([_batch(0, [("B", 2, 4, 0)], {1: np.ones((2, 2), np.int16)})], toks)
    ids, _ = log.for_request("B")[0][1]
    assert ids.tolist() == [[-1, -1], [-1, -1], [1, 1], [1, 1]]


def test_route_margin_with_and_without_groups():
    cfg = dataclasses.replace(preset("tiny"), n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)
    choice = torch.tensor([0.9, 0.8, 0.79, 0.1, 0.2, 0.3, 0.05, 0.0])
    own = torch.tensor([0, 1])
    assert route_margin(choice, own, torch.tensor([0, 2]), cfg) == pytest.approx(0.01, abs=1e-6)  # a near tie
    assert route_margin(choice, own, torch.tensor([0, 7]), cfg) == pytest.approx(0.8)  # the worst expert
    assert route_margin(choice, own, own, cfg) == 0.0
    grouped = dataclasses.replace(cfg, n_group=4, topk_group=1)  # groups {0,1} {2,3} {4,5} {6,7}: 1.7 .89 .5 .05
    # the run kept group 1 instead of group 0: the groups' scores differ by 0.81, halved against the choice noise
    assert route_margin(choice, own, torch.tensor([2, 3]), grouped) == pytest.approx(0.405, abs=1e-6)


def _gap_one(values, mine, theirs) -> float:
    if not bool(mine.any()) or not bool(theirs.any()):
        return 0.0
    return max(0.0, float(values[mine].max() - values[theirs].min()))


def _route_margin_one(choice, own, run, cfg) -> float:
    """route_margin row by row, as it was written before the batched form (the test's reference)."""
    from cpkv.model.moe import group_scores, kept_groups

    margins, e_per = [], cfg.n_routed_experts // cfg.n_group
    keep = torch.ones_like(choice, dtype=torch.bool)
    if cfg.topk_group < cfg.n_group:
        gs, mine = group_scores(choice[None], cfg)[0], kept_groups(choice[None], cfg)[0]
        theirs = torch.zeros_like(mine).scatter_(0, run // e_per, True)
        if not torch.equal(mine, theirs):
            margins.append(_gap_one(gs, mine & ~theirs, theirs & ~mine) / 2)
        keep = (mine & theirs).repeat_interleave(e_per)
    o = torch.zeros_like(keep).scatter_(0, own, True)
    r = torch.zeros_like(keep).scatter_(0, run, True)
    margins.append(_gap_one(choice, o & ~r & keep, r & ~o & keep))
    return max(margins)


def _index_margin_one(scores, own, run) -> float:
    o = torch.zeros(scores.shape[0], dtype=torch.bool)
    r = torch.zeros_like(o)
    o[own[own >= 0].long()] = True
    r[run[run >= 0].long()] = True
    seen = torch.isfinite(scores)
    scale = float(scores[seen].abs().max()) if bool(seen.any()) else 1.0
    gap = float("inf") if bool((r & ~seen).any()) else _gap_one(scores, o & ~r, r & ~o)
    return gap / (scale or 1.0)


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_route_margins_batched_equal_the_row_by_row_margins(groups):
    """The batched margins the reference computes for every differing token at once are, token by token, exactly
    the row-by-row formula's: random scores with planted near ties, runs that differ by one expert, by a group,
    or not at all."""
    from cpkv.engine.taps import route_margins

    cfg = dataclasses.replace(preset("tiny"), n_routed_experts=16, num_experts_per_tok=4, n_group=groups[0],
                              topk_group=groups[1])
    g = torch.Generator().manual_seed(3)
    n = 64
    choice = torch.rand(n, 16, generator=g)
    choice[::5, 1] = choice[::5, 2]  # exact ties
    own = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(n)])
    run = own.clone()
    run[1::3, 0] = (own[1::3, 0] + 1) % 16  # one expert swapped (maybe onto another of own: a repeat)
    run[2::3] = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(len(run[2::3]))])
    got = route_margins(choice, own, run, cfg).tolist()
    want = [_route_margin_one(choice[t], own[t], run[t], cfg) for t in range(n)]
    assert got == want
    assert any(w > 0 for w in want) and any(w == 0 for w in want)


def test_index_margins_batched_equal_the_row_by_row_margins():
    """As above for the indexer: -1 entries, keys a query cannot see (-inf: a run that picked one is inf),
    a query that sees nothing, selections that differ in one key or in many."""
    from cpkv.engine.taps import index_margins

    g = torch.Generator().manual_seed(5)
    n, S, k = 48, 40, 8
    scores = torch.randn(n, S, generator=g)
    ctx = torch.randint(0, S + 1, (n,), generator=g)
    ctx[0], ctx[1] = 0, S
    scores = scores.masked_fill(torch.arange(S)[None] >= ctx[:, None], float("-inf"))
    own = torch.full((n, k), -1, dtype=torch.int32)
    run = own.clone()
    for t in range(n):
        m = min(k, int(ctx[t]))
        own[t, :m] = torch.randperm(max(1, int(ctx[t])), generator=g)[:m].int()
        run[t] = own[t]
        if t % 3 == 1 and m:
            run[t, 0] = (own[t, 0] + 1) % S  # may land past the context: inf
        elif t % 3 == 2 and m:
            run[t, :m] = torch.randperm(max(1, int(ctx[t])), generator=g)[:m].int()
    got = index_margins(scores, own, run).tolist()
    want = [_index_margin_one(scores[t], own[t], run[t]) for t in range(n)]
    assert got == want
    assert any(w == float("inf") for w in want) and any(0 < w < float("inf") for w in want)


class _Own:
    """A tap that decides as the layer would and keeps what it decided (the reference's own decisions)."""

    def __init__(self) -> None:
        self.route: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def route_fn(self, layer, x):
        scores, choice = route_scores(x, layer.w["mlp.gate.weight"], layer.w["mlp.gate.e_score_correction_bias"],
                                      fused=not layer.exact)
        idx = pick_experts(choice, layer.cfg)
        self.route[layer.n] = (idx.numpy().copy(), choice.gather(1, idx).numpy().copy())
        from cpkv.model.moe import route_weights
        return idx, route_weights(scores, idx, layer.cfg)


def _own_decisions(model, tokens):
    own = _Own()

    class Tap:
        route = staticmethod(own.route_fn)

        @staticmethod
        def select(layer, p, dense, plan, topk):
            return topk

        @staticmethod
        def moe_out(layer, y):
            return y

    logits = model.reference_prefill(tokens, tap=Tap())
    return logits, own.route


def test_the_reference_takes_the_runs_experts_and_counts_the_margin():
    """Forced onto its own decisions the reference gives its own logits and counts no difference; with one token's
    weakest expert swapped for one it left out, it takes the swap (other logits) and counts that decision as the
    one differing beyond rounding (no score moved in its layer: nothing explains it; the later layer's own choices
    then differ too, explained by the scores the swap moved)."""
    model = load_model("tiny", num_layers=3)
    tokens = default_trace(1)[0]
    from cpkv.scheduler.trace import materialize_tokens
    toks = materialize_tokens([tokens], vocab_size=model.cfg.vocab_size)[tokens.id]
    base, route = _own_decisions(model, toks)
    n = next(iter(route))
    same = Forced({k: v for k, v in route.items()}, {}, "cpu")
    assert torch.equal(model.reference_prefill(toks, tap=same), base)
    assert same.counts["route"].compared == len(toks) * len(route) and same.counts["route"].differed == 0
    ids, values = (a.copy() for a in route[n])
    t = len(toks) - 1  # the token whose logits are compared
    weakest = int(np.argmin(values[t]))
    left_out = [e for e in range(model.cfg.n_routed_experts) if e not in ids[t]]
    ids[t, weakest] = left_out[0]
    values[t, weakest] = np.nan  # replaced below by the reference's own value (no noise)
    forced = Forced({**route, n: (ids, values)}, {}, "cpu")
    out = model.reference_prefill(toks, tap=forced)
    c = forced.counts["route"]
    assert c.unexplained == 1 and c.worst[0][:2] == (n, t) and c.worst[0][2] > c.worst[0][3]
    assert not torch.equal(out, base)


def _result(first: int, logits) -> RequestResult:
    return RequestResult("r", 10, 0, 0.1, first, torch.tensor(logits, dtype=torch.float32))


def _check(run_first: int, run_logits, ref_logits, reference=None) -> VerifyReport:
    rep = VerifyReport(True, True, 0.0, 0.0, None, 1)
    _check_request(rep, _result(run_first, run_logits), torch.tensor(ref_logits, dtype=torch.float32), None, None,
                   list(range(10)), 0.05, 0.05, reference)
    rep.ok = all(x["ok"] for x in rep.requests)
    return rep


def test_a_differing_first_token_passes_only_as_a_tie():
    tie = _check(1, [1.0, 0.99, 0.0], [1.0, 0.98, 0.0])  # the reference's top two 0.02 apart, tolerance 0.1
    assert tie.ok and not tie.tokens_equal and tie.ties == [{"id": "r", "run": 1, "reference": 0, "gap": 0.02}]
    apart = _check(1, [1.0, 0.99, 0.0], [1.0, 0.5, 0.0])
    assert not apart.ok and "first token 1 where the reference's is 0" in apart.failures[0]["why"]


def test_the_numerics_floor_is_measured_only_past_the_tolerance_and_added_to_it():
    """Past the tolerance the reference reruns as chunks: its own spread (the floor) joins the tolerance; a floor
    of 0 leaves the request failed, one as large as the difference passes it (and is reported)."""
    ref = [2.0, 1.0, 0.0]
    run = [2.0, 1.0, 0.3]  # diff 0.3 > 0.05 + 0.05 * 2 = 0.15
    calls = []

    def spread(delta):
        def reference(cuts=()):
            calls.append(cuts)
            return torch.tensor(ref, dtype=torch.float32) + torch.tensor([0.0, 0.0, delta]), None
        return reference

    assert not _check(0, run, ref, spread(0.0)).ok and calls == [(5,), (3, 6)]
    passed = _check(0, run, ref, spread(0.2))
    assert passed.ok and passed.floors == [{"id": "r", "floor": pytest.approx(0.2), "diff": pytest.approx(0.3),
                                            "tolerance": pytest.approx(0.15)}]
    calls.clear()
    assert _check(0, ref, ref, spread(0.2)).ok and calls == []  # within the tolerance: no rerun


def test_a_chunked_reference_computes_the_same_function():
    """The reference as chunks (each over the KV rows of those before) equals the whole prompt's within float32
    rounding on the CPU, under the same decisions."""
    model = load_model("tiny", num_layers=3)
    from cpkv.scheduler.trace import materialize_tokens
    req = default_trace(1)[0]
    toks = materialize_tokens([req], vocab_size=model.cfg.vocab_size)[req.id]
    whole, route = _own_decisions(model, toks)
    chunked = model.reference_prefill(toks, tap=Forced(route, {}, "cpu"), cuts=(len(toks) // 3, len(toks) // 2))
    assert (chunked - whole).abs().max() <= 1e-3 * whole.abs().max()


@pytest.mark.slow
def test_check_verify_reports_every_run_as_json():
    out = subprocess.run([sys.executable, "-m", "cpkv", "check", "verify", "--cp", "1,2", "--num-layers", "2",
                          "--requests", "2", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["ok"] and [r["cp"] for r in report["runs"]] == [1, 2]
    for r in report["runs"]:
        assert r["decisions"]["route"]["compared"] > 0 and r["decisions"]["route"]["unexplained"] == 0
    assert "verified 2 of 2" in out.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--weights", "foo"], "unknown --weights / --precision value(s) foo"),
    (["--precision", "fp16"], "unknown --weights / --precision value(s) fp16"),
    (["--cp", "0"], "argument --cp: expected comma-separated integers in 1..64"),
    (["--seeds", "-1"], "argument --seeds"),
    (["--models", ","], "--models ',': expected one or more comma-separated names"),
    (["--models", "nope"], "'nope': expected a preset"),
    (["--models", "glm5", "--cp", "3"], "cp 3 must divide the model's 256 routed experts"),
])
def test_check_verify_refuses_bad_options_in_one_line_before_any_rank(argv, needle, capsys):
    from cpkv.cli import main

    try:
        code = main(["check", "verify", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def _request(rid: str, logits) -> RequestResult:
    return RequestResult(rid, 10, 0, 0.1, 0, torch.tensor(logits, dtype=torch.float32))


def test_a_floor_that_measures_nothing_is_not_a_zero_floor():
    """A request whose chunked reruns equal its reference bit for bit (s1.t0 on the H200: floor 0.0) has its floor
    reported unmeasured; failing on its logit difference alone, it borrows the largest floor the run's other
    requests measured (reported as lent) and fails, saying why, when none measured one."""
    from cpkv.engine.verify import UNMEASURED, lend_floors

    ref = [2.0, 1.0, 0.0]
    rep = VerifyReport(True, True, 0.0, 0.0, None, 2)
    exact = lambda cuts=(): (torch.tensor(ref), None)  # noqa: E731  (bit-identical reruns)
    spread = lambda cuts=(): (torch.tensor(ref) + torch.tensor([0.0, 0.0, 0.25]), None)  # noqa: E731
    _check_request(rep, _request("short", [2.0, 1.0, 0.3]), torch.tensor(ref), None, None, list(range(10)), 0.05,
                   0.05, exact)
    assert rep.floors[0]["floor"] is None and rep.floors[0]["unmeasured"] == UNMEASURED
    assert "numerics floor unmeasured" in rep.requests[0]["why"]
    alone = VerifyReport(True, True, 0.0, 0.0, None, 1, floors=[dict(rep.floors[0])],
                         requests=[dict(rep.requests[0])])
    lend_floors(alone)
    assert not alone.requests[0]["ok"]  # nothing measured to lend
    _check_request(rep, _request("long", [2.0, 1.0, 0.35]), torch.tensor(ref), None, None, list(range(10)), 0.05,
                   0.05, spread)
    assert rep.requests[1]["ok"] and rep.floors[1]["floor"] == pytest.approx(0.25)
    lend_floors(rep)
    short = rep.requests[0]
    assert short["ok"] and short["numerics_floor_lent"] == pytest.approx(0.25) and "why" not in short
    assert short["tolerance"] == pytest.approx(0.15 + 0.25) and rep.floors[0]["lent"] == pytest.approx(0.25)


def test_a_lent_floor_never_passes_a_differing_first_token():
    from cpkv.engine.verify import lend_floors

    ref = [2.0, 1.0, 0.0]
    rep = VerifyReport(True, True, 0.0, 0.0, None, 2)
    exact = lambda cuts=(): (torch.tensor(ref), None)  # noqa: E731
    wrong = RequestResult("short", 10, 0, 0.1, 1, torch.tensor([1.5, 2.2, 0.0]))  # its token 1.0 below the top
    _check_request(rep, wrong, torch.tensor(ref), None, None, list(range(10)), 0.05, 0.05, exact)
    rep.floors.append({"id": "other", "floor": 5.0})
    lend_floors(rep)
    assert not rep.requests[0]["ok"] and "numerics_floor_lent" not in rep.requests[0]
