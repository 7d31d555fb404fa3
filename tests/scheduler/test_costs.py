"""Cost model fed from `cpkv bench` reports: unit costs derived exactly, files applied in order."""
from __future__ import annotations

import json

import pytest

from cpkv.cli import main
from cpkv.errors import ConfigError
from dataclasses import fields

from cpkv.scheduler.costs import RANGES, SECONDS, CostModel, unit_costs_attention, unit_costs_compose, unit_costs_indexer


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


# issue 40: every figure of a cost file is checked when read (finite, positive where it divides, whole where it
# counts); a bad one is one line naming the file and the field, never a ZeroDivisionError later
BAD_COSTS = [
    ({"kv_bytes_per_token": 0}, "kv_bytes_per_token must be an integer > 0 and <= 2^30 (it divides the KV memory), "
                                "got 0"),
    ({"kv_bytes_per_token": 56448.5}, "kv_bytes_per_token must be an integer"),
    ({"hbm_bytes": 0}, "hbm_bytes must be a finite number > 0"),
    ({"mem_fraction": 0}, "mem_fraction must be a finite number > 0 and <= 1"),
    ({"mem_fraction": 1.01}, "mem_fraction must be a finite number > 0 and <= 1"),
    ({"topk": 0}, "topk must be an integer >= 1 and <= 2^24, got 0"),
    ({"num_layers": 2.5}, "num_layers must be an integer >= 1"),
    ({"linear_s_per_token": -1e-9}, "linear_s_per_token must be a finite number >= 0 and <= 1e+06, got -1e-09"),
    ({"compose_s_per_token": 1e300}, "compose_s_per_token must be a finite number >= 0 and <= 1e+06, got 1e+300"),
    ({"weight_bytes": 1e300}, "weight_bytes must be a finite number >= 0 and <= 1e+15"),
    ({"batch_overhead_s": None}, "batch_overhead_s must be a finite number >= 0 and <= 1e+06, got null"),
    ({"topk": True}, "topk must be an integer >= 1 and <= 2^24, got true"),
    ({"topk": "64"}, "topk must be an integer"),
]


@pytest.mark.parametrize("obj, needle", BAD_COSTS, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(BAD_COSTS)])
def test_every_cost_figure_is_checked_when_read(obj, needle, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ConfigError) as exc:
        CostModel.from_json(path)
    assert str(exc.value) == f"{path}: {needle}" or str(exc.value).startswith(f"{path}: {needle}"), str(exc.value)


def test_non_finite_json_numbers_and_a_bench_report_are_checked(tmp_path):
    path = tmp_path / "c.json"
    for text in ('{"linear_s_per_token": NaN}', '{"costs": {"hbm_bytes": Infinity}}', '{"topk": -Infinity}'):
        path.write_text(text)
        with pytest.raises(ConfigError, match="must be .* got (NaN|Infinity|-Infinity)"):
            CostModel.from_json(path)


def test_defaults_and_range_edges_are_accepted():
    model = CostModel()
    assert all(RANGES.get(f.name, SECONDS).holds(getattr(model, f.name)) for f in fields(model))
    edge = model.updated({"kv_bytes_per_token": 1, "mem_fraction": 1, "topk": 64.0, "linear_s_per_token": 0,
                          "weight_bytes": 0, "num_layers": 1})
    assert (edge.kv_bytes_per_token, edge.topk, edge.mem_fraction) == (1, 64, 1.0)
    assert isinstance(edge.topk, int) and edge.kv_tokens_per_rank(8) > 0


@pytest.mark.parametrize("command", [["replay", "--requests", "5", "--scale", "0.01"],
                                     ["bench", "serve", "--requests", "2", "--scale", "0.01", "--url",
                                      "http://127.0.0.1:1"]])
def test_a_zero_kv_bytes_cost_file_is_one_line_exit_2(command, tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text('{"kv_bytes_per_token": 0}')
    assert main([*command, "--costs", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"cpkv {' '.join(command[:2]) if command[0] == 'bench' else 'replay'}: error: {path}: "
                           "kv_bytes_per_token must be an integer > 0 and <= 2^30 (it divides the KV memory), got 0")
