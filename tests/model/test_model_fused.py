"""The fused forms of the model layer's elementwise work equal the unfused forms they replace.

RMSNorm through ``F.rms_norm`` and the interleaved RoPE as one complex product are bit-identical on CPU to
the separate float32 passes (``rms_norm_ref``, ``Rotary.interleaved_ref``); the layer that writes its
query, token-KV rows and attention output into preallocated slices (no cat, no reshape copy) gives the
same bytes and logits as the stack/cat/einsum layer it replaced (``_UnfusedLayer`` below). On CUDA the
fused kernels may contract products into FMAs or reduce in another order: RMSNorm within bf16 eps x |value|
(1 to 2 ulp), RoPE in float32 within 2^-18 absolute for values of order 1, and its bf16 form within 1 bf16 ulp.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cpkv.config import RopeConfig
from cpkv.model import precision as precision_mod
from cpkv.model.config import load_model_config
from cpkv.model.layer import DSALayer
from cpkv.model.model import DSAModel, precision_config
from cpkv.model.ops import Rotary, rms_norm, rms_norm_ref
from cpkv.model.precision import LATENT_NORM_EPS, ExactPrecision

DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 512, 6144])
def test_rms_norm_fused_equals_the_float32_passes(dtype, d):
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(67, d, generator=gen) * 5).to(dtype)
    w = (torch.randn(d, generator=gen) + 1).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    # a float32 weight on bf16 x (dtypes differ) keeps the pass form
    assert torch.equal(rms_norm(x, w.float(), 1e-5), rms_norm_ref(x, w.float(), 1e-5))


def _rotary(t: int, r: int, yarn: bool) -> Rotary:
    rope = RopeConfig(theta=10000.0, type="yarn", factor=40.0, original_max_position_embeddings=4096,
                      mscale=1.0, mscale_all_dim=1.0) if yarn else RopeConfig(theta=1e6)
    return Rotary.build(torch.arange(t) * 97 + 5, r, rope)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("yarn", [False, True])
def test_rope_without_stack_or_cat_is_bit_identical(dtype, yarn):
    t, h, r = 83, 5, 64
    rot = _rotary(t, r, yarn)
    q = (torch.randn(t, h, 192 + r) * 3).to(dtype)[..., 192:]  # a strided view, as the query's rope part
    k = (torch.randn(t, 128 + r) * 3).to(dtype)[:, 128:]
    for x in (q, k):
        ref = rot.interleaved_ref(x)
        assert torch.equal(rot.interleaved(x), ref)
        out = torch.full((*x.shape[:-1], 2 * r), float("nan"))
        rot.interleaved(x, out=out[..., r:])  # float32 slice: the complex product written in place
        assert torch.equal(out[..., r:], ref) and out[..., :r].isnan().all()
        low = torch.zeros(*x.shape[:-1], r + 3, dtype=torch.bfloat16)
        rot.interleaved(x, out=low[..., 3:])  # bf16 slice, at an odd offset: rounded once from float32
        assert torch.equal(low[..., 3:], ref.to(torch.bfloat16)) and not low[..., :3].any()
        assert torch.equal(rot.halves(x), rot.halves_ref(x))
        out = torch.zeros(*x.shape[:-1], 2 * r)
        rot.halves(x, out=out[..., :r])
        assert torch.equal(out[..., :r], rot.halves_ref(x)) and not out[..., r:].any()


class _UnfusedExact(ExactPrecision):
    """The exact path's unfused forms: float32 cat of the token KV, cat in the indexer RoPE."""

    def token_kv(self, kv, norm_weight, rot):
        kr = self.cfg.kv_lora_rank
        latent = rms_norm_ref(kv[:, :kr], norm_weight, LATENT_NORM_EPS)
        return torch.cat((latent.float(), rot.interleaved_ref(kv[:, kr:])), dim=1)

    def rope_first(self, x, rot):
        r = self.cfg.qk_rope_head_dim
        turn = rot.interleaved_ref if self.cfg.indexer_rope == "interleaved" else rot.halves_ref
        return torch.cat((turn(x[..., :r]), x[..., r:].float()), dim=-1)


