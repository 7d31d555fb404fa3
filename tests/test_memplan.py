"""The memory plan (cpkv.memplan): every figure against independent arithmetic on the model's shapes, the
staging and arena against the compose code that allocates them, and the fits GLM-5 / DeepSeek-V3.2 need."""
from __future__ import annotations

import dataclasses
from math import ceil, prod

import pytest
import torch

from cpkv import envs
from cpkv.config import KINDS, preset
from cpkv.memplan import ARENA_SLACK, GB, Setup, activation_parts, items_at, plan_memory, weight_bytes
from cpkv.model.model import FLOAT32_WEIGHTS

GLM5, DSV32 = preset("glm5"), preset("deepseek-v32")
DEEP = {"glm5": GLM5, "deepseek-v32": DSV32, "glm5-1024": GLM5.with_layers(1024), "deepseek-v32-5": DSV32.with_layers(5)}


def shape_params(m) -> dict[str, int]:
    """Parameter counts by hand from config.json's fields: {"linear": fp8-able projections (non-expert), "other":
    embeddings, head, norms, router, biases, kv_b_proj (never fp8), "f32": the float32 ones, "expert": one routed
    expert}."""
    d, h, qr, kr, r = m.hidden_size, m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    attn = d * qr + h * (m.qk_nope_head_dim + r) * qr + (kr + r) * d + d * h * m.v_head_dim
    kv_b = h * (m.qk_nope_head_dim + m.v_head_dim) * kr  # kept in the compute dtype: the layer splits it
    full = len(m.full_layers)
    dense = m.mlp_layer_types.count("dense")
    moe = m.mlp_layer_types.count("sparse")
    linear = m.num_layers * attn + full * (m.index_n_heads * m.index_head_dim * qr + m.index_head_dim * d) \
        + dense * 3 * m.intermediate_size * d + moe * 3 * m.moe_intermediate_size * m.n_shared_experts * d
    f32 = full * m.index_n_heads * d + moe * m.n_routed_experts  # weights_proj, e_score_correction_bias
    other = 2 * m.vocab_size * d + d + m.num_layers * (2 * d + qr + kr + kv_b) + full * 2 * m.index_head_dim \
        + moe * m.n_routed_experts * d
    return {"linear": linear, "other": other, "f32": f32, "expert": 3 * m.moe_intermediate_size * d}


def blocks(rows: int, cols: int) -> int:
    return ceil(rows / 128) * ceil(cols / 128)


def linear_scales(m) -> int:
    """128 x 128 block scales of every non-expert fp8 projection, by hand."""
    d, h, qr, kr, r = m.hidden_size, m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    per_layer = blocks(qr, d) + blocks(h * (m.qk_nope_head_dim + r), qr) + blocks(kr + r, d) \
        + blocks(d, h * m.v_head_dim)
    full = len(m.full_layers)
    idx = blocks(m.index_n_heads * m.index_head_dim, qr) + blocks(m.index_head_dim, d)
    mi, inter = m.moe_intermediate_size * m.n_shared_experts, m.intermediate_size
    mlp = m.mlp_layer_types.count("dense") * (2 * blocks(inter, d) + blocks(d, inter)) \
        + m.mlp_layer_types.count("sparse") * (2 * blocks(mi, d) + blocks(d, mi))
    return m.num_layers * per_layer + full * idx + mlp


def absorbed(m, c: int) -> int:
    return m.num_layers * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * c


@pytest.mark.parametrize("m", DEEP.values(), ids=DEEP)
def test_parameter_count_by_hand(m):
    p = shape_params(m)
    moe = m.mlp_layer_types.count("sparse")
    total = p["linear"] + p["other"] + p["f32"] + moe * m.n_routed_experts * p["expert"]
    assert weight_bytes(m, "fp8", "bfloat16").params == total


