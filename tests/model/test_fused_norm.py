"""The layer's fused forms on CPU (their torch paths): add + RMSNorm (+ quantisation), the token-row dispatch and
the deferred residual give the bytes of the ops they replace.

The Triton kernels behind them run under the interpreter in tests/kernels/test_fused_interpret.py and on the GPU
in tests/kernels/test_fused_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from cpkv.attention import quant_token_kv, token_rows
from cpkv.kernels.fp8_gemm.ref import act_quant_ref
from cpkv.model.config import load_model_config
from cpkv.model.linear import Linear, QuantAct, quant_act
from cpkv.model.model import DSAModel, precision_config
from cpkv.model.ops import add_rms_norm, rms_norm
from cpkv.model.precision import ExactPrecision


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_add_then_norm_then_quant(dtype):
    gen = torch.Generator().manual_seed(4)
    h, delta = (torch.randn(2, 9, 384, generator=gen) * 3).to(dtype)
    w = (torch.randn(384, generator=gen) + 1).to(dtype)
    hs, x, qa = add_rms_norm(h, delta, w, 1e-5, quant=True)
    assert torch.equal(hs, h + delta) and torch.equal(x, rms_norm(h + delta, w, 1e-5))
    q, s = act_quant_ref(x)
    assert isinstance(qa, QuantAct) and qa.x is x and torch.equal(qa.s, s)
    assert torch.equal(qa.q.view(torch.uint8), q.view(torch.uint8))
    hs, x2, none = add_rms_norm(h, None, w, 1e-5)
    assert hs is h and none is None and torch.equal(x2, rms_norm(h, w, 1e-5))


def test_prepare_keeps_a_quantised_input():
    x = torch.randn(4, 512)
    qa = quant_act(x)
    lin = Linear(torch.randn(16, 512))
    assert lin.quantised_input(qa) is qa and lin.quantised_input(x) is x and not lin.quantises(x)


def test_token_rows_dispatch_equals_the_layer_s_former_path():
    """rms_norm + the complex-product RoPE + quant_token_kv (the path the dispatch replaced) give its bytes."""
    cfg = load_model_config("tiny", 1)
    model = DSAModel.random(cfg, seed=2)
    layer, t = model.layers[0], 23
    rot = model.rotary(torch.arange(t) * 5)
    kv = torch.randn(t, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=torch.Generator().manual_seed(1)) * 3
    kv[1, :128] = 0
    w = layer.w["self_attn.kv_a_layernorm.weight"]
    exact = ExactPrecision(precision_config(cfg, "exact", torch.float32), layer.backends)
    want = quant_token_kv(exact.token_kv(kv, w, rot), cfg.token_format)
    assert torch.equal(token_rows(kv, w, rot.cos, rot.sin, 1e-6, cfg.token_format), want)


@pytest.mark.parametrize("spec", ["tiny", "glm5"])
def test_deferred_residual_equals_the_added_one(spec):
    """project(h, rot, delta) sees h + delta; attend_split's h + MLP output is attend's output."""
    cfg = load_model_config(spec, 2) if spec == "tiny" else _small_glm5()
    model = DSAModel.random(cfg, seed=6)
    from cpkv.model.layer import AttnPlan

    t = 12
    rot = model.rotary(torch.arange(t))
    plan = AttnPlan.build([0] * t, list(range(1, t + 1)), cfg.index_topk, "cpu")
    h = model.embed(torch.arange(t) % cfg.vocab_size)
    delta = torch.randn(h.shape, generator=torch.Generator().manual_seed(3))
    a, b = model.layers
    pa = a.project(h, rot, delta)
    pb = a.project(h + delta, rot)
    assert torch.equal(pa.h, h + delta) and torch.equal(pa.token, pb.token) and torch.equal(pa.q, pb.q)
    dense = {"token": pa.token, "index": pa.index}
    hs, out, topk = a.attend_split(pa.h, pa, dense, plan)
    whole, topk2 = a.attend(pa.h, pa, dense, plan)
    assert torch.equal(hs + out, whole)
    p2 = b.project(hs, rot, out)
    assert torch.equal(p2.q, b.project(whole, rot).q)


def _small_glm5():
    import dataclasses

    cfg = load_model_config("glm5", 2)
    return dataclasses.replace(cfg, hidden_size=128, num_heads=4, q_lora_rank=64, kv_lora_rank=128,
                               qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, index_n_heads=4,
                               index_head_dim=64, index_topk=16, intermediate_size=128, vocab_size=256,
                               moe_intermediate_size=32, n_routed_experts=8, n_group=2, topk_group=1,
                               num_experts_per_tok=2, first_k_dense_replace=1)


@pytest.mark.parametrize("interleaved", [True, False])
def test_index_refs_equal_the_indexer_quantisation(interleaved):
    """The fused indexer op's reference (its own copy of the quantisation rule) gives the bytes of the layer's
    former path: LayerNorm, RoPE on the first dims, hadamard_rotate, quantize_index_keys / quantize_queries;
    and the dispatch on CPU is that reference."""
    from cpkv.indexer import prepare_index_keys, prepare_index_queries, quantize_index_keys, quantize_queries
    from cpkv.model.ops import Rotary, hadamard_rotate, layer_norm

    gen = torch.Generator().manual_seed(7)
    t, h, d, r = 11, 4, 128, 64
    rot = Rotary.build(torch.arange(t) * 3, r, 10000.0)
    turn = rot.interleaved if interleaved else rot.halves
    k = torch.randn(t, d, generator=gen).bfloat16()
    k[2] = 0  # LayerNorm of a constant row: the bias
    w, b = torch.randn(d, generator=gen).bfloat16(), torch.randn(d, generator=gen).bfloat16()
    q = torch.randn(t, h, d, generator=gen).bfloat16()
    wts = torch.rand(t, h, generator=gen)

    def first(x):
        out = x.float().clone()
        turn(x[..., :r], out=out[..., :r])
        return out

    want_rows = quantize_index_keys(hadamard_rotate(first(layer_norm(k, w, b))))
    assert torch.equal(prepare_index_keys(k, w, b, rot.cos, rot.sin, r, interleaved), want_rows)
    want_q, want_w = quantize_queries(hadamard_rotate(first(q)), wts)
    got_q, got_w = prepare_index_queries(q, wts, rot.cos, rot.sin, r, interleaved)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(got_w, want_w)
