"""The reference DSA model: config and checkpoint loading, DSA structure, the sparse path."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cpkv.config import preset
from cpkv.errors import CheckpointError, ConfigError
from cpkv.model import DSAModel, load_model, load_model_config
from cpkv.model.config import config_from_dict, config_to_dict
from cpkv.model.layer import AttnPlan
from cpkv.model.ops import Rotary, hadamard_rotate, rms_norm
from cpkv.model.weights import expected_shapes, random_weights, save_checkpoint

TINY = preset("tiny")
ONE_LAYER = dataclasses.replace(TINY, num_layers=1)


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def tiny_model() -> DSAModel:
    return DSAModel.random(TINY, seed=3)


# -- configuration ---------------------------------------------------------------------------------
def test_config_json_round_trip():
    cfg = config_from_dict(config_to_dict(preset("glm5")), name="glm5")
    assert cfg == preset("glm5")


def test_config_missing_key_is_named():
    raw = config_to_dict(TINY)
    del raw["index_topk"]
    with pytest.raises(CheckpointError, match="index_topk"):
        config_from_dict(raw)


def test_unknown_model_spec(tmp_path):
    with pytest.raises(ConfigError, match="preset"):
        load_model_config(str(tmp_path / "nowhere"))


def test_layer_override():
    assert load_model_config("glm5", num_layers=3).num_layers == 3


# -- checkpoints -----------------------------------------------------------------------------------
def test_checkpoint_round_trip(tmp_path):
    weights = random_weights(ONE_LAYER, seed=7)
    save_checkpoint(tmp_path, ONE_LAYER, weights, shards=3)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    loaded = load_model(str(tmp_path))
    assert loaded.cfg == dataclasses.replace(ONE_LAYER, name=tmp_path.name)
    for name, t in weights.items():
        assert torch.equal(loaded.weights[name], t), name
    direct = DSAModel(ONE_LAYER, weights)
    prompt = tokens(40)
    assert torch.equal(loaded.reference_prefill(prompt), direct.reference_prefill(prompt))


def test_checkpoint_with_extra_layers_loads_prefix(tmp_path):
    two = dataclasses.replace(TINY, num_layers=2)
    save_checkpoint(tmp_path, two, random_weights(two, seed=1))
    m = load_model(str(tmp_path), num_layers=1)
    assert len(m.layers) == 1


@pytest.mark.parametrize("victim", ["model.layers.0.self_attn.indexer.wq_b.weight", "lm_head.weight",
                                    "model.layers.0.self_attn.indexer.k_norm.bias"])
def test_missing_tensor_is_named(tmp_path, victim):
    weights = random_weights(ONE_LAYER, seed=7)
    del weights[victim]
    save_checkpoint(tmp_path, ONE_LAYER, weights)
    with pytest.raises(CheckpointError, match=f"missing tensor {victim.replace('.', '[.]')}"):
        load_model(str(tmp_path))


def test_misshaped_tensor_is_named(tmp_path):
    weights = random_weights(ONE_LAYER, seed=7)
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    weights[name] = weights[name][:-1].clone()
    save_checkpoint(tmp_path, ONE_LAYER, weights)
    with pytest.raises(CheckpointError) as err:
        load_model(str(tmp_path))
    assert name in str(err.value) and "[256, 128]" in str(err.value) and "[255, 128]" in str(err.value)


def test_fp8_block_weights_are_dequantised(tmp_path):
    weights = random_weights(ONE_LAYER, seed=2)
    name = "model.layers.0.mlp.gate_proj.weight"  # [256, 128]: 2 x 1 blocks
    w8 = weights[name].to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5], [2.0]])
    weights[name] = w8
    weights[name + "_scale_inv"] = scale
    save_checkpoint(tmp_path, ONE_LAYER, weights)
    got = load_model(str(tmp_path)).weights[name]
    want = w8.float() * torch.tensor([0.5] * 128 + [2.0] * 128)[:, None]
    assert torch.equal(got, want)


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(TINY)))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(str(tmp_path))


def test_expected_names_are_public():
    names = expected_shapes(TINY)
    for key in ("model.embed_tokens.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                "model.layers.0.self_attn.indexer.weights_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert key in names


# -- DSA structure ---------------------------------------------------------------------------------
def test_rotary_depends_on_relative_position():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 32, dtype=torch.float64, generator=g), torch.randn(1, 32, dtype=torch.float64, generator=g)
    # tolerance relative to |q| |k| (the dot itself can be near zero): the rotation angles are float32
    tol = 1e-5 * float(q.norm() * k.norm())
    for kind in ("interleaved", "halves"):
        def dot(pq: int, pk: int) -> float:
            rq = getattr(Rotary.build(torch.tensor([pq]), 32, 1e4), kind)(q)
            rk = getattr(Rotary.build(torch.tensor([pk]), 32, 1e4), kind)(k)
            return float((rq * rk).sum())
        assert dot(10, 3) == pytest.approx(dot(107, 100), abs=tol)
        assert abs(dot(10, 3) - dot(10, 4)) > 1000 * tol


def test_hadamard_is_orthogonal():
    x = torch.randn(5, 64)
    assert torch.allclose(hadamard_rotate(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_absorbed_attention_matches_explicit_mla(tiny_model):
    """layer.attend (absorbed, latent scores) == per-head MLA with k_nope = W_UK c, v = W_UV c (float64)."""
    from cpkv.attention import dequant_token_kv

    cfg, layer = TINY, tiny_model.layers[0]
    n = 24
    h = tiny_model.embed(torch.tensor(tokens(n)))
    rot = tiny_model.rotary(torch.arange(n))
    p = layer.project(h, rot)
    plan = AttnPlan.build([0] * n, list(range(1, n + 1)), cfg.index_topk, "cpu")
    got, _ = layer.attend(h, p, {"token": p.token, "index": p.index}, plan)
    want = explicit_mla_layer(layer, h, rot, dequant_token_kv(p.token, cfg.token_format).double())
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 2e-2, err


def explicit_mla_layer(layer, h, rot, kv):
    cfg, w = layer.cfg, {k: v.double() for k, v in layer.w.items()}
    n, H, nope, kr = h.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    hd = h.double()
    x = rms_norm(hd, w["input_layernorm.weight"], cfg.rms_norm_eps)
    qr = rms_norm(x @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = (qr @ w["self_attn.q_b_proj.weight"].T).view(n, H, -1)
    q_nope, q_rope = q[..., :nope], rot.interleaved(q[..., nope:]).double()
    kv_b = w["self_attn.kv_b_proj.weight"].view(H, nope + cfg.v_head_dim, kr)
    k_nope = torch.einsum("hnc,sc->shn", kv_b[:, :nope], kv[:, :kr])
    v = torch.einsum("hvc,sc->shv", kv_b[:, nope:], kv[:, :kr])
    scores = (torch.einsum("thn,shn->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_rope, kv[:, kr:]))
    scores = scores * layer.sm_scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1)[None], float("-inf"))
    o = torch.einsum("hts,shv->thv", scores.softmax(-1), v).reshape(n, -1)
    hd = hd + o @ w["self_attn.o_proj.weight"].T
    x = rms_norm(hd, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    mlp = (torch.nn.functional.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T))
    return hd + mlp @ w["mlp.down_proj.weight"].T


# -- the sparse path -------------------------------------------------------------------------------
def test_long_prompt_uses_the_sparse_path_and_selection_matters():
    n = 3 * TINY.index_topk
    sparse_model = DSAModel.random(TINY, seed=3)
    logits = sparse_model.reference_prefill(tokens(n))
    assert sparse_model.layer_stats() == {"dense": 0, "sparse": TINY.num_layers}
    wide = DSAModel.random(dataclasses.replace(TINY, index_topk=4 * n), seed=3)
    dense_logits = wide.reference_prefill(tokens(n))
    assert wide.layer_stats() == {"dense": TINY.num_layers, "sparse": 0}
    assert (logits - dense_logits).abs().max() > 1e-2  # top-k really dropped keys


def test_sparse_path_selecting_everything_equals_dense(tiny_model):
    n = TINY.index_topk - 5
    layer = tiny_model.layers[0]
    h = tiny_model.embed(torch.tensor(tokens(n, seed=4)))
    p = layer.project(h, tiny_model.rotary(torch.arange(n)))
    dense = AttnPlan.build([0] * n, list(range(1, n + 1)), TINY.index_topk, "cpu")
    forced = dataclasses.replace(dense, max_keys=TINY.index_topk + 1)  # sparse path, every key selected
    assert dense.dense and not forced.dense
    a, _ = layer.attend(h, p, {"token": p.token, "index": p.index}, dense)
    b, _ = layer.attend(h, p, {"token": p.token, "index": p.index}, forced)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_selected_rows_lie_inside_each_query_range(tiny_model):
    n = 2 * TINY.index_topk + 7
    layer = tiny_model.layers[2]  # a full indexer layer (layer 1 is shared: no index rows)
    h = tiny_model.embed(torch.tensor(tokens(n, seed=5)))
    p = layer.project(h, tiny_model.rotary(torch.arange(n)))
    off = 64  # keys of this request start at dense row 64
    pad = torch.zeros(off, p.index.shape[1], dtype=torch.uint8)
    plan = AttnPlan.build([off] * n, [off + i + 1 for i in range(n)], TINY.index_topk, "cpu")
    idx = layer.select(p, torch.cat((pad, p.index)), plan)
    assert idx.shape == (n, TINY.index_topk)
    for i in (0, TINY.index_topk - 1, n - 1):
        row = idx[i][idx[i] >= 0]
        assert len(row) == min(i + 1, TINY.index_topk)
        assert int(row.min()) >= off and int(row.max()) <= off + i