class _UnfusedLayer(DSALayer):
    """The layer's unfused forms: cat of the query, einsum + reshape for the attention output (and the exact
    path's of ``_UnfusedExact``); RMSNorm as separate float32 passes where the test patches it in."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.exact:
            self.precision = _UnfusedExact(self.cfg, self.backends)

    def _query(self, qr, rot, out=None):
        cfg = self.cfg
        q = F.linear(qr, self.w["self_attn.q_b_proj.weight"]).view(
            qr.shape[0], cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        q_lat = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)
        dtype = self.precision.query_dtype
        q = torch.cat((q_lat.float(), rot.interleaved_ref(q_rope)), dim=-1).to(dtype)
        return q if out is None else out.copy_(q)

    def _latent_out(self, latent):
        return torch.einsum("thc,hvc->thv", latent, self.w_uv).reshape(latent.shape[0], -1)


@pytest.mark.parametrize("spec", ["tiny", "deepseek-v32"])
@pytest.mark.parametrize("precision", ["fp8", "exact"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layer_gives_the_unfused_bytes(spec, precision, dtype, monkeypatch):
    cfg = load_model_config(spec, 2)
    if spec != "tiny":  # DeepSeek-V3.2's structure (halves indexer RoPE, YaRN) at toy sizes
        cfg = dataclasses.replace(cfg, **{"hidden_size": 128, "num_heads": 4, "q_lora_rank": 64,
                               "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
                               "v_head_dim": 32, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 16,
                               "intermediate_size": 128, "vocab_size": 256, "moe_intermediate_size": 32,
                               "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
                                   "first_k_dense_replace": 1})
    model = DSAModel.random(cfg, seed=3, dtype=dtype)
    model.cfg = cfg = precision_config(cfg, precision, dtype)
    fused = [DSALayer(cfg, model.weights | _experts(layer), layer.n) for layer in model.layers]
    unfused = [_UnfusedLayer(cfg, model.weights | _experts(layer), layer.n) for layer in model.layers]
    tokens = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    model.layers = fused
    want_fused = model.reference_prefill(tokens)
    t = len(tokens)
    rot = model.rotary(torch.arange(t))
    h = model.embed(torch.tensor(tokens))
    for a, b in zip(fused, unfused):
        pa = a.project(h, rot)
        with monkeypatch.context() as m:
            m.setattr(precision_mod, "rms_norm", rms_norm_ref)
            pb = b.project(h, rot)
        for name in ("q", "token", "index", "iq", "iw"):
            x, y = getattr(pa, name), getattr(pb, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
    model.layers = unfused
    with monkeypatch.context() as m:
        m.setattr(precision_mod, "rms_norm", rms_norm_ref)
        want_unfused = model.reference_prefill(tokens)
    assert torch.equal(want_fused, want_unfused)


def _experts(layer: DSALayer) -> dict[str, torch.Tensor]:
    """The routed experts a built layer stacked (and dropped from the weights), as per-expert weights again."""
    if layer.moe is None:
        return {}
    gate_up, down = layer.moe.gate_up, layer.moe.down
    i, p = gate_up.shape[1] // 2, f"model.layers.{layer.n}.mlp.experts."
    out = {}
    for e in range(gate_up.shape[0]):
        out[f"{p}{e}.gate_proj.weight"] = gate_up[e, :i]
        out[f"{p}{e}.up_proj.weight"] = gate_up[e, i:]
        out[f"{p}{e}.down_proj.weight"] = down[e]
    return out


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
def test_fused_forms_on_cuda_within_tolerance():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4099, 6144, generator=gen, device="cuda").mul_(4).bfloat16()
    w = (torch.randn(6144, generator=gen, device="cuda") + 1).bfloat16()
    got, ref = rms_norm(x, w, 1e-5).float(), rms_norm_ref(x, w, 1e-5).float()
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(2 ** -126)  # 1 ulp at each value (upper bound)
    assert ((got - ref).abs() <= ulp).all()
    rot = Rotary.build(torch.arange(4099, device="cuda") * 31, 64, RopeConfig(theta=1e6))
    q = torch.randn(4099, 64, 256, generator=gen, device="cuda").bfloat16()[..., 192:]
    a, b = rot.interleaved(q), rot.interleaved_ref(q)
    torch.testing.assert_close(a, b, rtol=2 ** -20, atol=2 ** -18)
    out = torch.empty(4099, 64, 576, dtype=torch.bfloat16, device="cuda")
    rot.interleaved(q, out=out[..., 512:])
    torch.testing.assert_close(out[..., 512:].float(), b.to(torch.bfloat16).float(), rtol=2 ** -7, atol=2 ** -20)


def test_index_scales_equal_amax_of_abs():
    from cpkv.indexer.quant import _amax_scale

    x = torch.randn(37, 4, 128, generator=torch.Generator().manual_seed(2)) * 7
    x[3, 1] = 0  # a zero row keeps MIN_SCALE
    for v in (x, x.bfloat16()):
        amax = v.float().abs().amax(dim=-1)
        assert torch.equal(_amax_scale(v), (amax / torch.full_like(amax, 448.0)).clamp_(min=1e-10))


@pytest.mark.cuda
@cuda
def test_fused_layer_on_cuda_within_tolerance():
    """The batched GEMMs writing strided slices (query, attention output) and the fused norms on the GPU give
    the unfused layer's query and logits within bf16 / fp8 rounding (tiny preset, bf16, fp8 rows)."""
    cfg = load_model_config("tiny", 3)
    model = DSAModel.random(cfg, seed=5, device="cuda")
    fused = model.layers
    unfused = [_UnfusedLayer(cfg, model.weights | _experts(layer), layer.n) for layer in fused]
    tokens = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    rot = model.rotary(torch.arange(len(tokens), device="cuda"))
    h = model.embed(torch.tensor(tokens, device="cuda"))
    qa, qb = fused[0].project(h, rot).q.float(), unfused[0].project(h, rot).q.float()
    torch.testing.assert_close(qa, qb, rtol=2 ** -6, atol=2 ** -6 * qb.abs().max().item())
    got = model.reference_prefill(tokens)
    model.layers = unfused
    want = model.reference_prefill(tokens)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
