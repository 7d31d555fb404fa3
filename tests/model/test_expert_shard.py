"""Expert parallelism, one process: which routed experts a rank holds, and that it loads or draws only those,
with the values the full model has."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cpkv.config import preset
from cpkv.errors import ConfigError
from cpkv.model import DSAModel, load_model
from cpkv.model.checkpoint import routed_expert
from cpkv.model.moe import expert_block
from cpkv.model.weights import expected_shapes, random_weights, save_checkpoint

TINY = preset("tiny")  # 24 routed experts, MoE on layers 1 and 2


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 6, 8])
def test_expert_blocks_split_the_experts_contiguously(cp):
    blocks = [expert_block(r, cp, 24) for r in range(cp)]
    assert [e for b in blocks for e in b] == list(range(24)) and {len(b) for b in blocks} == {24 // cp}


@pytest.mark.parametrize("cp", [5, 7, 16])
def test_cp_must_divide_the_experts(cp):
    with pytest.raises(ConfigError, match=f"cp {cp} must divide the model's n_routed_experts 24"):
        expert_block(0, cp, 24)


def test_engine_config_and_cli_name_cp(capsys):
    from cpkv.cli import main
    from cpkv.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="cp 5 must divide the model's 24 routed experts"):
        EngineConfig(cp=5)
    assert main(["run", "--cp", "5"]) == 2  # before any rank starts
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("cpkv run: error: --cp 5 must divide the model's 24 routed experts"), err
    EngineConfig(cp=5, model="tiny", num_layers=1)  # a dense-only cut has no experts to split


def test_random_weights_of_a_block_equal_the_full_models():
    full = random_weights(TINY, seed=5)
    part = random_weights(TINY, seed=5, experts=range(2, 4))
    expert_names = {n for n in full if routed_expert(n) is not None}
    assert expert_names and set(part) == {n for n in full if routed_expert(n) in (None, 2, 3)}
    assert {routed_expert(n) for n in part} == {None, 2, 3}
    for name, t in part.items():
        assert torch.equal(t, full[name]), name


def test_a_rank_model_stacks_its_block_and_refuses_to_run_alone():
    full = DSAModel.random(TINY, seed=2)
    part = DSAModel.random(TINY, seed=2, experts=range(4, 6))
    assert part.expert_parallel and not full.expert_parallel
    for a, b in zip(full.layers, part.layers):
        assert (a.moe is None) == (b.moe is None)
        if a.moe is not None:
            assert b.moe.gate_up.shape[0] == 2
            assert torch.equal(b.moe.gate_up, a.moe.gate_up[4:6]) and torch.equal(b.moe.down, a.moe.down[4:6])
    with pytest.raises(ValueError, match="holds routed experts 4..5 of 24: its MoE needs the expert-parallel exchange"):
        part.reference_prefill([1, 2, 3])


def test_a_checkpoint_rank_reads_only_its_experts(tmp_path, monkeypatch):
    import safetensors

    cfg = dataclasses.replace(TINY, num_layers=2)
    weights = random_weights(cfg, seed=1)
    save_checkpoint(tmp_path, cfg, weights, shards=3)
    read: list[str] = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    m = load_model(str(tmp_path), ep=(3, 4))  # experts 18 .. 23
    held = (None, *range(18, 24))
    assert {routed_expert(n) for n in read} == set(held)
    assert len(read) == sum(1 for n in expected_shapes(cfg) if routed_expert(n) in held)
    assert torch.equal(m.layers[1].moe.down[0], weights["model.layers.1.mlp.experts.18.down_proj.weight"])
