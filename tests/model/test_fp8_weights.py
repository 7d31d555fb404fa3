"""fp8 weights kept fp8 (CPU): the block-scaled references against float64 matmuls of the dequantised operands,
the dispatch points' CPU path, ``--weights`` resolution, and an fp8 block checkpoint written from a tiny
transformers model that loads with its linear weights still fp8 and equals transformers run on the
dequantised weights (exact precision, 1e-3 of the largest |logit|).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpkv.engine.config import EngineConfig
from cpkv.errors import ConfigError
from cpkv.kernels.fp8_gemm.ref import (act_dequant_ref, act_quant_ref, dequant_blocks, fp8_linear_quant_ref,
                                       fp8_linear_ref, grouped_fp8_ref)
from cpkv.model.config import resolve_weights
from cpkv.model.experts import ExpertWeights, grouped_swiglu, grouped_swiglu_loop
from cpkv.model.linear import Linear, fp8_linear, quant_act
from cpkv.model.weights import FP8_QUANTIZATION_CONFIG, fp8_kept, quant_fp8_blocks

SHAPES = [(5, 256, 384), (33, 200, 300), (1, 128, 128), (0, 64, 256)]  # (M, N, K): whole and ragged blocks


def _fp8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quant_fp8_blocks(torch.randn(n, k, generator=gen) / k ** 0.5)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_linear_reference_is_the_float_matmul_of_dequantised_weights(m, n, k):
    w, s = _fp8(n, k, 1)
    assert s.shape == (-(-n // 128), -(-k // 128))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    want = x.double() @ (w.double() * s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).t()
    got = fp8_linear_ref(x, w, s)
    assert got.dtype == x.dtype and got.shape == (m, n)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fp8_linear(x, w, s), got)  # the dispatch point off CUDA is the reference
    assert torch.equal(Linear(w, s)(x), got)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_quantised_activation_gemm_within_fp8_error(m, n, k):
    """The block-scaled GEMM (activation quantised per 1 x 128 group) against the float64 product of the
    dequantised operands (exact up to float32 rounding) and against the unquantised activation (fp8 error)."""
    w, s = _fp8(n, k, 3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    q, xs = act_quant_ref(x)
    got = fp8_linear_quant_ref(q, xs, w, s)
    exact = act_dequant_ref(q, xs).double() @ dequant_blocks(w, s).double().t()
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
    if m:
        unq = x.double() @ dequant_blocks(w, s).double().t()
        assert (got.double() - unq).abs().max() <= 0.08 * unq.abs().max()


def test_activation_quantisation_groups():
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)) * 10
    x[2, 128:256] = 0  # a zero group: scale 0, values 0
    q, s = act_quant_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 3)
    assert s[2, 1] == 0 and torch.equal(q[2, 128:256].float(), torch.zeros(128))
    assert torch.allclose(s[:, 0], x[:, :128].abs().amax(1) / 448)
    err = (act_dequant_ref(q, s) - x).abs()
    assert (err <= s.repeat_interleave(128, 1)[:, :300] * 448 * 2 ** -4 + 1e-7).all()  # e4m3: 3 mantissa bits
    qa = quant_act(x)  # CPU: the reference, scales laid out outer-dim-major as torch._scaled_mm wants
    assert torch.equal(qa.q.float(), q.float()) and torch.equal(qa.s, s) and qa.s.stride() == (1, 8)  # rows padded to 4s
    dense = torch.randn(5, 300, generator=torch.Generator().manual_seed(6))
    assert torch.equal(Linear(dense)(qa), torch.nn.functional.linear(x, dense))  # a dense layer reads x itself


def test_linear_cat_keeps_whole_blocks():
    g, gs = _fp8(128, 256, 6)
    u, us = _fp8(128, 256, 7)
    both = Linear.cat([Linear(g, gs), Linear(u, us)])
    assert both.weight.shape == (256, 256) and both.scale.shape == (2, 2)
    assert torch.equal(both.dense(torch.float32)[128:], dequant_blocks(u, us))
    ragged = _fp8(64, 256, 8)
    assert Linear.cat([Linear(*ragged), Linear(u, us)]) is None  # a 64-row fp8 block would straddle


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [0, 7, 0, 0]])
def test_grouped_fp8_experts_off_cuda_equal_the_dequantised_loop(counts):
    e, d, i = len(counts), 256, 128
    gen = torch.Generator().manual_seed(9)
    gu = [quant_fp8_blocks(torch.randn(2 * i, d, generator=gen) / d ** 0.5) for _ in range(e)]
    dn = [quant_fp8_blocks(torch.randn(d, i, generator=gen) / i ** 0.5) for _ in range(e)]
    ew = ExpertWeights(torch.stack([a for a, _ in gu]), torch.stack([a for a, _ in dn]),
                       torch.stack([b for _, b in gu]), torch.stack([b for _, b in dn]))
    dense = ExpertWeights(dequant_blocks(ew.gate_up, ew.gate_up_scale), dequant_blocks(ew.down, ew.down_scale))
    rows = sum(counts) + 2  # two padding rows past offs[-1]
    xs = torch.randn(rows, d, generator=gen)
    rw = torch.rand(rows, generator=gen)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    got = grouped_swiglu(xs, offs, rw, ew)
    want = grouped_swiglu_loop(xs, offs, rw, dense)
    n = sum(counts)
    assert torch.allclose(got[:n], want[:n], rtol=1e-5, atol=1e-6)
    # the grouped fp8 reference (the GPU kernel's) on one GEMM
    q, s = act_quant_ref(xs)
    ref = grouped_fp8_ref(q, s, offs, ew.gate_up, ew.gate_up_scale)
    for x in range(e):
        lo, hi = int(offs[x]) - counts[x], int(offs[x])
        assert torch.allclose(ref[lo:hi], act_dequant_ref(q, s)[lo:hi] @ dense.gate_up[x].t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(ref[n:], torch.zeros(rows - n, 2 * i))


def _ckpt(tmp_path, quant: bool):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": FP8_QUANTIZATION_CONFIG} if quant else {"model_type": "deepseek_v32"}))
    return str(tmp_path)


def test_weights_mode_resolution(tmp_path):
    fp8_dir, bf16_dir = _ckpt(tmp_path / "a", True), _ckpt(tmp_path / "b", False)
    assert resolve_weights("auto", fp8_dir, "cuda", "fp8") == "fp8"
    assert resolve_weights("auto", fp8_dir, "cpu", "fp8") == "bf16"
    assert resolve_weights("auto", fp8_dir, "cuda", "exact") == "bf16"
    assert resolve_weights("auto", bf16_dir, "cuda", "fp8") == "bf16"
    assert resolve_weights("auto", "glm5", "cuda", "fp8") == "bf16"  # a preset has no fp8 checkpoint
    assert resolve_weights("fp8", "tiny", "cpu", "exact") == "fp8"  # asked: quantised at load
    assert resolve_weights("bf16", fp8_dir, "cuda", "fp8") == "bf16"
    with pytest.raises(ConfigError, match="weights must be one of"):
        resolve_weights("int4", "tiny", "cpu", "fp8")
    assert EngineConfig(model="tiny", weights="fp8").weights_dtype == "fp8"
    assert EngineConfig(model="tiny").weights_dtype == "bf16"


def test_fp8_kept_names():
    assert fp8_kept("model.layers.3.self_attn.q_a_proj.weight")
    assert fp8_kept("model.layers.3.mlp.experts.7.down_proj.weight")
    assert not fp8_kept("model.layers.3.self_attn.kv_b_proj.weight")  # split into W_UK / W_UV: dense
    assert not fp8_kept("model.layers.3.self_attn.indexer.weights_proj.weight")  # bf16 in the public files
    assert not fp8_kept("model.layers.3.mlp.gate.weight") and not fp8_kept("lm_head.weight")


# -- an fp8 block checkpoint from a transformers model --------------------------------------------------
HF = dict(vocab_size=96, hidden_size=256, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=3,
          num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=128,
          q_lora_rank=128, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=2, topk_group=1,
          num_experts_per_tok=2, index_topk=24, index_head_dim=32, index_n_heads=8, first_k_dense_replace=1,
          max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(dir, transformers' float32 last-token logits on the dequantised weights, tokens)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GlmMoeDsaConfig(**HF, index_topk_freq=2, index_skip_topk_offset=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * x if "norm" in name else 0.1 * x if name.endswith("bias")
                    else x if "embed" in name else x / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    path, deq = tmp_path_factory.mktemp("glm5_fp8"), tmp_path_factory.mktemp("glm5_dequantised")
    model.save_pretrained(path)
    model.save_pretrained(deq)
    _quantise_files(path, deq)
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(deq).float().eval()
    tokens = torch.randint(0, HF["vocab_size"], (70,), generator=gen)
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0, -1].float()
        assert float((model(tokens[None]).logits[0, -1] - ref).abs().max()) > 0  # the fp8 rounding is there
    return path, ref, tokens.tolist()


def _fp8_file(name: str) -> bool:
    """Stored fp8 in the test's checkpoint: every fp8_kept weight and kv_b_proj, but the indexer's wk, which
    this checkpoint keeps dense (a weight the release leaves in bf16 stays dense when loaded)."""
    return (fp8_kept(name) or name.endswith("kv_b_proj.weight")) and not name.endswith("indexer.wk.weight")


def _quantise_files(path, deq) -> None:
    """Rewrite the checkpoint at ``path`` as the FP8 releases ship it (float8 + ``weight_scale_inv``, and
    config.json's quantization_config), and the one at ``deq`` with the dequantised values of those weights
    (what transformers runs)."""
    for file in path.glob("*.safetensors"):
        tensors, dense = load_file(file), load_file(deq / file.name)
        for name in [n for n in tensors if _fp8_file(n)]:
            q, s = quant_fp8_blocks(tensors[name])
            tensors[name], tensors[name + "_scale_inv"] = q, s
            dense[name] = dequant_blocks(q, s)
        save_file(tensors, str(file), metadata={"format": "pt"})
        save_file(dense, str(deq / file.name), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        raw = json.loads(index.read_text())
        raw["weight_map"].update({k + "_scale_inv": f for k, f in list(raw["weight_map"].items()) if _fp8_file(k)})
        index.write_text(json.dumps(raw))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_fp8_checkpoint_equals_transformers_on_dequantised_weights(fp8_checkpoint, weights):
    from cpkv.model.model import load_model

    path, ref, tokens = fp8_checkpoint
    m = load_model(str(path), precision="exact", weights=weights)
    layer = m.layers[1]  # a MoE layer
    if weights == "fp8":  # kept fp8: attention, dense MLP, shared and routed experts; kv_b_proj and wk dense
        assert m.weights_dtype == "fp8"
        full = next(x for x in m.layers if x.full)
        assert {k for k, lin in full.lin.items() if not lin.fp8} == {"self_attn.indexer.wk"}
        assert all(lin.fp8 for lin in layer.lin.values())
        assert layer.moe.fp8 and layer.shared_mlp[0].fp8
        gate_up = m.layers[0].dense_mlp[0]
        assert gate_up.fp8 and gate_up.weight.shape == (2 * HF["intermediate_size"], 256)
        assert layer.w_uk.dtype == torch.float32
    else:
        assert m.weights_dtype == "float32" and not layer.moe.fp8
    got = m.reference_prefill(tokens)
    diff = float((got - ref).abs().max())
    assert diff <= 1e-3 * float(ref.abs().max()), diff
    assert int(got.argmax()) == int(ref.argmax())


def test_auto_weights_on_cpu_load_dense(fp8_checkpoint):
    from cpkv.model.model import load_model

    path, _, _ = fp8_checkpoint
    assert EngineConfig(model=str(path), weights="auto", device="cpu").weights_dtype == "bf16"
    assert load_model(str(path), weights="auto", num_layers=1).weights_dtype == "float32"


def test_run_with_fp8_weights_on_cpu(capsys):
    """``--weights fp8`` on CPU: a preset quantised at load, run through the dequantising path, verified
    against the single-rank reference with the same weights; the summary says fp8."""
    from cpkv.cli import main

    assert main(["run", "--model", "tiny", "--num-layers", "2", "--cp", "2", "--requests", "2", "--weights", "fp8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights_dtype"] == "fp8" and out["verify"]["ok"]
    with pytest.raises(SystemExit) as exc:
        main(["run", "--model", "tiny", "--weights", "int4"])
    assert exc.value.code == 2 and "--weights" in capsys.readouterr().err


def _scaled_mm_as_torch_checks_it(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's block-scaled route, emulated: the layout checks of ATen's ScaledBlas.cpp
    (is_blockwise_1x128_scaling on a, is_blockwise_128x128_scaling on b^T with scale_b^T), then the math."""
    m, k = a.shape
    n, g = b.shape[1], -(-k // 128)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride(1) == 1 and b.stride(0) == 1  # A row-, B col-major
    assert scale_a.dtype == torch.float32 and scale_a.shape == (m, g) and scale_a.stride() == (1, m)
    sb = scale_b.t()
    assert sb.dtype == torch.float32 and sb.shape == (-(-n // 128), g) and sb.stride() == (g, 1)
    return (act_dequant_ref(a, scale_a) @ dequant_blocks(b.t(), sb).t()).to(out_dtype)


@pytest.mark.parametrize("m", [1, 77, 256])
def test_scaled_mm_call_meets_the_block_layout_checks(monkeypatch, m):
    """The ``_scaled_mm`` path run on the CPU with torch's kernel replaced by its checks and math: the
    operands, strides and scale layouts it passes are the ones the block-scaled route accepts, and the
    result is the block-scaled product (dense layer and the fused MLP)."""
    from cpkv.model import linear as lin

    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_as_torch_checks_it, raising=False)
    monkeypatch.setattr(lin, "scaled_mm_ok", lambda x, w: x.dtype == torch.bfloat16 and w.dtype == torch.float8_e4m3fn)
    w, s = _fp8(576, 1024, 10)
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    got = Linear(w, s)(x)
    q, xs = act_quant_ref(x)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), fp8_linear_quant_ref(q, xs, w, s), rtol=1e-2,
                                                          atol=1e-2)
    gu, gus = _fp8(512, 1024, 12)
    dn, dns = _fp8(1024, 256, 13)
    out = lin.swiglu(x, Linear(gu, gus), Linear(dn, dns))
    g, u = fp8_linear_quant_ref(q, xs, gu, gus).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(g) * u) @ dequant_blocks(dn, dns).t()
    assert (out.float() - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.parametrize("m", [1, 3, 4, 6])
def test_scaled_mm_operands_padded_to_four_rows(m):
    """cuBLAS refuses a block-scale matrix whose leading dimension is not a multiple of 4 (one decode token):
    ``_padded`` hands it the quantised buffers' own padding rows (no copy), else a zero-padded copy; the first
    m rows are the activation's either way."""
    from cpkv.model.linear import _padded, empty_quant

    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    q, s = act_quant_ref(x)
    m4 = max(4, -(-m // 4) * 4)
    bq, bs = empty_quant(m, 256, torch.device("cpu"))
    bq.copy_(q)
    bs.copy_(s)
    for src_q, src_s in ((bq, bs), (q, s.t().contiguous().t())):
        pq, ps = _padded(src_q, src_s)
        assert pq.shape == (m4, 256) and ps.shape == (m4, 2) and ps.stride() == (1, m4)
        assert torch.equal(pq[:m].float(), q.float()) and torch.equal(ps[:m], s)
    assert _padded(bq, bs)[0].data_ptr() == bq.data_ptr()  # the buffer's own rows: no copy


@pytest.mark.parametrize("fp8", [False, True])
def test_a_model_built_from_a_dict_it_consumes_holds_no_tensor_twice(fp8):
    """``DSAModel(..., consume=True)`` (what ``random`` and ``from_pretrained`` do) empties the dict it is given
    and keeps no per-expert tensor once a layer has stacked them: building the model never holds the routed
    experts twice (at GLM-5 cp 8 that would be 181 GB of fp8 experts on a 141 GB GPU). The result is the same
    model as one built from a copy."""
    import dataclasses

    from cpkv.config import PRESETS
    from cpkv.model.model import DSAModel
    from cpkv.model.weights import random_weights, save_checkpoint  # noqa: F401

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=2)
    kept = random_weights(cfg, seed=3)
    given = dict(kept)
    a = DSAModel(cfg, given, fp8=fp8, consume=True)
    assert given == {}
    assert not any(".mlp.experts." in k for k in a.weights)
    b = DSAModel(cfg, kept, fp8=fp8)  # not consumed: the caller's dict stays whole
    assert len(kept) > 0 and any(".mlp.experts." in k for k in kept)
    for la, lb in zip(a.layers, b.layers):
        if la.moe is not None:
            assert torch.equal(la.moe.gate_up, lb.moe.gate_up) and torch.equal(la.moe.down, lb.moe.down)
    assert torch.equal(a.reference_prefill([1, 2, 3, 4]), b.reference_prefill([1, 2, 3, 4]))


def test_scaled_mm_out_of_memory_is_raised_not_taken_for_a_refused_layout(monkeypatch):
    """An OOM in torch._scaled_mm re-raises: the dequantising fallback would allocate more and hide it; the weight
    shape is not remembered as refused."""
    import cpkv.model.linear as lin

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")

    monkeypatch.setattr(torch, "_scaled_mm", oom)
    w, s = quant_fp8_blocks(torch.randn(256, 512))
    x = lin.QuantAct(*lin.act_quant_ref(torch.randn(8, 512)), dtype=torch.float32)
    with pytest.raises(torch.OutOfMemoryError):
        lin._scaled_mm(x, w, s)
    assert (256, 512) not in lin._SCALED_MM_FAILED