def test_glm5_parameters_match_the_published_figures():
    """743.56 B loaded; the checkpoint's 743.9 B adds the indexer weights it also stores on the 38 shared
    layers, which never run them; 724.8 B in the 75 MoE layers' 256 experts."""
    params = weight_bytes(GLM5, "fp8", "bfloat16").params
    shared = GLM5.num_layers - len(GLM5.full_layers)
    unused = shared * (32 * 128 * 2048 + 128 * 6144 + 2 * 128 + 32 * 6144)
    assert params == 743_555_086_080 and round((params + unused) / 1e8) == 7439
    assert 75 * 256 * shape_params(GLM5)["expert"] == 724_775_731_200


@pytest.mark.parametrize("m", DEEP.values(), ids=DEEP)
@pytest.mark.parametrize("weights, compute", [("fp8", "bfloat16"), ("bf16", "bfloat16"), ("bf16", "float32")])
def test_weight_bytes_by_hand(m, weights, compute):
    p, c = shape_params(m), {"bfloat16": 2, "float32": 4}[compute]
    w = weight_bytes(m, weights, compute)
    linear = p["linear"] + 4 * linear_scales(m) if weights == "fp8" else p["linear"] * c
    assert w.replicated == linear + p["other"] * c + 4 * p["f32"] + absorbed(m, c)
    d, mi = m.hidden_size, m.moe_intermediate_size
    assert w.expert == (p["expert"] + 4 * 3 * blocks(mi, d) if weights == "fp8" else p["expert"] * c)


PATTERNED = {"tiny": preset("tiny"), "glm5-7": GLM5.with_layers(7),
             "patterned": dataclasses.replace(preset("tiny").with_layers(4), indexer_pattern=("full", "shared", "full",
                                                                                            "shared"),
                                              mlp_pattern=("sparse", "dense", "sparse", "sparse"))}


@pytest.mark.parametrize("m", PATTERNED.values(), ids=PATTERNED)
def test_weight_bytes_per_layer_kind_equal_a_tensor_by_tensor_count(m):
    """weight_bytes counts each layer kind once (any depth is instant): the same figures as every tensor of
    expected_shapes counted one by one."""
    from cpkv.memplan import tensor_bytes
    from cpkv.model.checkpoint import expected_shapes

    shapes = expected_shapes(m)
    first = next((n for n, t in enumerate(m.mlp_layer_types) if t == "sparse"), -1)
    for weights, compute in (("fp8", "bfloat16"), ("bf16", "float32")):
        w = weight_bytes(m, weights, compute)
        assert w.params == sum(prod(s) for s in shapes.values())
        assert w.replicated == absorbed(m, {"bfloat16": 2, "float32": 4}[compute]) + sum(
            tensor_bytes(k, s, weights, compute) for k, s in shapes.items() if ".mlp.experts." not in k)
        assert w.expert == sum(tensor_bytes(k, s, weights, compute) for k, s in shapes.items()
                               if k.startswith(f"model.layers.{first}.mlp.experts.0."))


def test_float32_weights_are_the_models():
    from cpkv import memplan
    assert memplan.FLOAT32_WEIGHTS == FLOAT32_WEIGHTS


