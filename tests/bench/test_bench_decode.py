"""``cpkv bench decode`` on the CPU (tiny model): every case timed, its floor counted from the step it ran."""
from __future__ import annotations

import json

import pytest

from cpkv.cli import main

pytestmark = pytest.mark.slow


def test_cases_report_step_time_floor_and_ratio(capsys):
    rc = main(["bench", "decode", "--device", "cpu", "--cp", "2", "--page-size", "16", "--keys", "48,100",
               "--batches", "1,3", "--steps", "2", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    cases = rep["cases"]
    assert [(c["keys"], c["batch"]) for c in cases] == [(48, 1), (48, 3), (100, 1), (100, 3)]
    for c in cases:
        assert c["step_ms"] > 0 and c["floor_bytes"] > 0
        assert c["ratio_to_floor"] == pytest.approx(c["step_ms"] / c["floor_ms"], rel=1e-6)
    # the floor grows with the generations and the context a step reads
    by = {(c["keys"], c["batch"]): c["floor_bytes"] for c in cases}
    assert by[(48, 3)] > by[(48, 1)] and by[(100, 1)] > by[(48, 1)]
    # the routed experts the step served, counted from the routing: 3 generations with their own next tokens reach
    # more (layer, expert) pairs than 1, and never more than the MoE layers' experts
    from cpkv.model.config import load_model_config

    m = load_model_config("tiny")
    moe = m.mlp_layer_types.count("sparse")
    per = {(c["keys"], c["batch"]): c["experts_read"] for c in cases}
    for (k, b), got in per.items():
        assert moe * min(m.num_experts_per_tok, m.n_routed_experts) <= got <= moe * m.n_routed_experts
    assert per[(48, 3)] > per[(48, 1)]
    assert all(c["weights"] == "bf16" for c in cases)  # auto on the CPU
    # checked by default at cp 2 too: generation 0's logits gathered to rank 0 from the rank that computed them
    assert all(c["check_ok"] and c["check_steps"] == 2 for c in cases)


def test_floor_counts_the_experts_read_not_the_most_reachable():
    from cpkv.bench.decode import step_floor
    from cpkv.memplan import weight_bytes
    from cpkv.model.config import load_model_config
    from cpkv.scheduler.decode import DecodeStep

    m = load_model_config("tiny")
    step = DecodeStep(index=0, entries=(), page_size=16, cp=1)
    wb = weight_bytes(m, "bf16", "float32")
    base = step_floor(step, m, 0, "bf16", "float32", experts_read=0)
    assert step_floor(step, m, 0, "bf16", "float32", experts_read=5) - base == 5 * wb.expert


def test_bad_lists_are_one_line_naming_the_flag(capsys):
    assert main(["bench", "decode", "--keys", "12,x"]) == 2
    assert "--keys" in capsys.readouterr().err


def test_the_graphs_form_at_cp1_reports_its_pipelined_loop_beside_the_synchronised_step(capsys):
    """cp 1, the graphs form (on the CPU: the fixed-shape step run eagerly): step_ms is the pipelined loop's time per
    step, sync_step_ms the synchronised step's, both timed; the gather form beside it does not pipeline."""
    rc = main(["bench", "decode", "--device", "cpu", "--cp", "1", "--page-size", "16", "--keys", "48",
               "--batches", "2", "--steps", "2", "--form", "graphs,gather", "--json"])
    assert rc == 0
    cases = json.loads(capsys.readouterr().out)["cases"]
    assert [(c["form"], c["pipelined"]) for c in cases] == [("graphs", True), ("gather", False)]
    for c in cases:
        assert c["step_ms"] > 0 and c["sync_step_ms"] > 0
    assert cases[1]["step_ms"] == cases[1]["sync_step_ms"]


def test_every_form_checks_its_timed_steps_against_the_reference(capsys):
    """By default each case checks generation 0's first and last timed steps against the model's reference forward
    (a context past the tiny model's top-k of 64): within the CPU tolerance, the greedy tokens the reference's,
    and the pipelined loop's last token too where it runs; --no-check reports none of it."""
    from cpkv.bench.decode import CHECK_TOL, check_tolerance

    assert check_tolerance("cpu", 2.0) == pytest.approx(CHECK_TOL["cpu"][0] + 2.0 * CHECK_TOL["cpu"][1])
    rc = main(["bench", "decode", "--device", "cpu", "--cp", "1", "--page-size", "16", "--keys", "100",
               "--batches", "2", "--steps", "2", "--form", "graphs,static,gather", "--json"])
    assert rc == 0
    cases = json.loads(capsys.readouterr().out)["cases"]
    assert [c["form"] for c in cases] == ["graphs", "static", "gather"]
    for c in cases:
        assert c["check_ok"] is True and c["check_greedy"] is True and c["check_steps"] == 2, c
        assert 0 <= c["check_max_diff"] <= c["check_tol"] and c["check_tol"] >= CHECK_TOL["cpu"][0]
        assert ("check_pipelined_greedy" in c) == c["pipelined"]
    assert cases[0]["check_pipelined_greedy"] is True
    # the graphs form's decisions (each full layer's selection, each MoE layer's experts) forced on its reference,
    # every one of generation 0's in both checked steps compared: on the CPU they agree, their scores to rounding
    decided = cases[0]["check_decisions"]
    assert cases[0]["check_forced"] is True and not cases[1]["check_forced"] and not cases[2]["check_forced"]
    for kind, per_step in (("route", 2), ("index", 2)):  # the tiny model: MoE layers 1, 2; full layers 0, 2
        d = decided[kind]
        assert d["compared"] == 2 * per_step and d["differed"] == d["unexplained"] == 0, (kind, d)
        assert d["score_noise"] < 1e-4, (kind, d)
    rc = main(["bench", "decode", "--device", "cpu", "--cp", "1", "--page-size", "16", "--keys", "48",
               "--batches", "1", "--steps", "1", "--form", "gather", "--no-check", "--json"])
    assert rc == 0
    assert not any(k.startswith("check") for k in json.loads(capsys.readouterr().out)["cases"][0])


def test_stale_top_k_bounds_fail_the_check_and_the_command(capsys):
    """The planted fault that once went unnoticed (the test hook --plant-fault stale-bounds: the in-place step's
    top-k bounds kept from its first step, as a replay reading its warm-up's): the graphs form's check fails, its
    logits off and its greedy tokens too, the gather form beside it (no such bounds) passes, and the command exits
    1 with one line on stderr naming the failed case."""
    rc = main(["bench", "decode", "--device", "cpu", "--cp", "1", "--page-size", "16", "--keys", "100",
               "--batches", "1", "--steps", "2", "--form", "graphs,gather", "--plant-fault", "stale-bounds",
               "--json"])
    out = capsys.readouterr()
    assert rc == 1
    graphs, gather = json.loads(out.out)["cases"]
    # the graphs form's decisions are forced on its reference: its logits then agree, and its stale selections are
    # what fails, each far from a near-tie in the reference's own scores
    index = graphs["check_decisions"]["index"]
    assert graphs["check_ok"] is False and graphs["check_forced"] is True
    assert index["unexplained"] > 0 and index["max_margin"] > 100 * index["largest_allowed"], index
    assert gather["check_forced"] is False  # the gather form's selection is not kept: compared unforced
    assert graphs["check_greedy"] is False
    assert gather["check_ok"] is True
    failed = [line for line in out.err.splitlines() if "check failed" in line]
    assert len(failed) == 1 and "graphs keys 100 batch 1" in failed[0] and "gather" not in failed[0]



def test_experts_read_come_from_the_step_that_ran():
    """``routed_experts_read`` counts a graphed step's own routing (its graph's buffers, ``routing``) over what the
    layers last kept (the last captured graph's, which may be another bucket's); the union per layer, among the
    experts the rank holds, over its own rows only."""
    from types import SimpleNamespace

    import torch

    from cpkv.bench.decode import routed_experts_read

    ctx = SimpleNamespace(all_reduce_max_list=lambda v: v)
    stale = torch.tensor([[0, 1], [0, 1]])
    layers = [SimpleNamespace(n=0, is_moe=False), SimpleNamespace(n=1, is_moe=True, routed=stale, experts=range(8)),
              SimpleNamespace(n=2, is_moe=True, routed=stale, experts=range(4))]
    model = SimpleNamespace(layers=layers, cfg=SimpleNamespace(n_routed_experts=8))
    assert routed_experts_read(ctx, model, 2) == 2 + 2
    routing = {1: torch.tensor([[2, 3], [3, 5], [7, 7]]), 2: torch.tensor([[1, 6], [2, 3], [0, 0]])}
    # own rows 0-1: layer 1 {2, 3, 5}; layer 2 {1, 2, 3, 6} of which the rank holds 0-3: {1, 2, 3}
    assert routed_experts_read(ctx, model, 2, routing) == 3 + 3
