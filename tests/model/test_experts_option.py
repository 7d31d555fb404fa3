"""``--experts N``: the model's every dimension and depth, routed over N experts per MoE layer (one rank's share
of a cp-N/n deployment on one GPU). The config keeps the grouping valid or refuses in one line; the plan counts the
share; a run over it verifies against its reference; a checkpoint refuses it."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from cpkv.config import preset
from cpkv.errors import ConfigError
from cpkv.memplan import GB, Setup, plan_memory
from cpkv.model.config import load_model_config
from cpkv.model.model import load_model



@pytest.mark.parametrize("name,n", [("glm5", 32), ("glm5", 8), ("deepseek-v32", 32), ("deepseek-v32", 16),
                                    ("tiny", 4), ("tiny", 24)])
def test_fewer_experts_keep_every_other_field(name, n):
    full = preset(name)
    cut = load_model_config(name, None, n)
    assert cut.n_routed_experts == n
    assert dataclasses.replace(cut, n_routed_experts=full.n_routed_experts) == full


@pytest.mark.parametrize("name,n,says", [
    ("deepseek-v32", 20, "expected a multiple of 8 from 16 to 256"),  # 8 groups: 20 does not split
    ("deepseek-v32", 8, "expected a multiple of 8 from 16 to 256"),   # 1 expert per group
    ("glm5", 4, "must be an integer in 8..256"),                     # fewer than a token picks
    ("glm5", 300, "must be an integer in 8..256"),                   # more than the model has
    ("tiny", 5, "expected a multiple of 2 from 4 to 24"),
])
def test_experts_that_break_the_routing_are_one_line_errors(name, n, says):
    with pytest.raises(ConfigError) as err:
        load_model_config(name, None, n)
    assert "\n" not in str(err.value) and "--experts" in str(err.value) and says in str(err.value)


def test_a_checkpoint_refuses_fewer_experts(tmp_path):
    from cpkv.model.config import config_to_dict

    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(preset("tiny"))))
    with pytest.raises(ConfigError, match="only with a preset"):
        load_model_config(str(tmp_path), None, 8)


def test_the_plan_of_a_share_equals_one_rank_of_the_group():
    """GLM-5 at cp 1 over 32 experts holds exactly the expert bytes one cp-8 rank of the full model holds, and the
    same replicated weights."""
    budget = int(141 * GB)
    one = plan_memory(Setup(load_model_config("glm5", None, 32), 1, budget, pages_per_rank=1024))
    rank = plan_memory(Setup(load_model_config("glm5"), 8, budget, pages_per_rank=1024))
    assert one.items["expert_bytes"] == rank.items["expert_bytes"] > 0
    m = load_model_config("glm5")
    router_row = m.hidden_size * 2 + 4  # one expert's row of the bf16 router weight and its float32 bias
    moe = m.mlp_layer_types.count("sparse")
    assert rank.items["weights_bytes"] - one.items["weights_bytes"] == (256 - 32) * router_row * moe


def test_the_model_routes_over_its_share_only():
    model = load_model("tiny", num_layers=2, routed_experts=8)
    moe = [n for n, t in enumerate(model.cfg.mlp_layer_types) if t == "sparse"]
    assert moe and len(model.experts) == 8
    for n in moe:
        assert model.weights[f"model.layers.{n}.mlp.gate.weight"].shape[0] == 8
    logits = model.reference_prefill(list(range(5, 45)))
    assert logits.shape == (model.cfg.vocab_size,) and torch.isfinite(logits).all()


def _cpkv(*args: str) -> subprocess.CompletedProcess:
    import os
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "cpkv", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_cpkv_run_over_a_share_verifies_and_says_so():
    run = _cpkv("run", "--experts", "8", "--cp", "2", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["ok"] and out["verify"]["ok"] and out["verify"]["checked"] > 0
    assert (out["routed_experts"], out["experts_option"], out["experts_per_rank"]) == (8, 8, [4, 4])
    bad = _cpkv("run", "--experts", "5")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--experts 5" in bad.stderr


def test_cpkv_plan_counts_the_share():
    out = json.loads(_cpkv("plan", "--model", "glm5", "--cp", "1", "--experts", "32", "--json").stdout)
    full = json.loads(_cpkv("plan", "--model", "glm5", "--cp", "8", "--json").stdout)
    assert (out["routed_experts"], out["experts_option"], full["routed_experts"]) == (32, 32, 256)
    assert out["fits"]
