"""A random model is built on its device one layer at a time (``random_weight_groups``): the same values as the
whole-dict path it replaced (the seeding ``seed * 1_000_003 + index in expected_shapes`` kept), so earlier results
and the parent's reference do not move; the load's transients are one layer's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cpkv.config import preset
from cpkv.model.config import load_model_config
from cpkv.model.model import DSAModel
from cpkv.model.weights import (_random_tensor, by_layer, expected_shapes, fp8_kept, layer_of, quant_fp8_blocks,
                                random_weight_groups, random_weights)

TINY = preset("tiny")


def old_random_weights(cfg, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The whole-model draw as it was before the layer-by-layer load (every tensor, one dict)."""
    out = {}
    for i, (name, shape) in enumerate(expected_shapes(cfg).items()):
        gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + i)
        out[name] = _random_tensor(name, shape, gen, "cpu").to(dtype)
    return out


def prompt(n: int) -> list[int]:
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("fp8", [False, True])
def test_layerwise_model_gives_the_same_weights_and_logits_as_the_whole_dict(fp8):
    new = DSAModel.random(TINY, seed=3, fp8=fp8)
    old = DSAModel(TINY, old_random_weights(TINY, 3), fp8=fp8, consume=True)
    assert new.weights.keys() == old.weights.keys()
    for k in new.weights:
        assert torch.equal(new.weights[k].float(), old.weights[k].float()), k
    for a, b in zip(new.layers, old.layers):
        assert torch.equal(a.moe.gate_up.float(), b.moe.gate_up.float()) if a.moe else a.dense_mlp is not None
    tokens = prompt(70)  # past the tiny model's top-k (64): the indexer runs
    assert torch.equal(new.reference_prefill(tokens), old.reference_prefill(tokens))


def test_fp8_weights_are_the_old_drawing_quantised():
    model = DSAModel.random(TINY, seed=1, fp8=True)
    old = old_random_weights(TINY, 1)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    q, s = quant_fp8_blocks(old[name])
    assert torch.equal(model.weights[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(model.weights[name + "_scale_inv"], s)


def test_groups_are_the_outer_tensors_then_each_layer_in_order():
    groups = list(random_weight_groups(TINY, seed=0))
    assert len(groups) == TINY.num_layers + 1
    assert {layer_of(k) for k in groups[0]} == {None}
    assert "model.embed_tokens.weight" in groups[0] and "lm_head.weight" in groups[0]
    for n, g in enumerate(groups[1:]):
        assert {layer_of(k) for k in g} == {n}
    whole = random_weights(TINY, seed=0)
    assert sum(map(len, groups)) == len(whole)


def test_an_expert_block_draws_only_its_experts_with_the_full_models_values():
    full = random_weights(TINY, seed=2)
    block = range(4, 8)
    part = {k: v for g in random_weight_groups(TINY, seed=2, experts=block) for k, v in g.items()}
    assert "model.layers.1.mlp.experts.4.up_proj.weight" in part
    assert "model.layers.1.mlp.experts.0.up_proj.weight" not in part
    assert all(torch.equal(v, full[k]) for k, v in part.items())


def test_by_layer_empties_the_dict_and_drops_deeper_layers():
    weights = random_weights(TINY, seed=0)
    cut = dataclasses.replace(TINY, num_layers=2)
    groups = list(by_layer(weights, cut.num_layers))
    assert not weights and len(groups) == 3
    assert all(layer_of(k) in (None, 0, 1) for g in groups for k in g)


@pytest.mark.slow
def test_cut_glm5_groups_equal_the_old_draw_quantised_tensor_by_tensor():
    """GLM-5's every dimension (vocab cut, 4 layers: three dense, one MoE over 8 experts), bf16 as on CUDA: each
    group of the fp8 load holds the old draw, quantised where ``fp8_kept``, in the compute dtype elsewhere."""
    cfg = dataclasses.replace(load_model_config("glm5", 4, 8), vocab_size=256)
    index = {n: i for i, n in enumerate(expected_shapes(cfg))}
    shapes = expected_shapes(cfg)
    seen = 0
    for group in random_weight_groups(cfg, seed=0, dtype=torch.bfloat16, fp8=True):
        for name in [k for k in group if not k.endswith("_scale_inv")]:
            gen = torch.Generator().manual_seed(index[name])
            old = _random_tensor(name, shapes[name], gen, "cpu").to(torch.bfloat16)
            if fp8_kept(name):
                q, s = quant_fp8_blocks(old)
                assert torch.equal(group[name].view(torch.uint8), q.view(torch.uint8)), name
                assert torch.equal(group[name + "_scale_inv"], s), name
            else:
                assert torch.equal(group[name], old), name
            seen += 1
        group.clear()
    assert seen == len(shapes)
