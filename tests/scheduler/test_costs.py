"""Cost model fed from `cpkv bench` reports: unit costs derived exactly, files applied in order."""
from __future__ import annotations

import json

import pytest

from cpkv.cli import main
from cpkv.errors import ConfigError
from cpkv.scheduler.costs import CostModel, unit_costs_attention, unit_costs_compose, unit_costs_indexer


def test_unit_costs_from_bench_fields():
    att = unit_costs_attention([{"tokens": 4096, "ms": 3.713}, {"tokens": 16384, "ms": 14.49}], topk=2048)
    assert att["attention_s_per_pair"] == pytest.approx(78 * 18.203e-3 / (20480 * 2048), rel=1e-12)
    idx = unit_costs_indexer([{"pairs": 10**9, "logits_ms": 4.0, "topk_ms": 1.0},
                              {"pairs": 3 * 10**9, "logits_ms": 12.0, "topk_ms": 3.0}])
    assert idx["indexer_s_per_pair"] == pytest.approx(40 * 20e-3 / 4e9, rel=1e-12)  # GLM-5: 40 full layers
    comp = unit_costs_compose({"symm": {"ms_per_batch": 62.8}}, {"prefix_tokens": 500_000, "extend_tokens": 44_000})
    assert comp["compose_s_per_token"] == pytest.approx(62.8e-3 / 544_000, rel=1e-12)
    assert unit_costs_compose({"v2": {"ms_per_batch": 1.0}}, {"prefix_tokens": 1, "extend_tokens": 1}) == {}


def test_reports_apply_in_order(tmp_path):
    a = tmp_path / "attention.json"
    a.write_text(json.dumps({"device": "H200", "cases": [], "costs": {"attention_s_per_pair": 3e-8}}))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"attention_s_per_pair": 5e-8, "linear_s_per_token": 1e-4}))
    model = CostModel.from_json(a, plain)
    assert (model.attention_s_per_pair, model.linear_s_per_token) == (5e-8, 1e-4)
    assert CostModel.from_json(plain, a).attention_s_per_pair == 3e-8
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"costs": {"warp_speed": 1.0}}))
    with pytest.raises(ConfigError, match="unknown cost field"):
        CostModel.from_json(bad)


def test_replay_takes_a_compose_bench_report(tmp_path, capsys):
    report = tmp_path / "compose.json"
    assert main(["bench", "compose", "--device", "cpu", "--cp", "2", "--model", "tiny", "--requests", "2",
                 "--extend-tokens", "512", "--prefix-tokens", "2048", "--layers", "1", "--iters", "1",
                 "--no-kernel", "--modes", "symm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["costs"]["compose_s_per_token"] > 0
    report.write_text(json.dumps(out))
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"costs": {"compose_s_per_token": 1e-3}}))
    args = ["replay", "--requests", "30", "--scale", "0.01", "--cp", "2", "--kv-tokens-per-rank", "200000", "--json"]
    runs = []
    for extra in ([], ["--costs", str(report)], ["--costs", str(report), "--costs", str(slow)]):
        assert main(args + extra) == 0
        runs.append(json.loads(capsys.readouterr().out)["runs"][0]["ttft_s"]["p50"])
    assert runs[2] > runs[1] and runs[2] > runs[0]  # a 1 ms/token compose is far slower than either