@pytest.mark.parametrize("m", [GLM5, DSV32], ids=["glm5", "deepseek-v32"])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_per_rank_figures(m, cp):
    s = Setup(m, cp, budget=141 * GB)
    plan = plan_memory(s)
    it, w = plan.items, weight_bytes(m, "fp8", "bfloat16")
    moe = m.mlp_layer_types.count("sparse")
    assert it["expert_bytes"] == moe * (256 // cp) * w.expert
    assert it["weights_bytes"] == w.replicated
    token_rows = m.num_layers * 656 + len(m.full_layers) * 132
    assert m.kv_bytes_per_token() == token_rows
    assert it["kv_bytes"] == plan.pages * 64 * token_rows and plan.kv_tokens == (plan.pages - 1) * 64
    # staging: per kind two halves of 1 + C pages, C = 256 chunk pages + 16 request pages (the "model" sizes)
    assert (s.chunk_size, s.max_requests) == (16384, 16)
    assert it["staging_bytes"] == 2 * (1 + 256 + 16) * 64 * (656 + 132)
    logits = envs.get("CPKV_MQA_LOGITS_CHUNK_MAX_GB") * (1 << 30)
    assert 0 < it["logits_bytes"] <= logits
    if plan.fits:
        assert plan.total <= s.budget < plan_memory(dataclasses.replace(s, pages_per_rank=plan.pages + 1)).total
    j = plan.to_json(m.name)
    assert j["node"] == {"kv_tokens_shared": cp * plan.kv_tokens, "kv_tokens_replicated": plan.kv_tokens}


@pytest.mark.parametrize("m", [GLM5, DSV32], ids=["glm5", "deepseek-v32"])
def test_what_fits_on_141_gb(m):
    fits = {cp: plan_memory(Setup(m, cp, budget=141 * GB)) for cp in (1, 2, 4, 8)}
    assert [cp for cp, p in fits.items() if p.fits] == [8]
    assert fits[8].kv_tokens >= 100_000 and fits[8].items["expert_bytes"] > 80 * GB
    assert fits[4].largest()[0] == "expert_bytes"
    bf16 = plan_memory(Setup(m, 8, budget=141 * GB, weights="bf16"))
    assert not bf16.fits and bf16.items["expert_bytes"] > 1.9 * fits[8].items["expert_bytes"]


def test_glm5_at_cp8_per_the_issue():
    """1/8 of the experts ~ 90.6 GB, the rest in fp8 + bf16 embeddings and head ~ 23 GB (with the absorbed
    MLA copies), >= 100K tokens per rank and cp x that for the node."""
    p = plan_memory(Setup(GLM5, 8, budget=141 * GB))
    assert round(p.items["expert_bytes"] / GB, 1) == 90.6
    assert 20 * GB < p.items["weights_bytes"] < 25 * GB  # kv_b_proj in bf16 beside its W_UK / W_UV: 1.15 GB of it
    assert p.kv_tokens >= 100_000 and p.to_json("glm5")["node"]["kv_tokens_shared"] == 8 * p.kv_tokens


def _caps_setup(m, cp, pages):
    return Setup(m, cp, budget=1 << 50, page_size=64, chunk_size=2048, max_requests=4, pages_per_rank=pages)


@pytest.mark.parametrize("name, cp, pages", [("tiny", 1, 10), ("tiny", 3, 33), ("glm5", 8, 3000),
                                             ("deepseek-v32", 2, 77)])
def test_staging_and_arena_match_the_compose_code(name, cp, pages):
    """The plan's staging equals what compose.staging.Staging allocates; its compose buffers are the arena's two
    halves (compose.staging.caps_arena_bytes) within the 256-byte alignment."""
    from cpkv.compose.staging import Staging, caps_arena_bytes

    s = _caps_setup(preset(name), cp, pages)
    caps = s.caps(pages)
    allocated = []

    def alloc(shape, what):
        allocated.append(shape[0] * shape[1] * shape[2])
        return torch.empty(shape, dtype=torch.uint8, device="meta")

    Staging(s.model, 64, caps, alloc)
    items = items_at(s, pages)
    assert items["staging_bytes"] == sum(allocated)
    arena = 2 * caps_arena_bytes({k: 64 * s.model.row_bytes(k) for k in KINDS}, 64, caps)
    assert arena <= items["compose_bytes"] <= arena + ARENA_SLACK


def test_caps_are_the_engines():
    from cpkv.engine.config import EngineConfig

    for mode, pages in (("symm", 40), ("prefetch", 300)):
        cfg = EngineConfig(cp=3, page_size=16, pages_per_rank=pages, chunk_size=256, max_requests=4, mode=mode)
        s = Setup(cfg.model_config(), 3, 1 << 40, page_size=16, chunk_size=256, max_requests=cfg.caps().max_requests)
        assert s.caps(pages) == cfg.caps()


def test_activations_hold_the_moe_dispatch_at_static_capacity():
    s = Setup(GLM5, 8, budget=141 * GB)
    parts = activation_parts(s, rows=2048, keys=0)
    dispatch = 2 * 16384 * 8 * GLM5.hidden_size * 2  # receive + return, chunk x k rows, bf16
    assert parts["moe"] > dispatch and parts["moe"] >= max(parts["attention"], parts["mlp"], parts["project"])
    bigger = activation_parts(dataclasses.replace(s, chunk_size=32768), rows=2048, keys=0)
    d, mi = GLM5.hidden_size, GLM5.moe_intermediate_size  # a pair: ids, quantised row, weight, [2I], quantised [I],
    pair = 3 * 8 + (d + 4 * d // 128) + 4 + 2 * mi * 2 + (mi + 4 * mi // 128) + d * 2 + 2 * d * 2  # out, exchange
    assert bigger["moe"] - parts["moe"] == 16384 * 8 * pair


def test_a_dense_mlp_layer_at_32k_holds_its_swiglu():
    """GLM-5's dense MLP at a 32K chunk on one rank (where the bench ran out of memory): gate_up's [T, 2I] bf16,
    SwiGLU's quantised [T, I], down's [T, d], x and its quantised rows, the latent kept by the caller."""
    s = Setup(GLM5, 1, budget=141 * GB, chunk_size=32768)
    t, d, i = 32768, GLM5.hidden_size, GLM5.intermediate_size
    parts = activation_parts(s, rows=t, keys=0)
    assert parts["mlp"] == t * (64 * 512 * 2 + d * 2 + d + 4 * d // 128 + 2 * i * 2 + i + 4 * i // 128 + d * 2)
    assert parts["persistent"] >= 3 * t * d * 2 + t * 64 * 576 * 2  # h, delta, h + delta; the absorbed query


def test_recorded_decisions_are_planned_when_the_run_verifies():
    s = Setup(GLM5, 1, budget=141 * GB, chunk_size=4096, pages_per_rank=2048)
    assert items_at(s, 2048)["decision_bytes"] == 0
    on = items_at(dataclasses.replace(s, record=True), 2048)["decision_bytes"]
    assert on == 75 * 4096 * 8 * 12 + 40 * 4096 * 2048 * 8  # MoE layers' route buffers, full layers' selections


def test_kv_b_proj_is_kept_in_the_compute_dtype_beside_its_split():
    """The loader's rule (``fp8_kept``): kv_b_proj never fp8; the layer keeps it and W_UK / W_UV, both bf16."""
    from cpkv.memplan import is_fp8_linear, weight_parts

    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert not is_fp8_linear(name, (64 * 448, 512)) and is_fp8_linear(name.replace("kv_b", "q_b"), (16384, 2048))
    parts = weight_parts(GLM5, "fp8", "bfloat16", 32)
    assert parts["mla_absorbed"] == 2 * absorbed(GLM5, 2)
    assert sum(v for k, v in parts.items() if k != "experts") == weight_bytes(GLM5, "fp8", "bfloat16").replicated


def test_a_pool_that_does_not_fit_names_pages_per_rank():
    from cpkv.memplan import refusal

    s = Setup(preset("tiny"), 2, budget=2 * GB, device="cpu", compute="float32", weights="bf16", chunk_size=512,
              pages_per_rank=10**6)
    why = refusal(plan_memory(s), "one GPU")
    most = plan_memory(dataclasses.replace(s, pages_per_rank=None)).pages
    assert f"lower --pages-per-rank (now 1000000; at most {most} fit)" in why
    assert refusal(plan_memory(dataclasses.replace(s, pages_per_rank=most)), "one GPU") is None
