"""GPU tests of the fused elementwise kernels at GLM-5 shapes (skip without CUDA or Triton), T = 1, 77, 4096.

    add + RMSNorm (+ fp8 quantisation), D 6144: h + delta equal to torch's add; x within one bf16 ulp of the
    float64 RMSNorm (the kernel's float32 value is within a few float32 ulps of it, then rounded once); q / s
    bytes equal to ``act_quant_ref`` and to the Triton ``act_quant`` of the kernel's x, scales outer-dim-major.
    token rows (656 B): rope bytes equal to the reference's separate float32 products; the latent within one
    bf16 ulp of the float64 RMSNorm; row bytes equal to ``quant_token_kv`` of the kernel's own values.
    indexer keys / queries: scales within 2e-5, fp8 within one e4m3 step; head weights within 2^-20 of the sum
    of |products|; the bf16 experts' activation equal at >= 99.9 % (within 4 ulps), the MoE combine within one
    bf16 ulp of its sum (and one of the add); the MoE's gather of
    quantised rows bit-identical to quantising the gathered rows.
No device->host synchronisation in any of them (torch's sync debug mode set to error on the second call).
"""
from __future__ import annotations

import pytest
import torch
from sync_free import sync_free

from cpkv.attention.ref import GLM5_TOKEN, quant_token_kv_ref, row_views
from cpkv.kernels.fp8_gemm.ref import act_quant_ref

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)

TOKENS = [1, 77, 4096]


def _within_ulp(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> bool:
    """Every value of got within ``ulps`` bf16 ulps of want (bf16)."""
    w = want.float()
    _, e = torch.frexp(w)
    ulp = torch.ldexp(torch.ones_like(w), e - 8).clamp(min=2.0 ** -126)
    return bool(((got.float() - w).abs() <= ulps * ulp).all())


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("quant", [True, False])
def test_add_rms_norm_kernel(t, with_delta, quant):
    from cpkv.model.linear import quant_act
    from cpkv.model.ops import add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(t)
    d = 6144
    h = (torch.randn(t, d, generator=gen, device="cuda") * 3).bfloat16()
    delta = (torch.randn(t, d, generator=gen, device="cuda") * 2).bfloat16() if with_delta else None
    if with_delta:
        delta[0, :128] = -h[0, :128]  # a zero group after the add
    w = (torch.randn(d, generator=gen, device="cuda") * 0.3 + 1).bfloat16()
    add_rms_norm(h, delta, w, 1e-5, quant)  # compiles
    hs, x, qa = sync_free(lambda: add_rms_norm(h, delta, w, 1e-5, quant))
    want_h = h + delta if with_delta else h
    assert torch.equal(hs, want_h)
    assert _within_ulp(x, _rms64(want_h, w, 1e-5).to(torch.bfloat16))
    assert (qa is not None) == quant
    if quant:
        q, s = act_quant_ref(x)
        assert qa.s.stride() == (1, max(4, -(-t // 4) * 4)) and qa.x is x
        assert torch.equal(qa.s, s) and torch.equal(qa.q.view(torch.uint8), q.view(torch.uint8))
        other = quant_act(x)
        assert torch.equal(qa.s, other.s) and torch.equal(qa.q.view(torch.uint8), other.q.view(torch.uint8))
        if with_delta:
            assert qa.s[0, 0] == 0


@pytest.mark.parametrize("t", TOKENS)
def test_token_rows_kernel(t):
    from cpkv.attention import token_rows
    from cpkv.config import RopeConfig
    from cpkv.kernels.token_rows import triton as kern
    from cpkv.kernels.token_rows.ref import token_kv_ref
    from cpkv.model.ops import Rotary

    gen = torch.Generator(device="cuda").manual_seed(100 + t)
    kv = (torch.randn(t, 576, generator=gen, device="cuda") * 4).bfloat16()
    kv[0, 128:256] = 0
    w = (torch.randn(512, generator=gen, device="cuda") * 0.3 + 1).bfloat16()
    rope = RopeConfig(theta=10000.0, type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                      mscale_all_dim=1.0)
    rot = Rotary.build(torch.arange(t, device="cuda") * 7 + 3, 64, rope)
    rows = sync_free(lambda: token_rows(kv, w, rot.cos, rot.sin, 1e-6, GLM5_TOKEN))
    mine = torch.zeros_like(rows)
    out = torch.empty(t, 576, dtype=torch.bfloat16, device="cuda")
    kern.token_rows(kv, w, rot.cos, rot.sin, 1e-6, *row_views(mine, GLM5_TOKEN), out=out)
    assert torch.equal(rows, mine)
    want = token_kv_ref(kv, w, rot.cos, rot.sin, 1e-6)
    assert torch.equal(out[:, 512:], want[:, 512:])  # rope: the same float32 products and sums, one rounding
    assert _within_ulp(out[:, :512], _rms64(kv[:, :512], w, 1e-6).to(torch.bfloat16))
    assert torch.equal(rows, quant_token_kv_ref(out, GLM5_TOKEN))
    assert row_views(rows, GLM5_TOKEN)[1][0, 1] == 0  # the zero group's scale


def _near_fp8(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within one e4m3 step, at most 2 % of the values differing."""
    g, w = got.float(), want.float()
    return bool(((g - w).abs() <= w.abs() * 2.0 ** -3 + 2.0 ** -9).all()) and float((g != w).float().mean()) <= 0.02


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)).max())


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("interleaved", [True, False])
def test_index_rows_kernels(t, interleaved):
    """GLM-5's indexer (32 heads of 128, RoPE on the first 64 dims): keys and queries within the stated tolerance
    of the torch ops (LayerNorm's and the Hadamard product's sums run in another order): scales and folded
    weights within 2e-5 relative, fp8 values within one e4m3 step."""
    from cpkv.indexer import dequantize_index_rows, prepare_index_keys, prepare_index_queries
    from cpkv.kernels.index_rows.ref import index_keys_ref, index_queries_ref
    from cpkv.model.ops import Rotary

    gen = torch.Generator(device="cuda").manual_seed(200 + t)
    rot = Rotary.build(torch.arange(t, device="cuda") * 13, 64, 10000.0)
    k = (torch.randn(t, 128, generator=gen, device="cuda") * 2).bfloat16()
    w = (torch.randn(128, generator=gen, device="cuda") * 0.2 + 1).bfloat16()
    b = (torch.randn(128, generator=gen, device="cuda") * 0.1).bfloat16()
    q = (torch.randn(t, 32, 128, generator=gen, device="cuda") * 2).bfloat16()
    wts = torch.rand(t, 32, generator=gen, device="cuda") + 0.1
    args = (rot.cos, rot.sin, 64, interleaved)
    prepare_index_keys(k, w, b, *args), prepare_index_queries(q, wts, *args)  # compile
    rows = sync_free(lambda: prepare_index_keys(k, w, b, *args))
    q8, folded = sync_free(lambda: prepare_index_queries(q, wts, *args))
    got_k, got_s = dequantize_index_rows(rows)
    want_k, want_s = dequantize_index_rows(index_keys_ref(k, w, b, *args))
    assert _rel(got_s, want_s) <= 2e-5 and _near_fp8(got_k, want_k)
    want_q, want_w = index_queries_ref(q, wts, *args)
    assert _rel(folded, want_w) <= 2e-5 and _near_fp8(q8, want_q)


@pytest.mark.parametrize("n", [1, 77, 4096])
def test_swiglu_weighted_kernel(n):
    """The bf16 experts' activation (GLM-5: I 2048): libdevice's expf as torch's SiLU, the same three roundings:
    equal to ``F.silu(g).mul_(u).mul_(rw)`` at >= 99.9 % of the values (expected: everywhere) and within 4 bf16
    ulps everywhere (a SiLU one ulp off moves the two rounded products after it by a few ulps at most)."""
    from cpkv.kernels.swiglu.ref import swiglu_weighted_ref
    from cpkv.model.experts import swiglu_weighted

    gen = torch.Generator(device="cuda").manual_seed(300 + n)
    gu = (torch.randn(n, 4096, generator=gen, device="cuda") * 3).bfloat16()
    rw = torch.rand(n, generator=gen, device="cuda")
    swiglu_weighted(gu, rw)
    got = sync_free(lambda: swiglu_weighted(gu, rw))
    want = swiglu_weighted_ref(gu, rw)
    assert _within_ulp(got, want, 4) and float((got == want).float().mean()) >= 0.999


@pytest.mark.parametrize("n", [1, 77, 4096])
def test_swiglu_plain_kernel_is_torchs_bytes(n):
    """The dense MLPs' activation (no row weights): equal to ``F.silu(g) * u`` at >= 99.9 % of the values and
    within 2 bf16 ulps everywhere, and ``model.linear.swiglu`` runs it (no host sync)."""
    from cpkv.kernels.swiglu import triton as kern
    from cpkv.kernels.swiglu.ref import swiglu_ref

    gen = torch.Generator(device="cuda").manual_seed(400 + n)
    gu = (torch.randn(n, 2 * 6144, generator=gen, device="cuda") * 3).bfloat16()
    got = torch.empty(n, 6144, dtype=torch.bfloat16, device="cuda")
    sync_free(lambda: kern.swiglu_weighted(gu, None, got))
    want = swiglu_ref(gu)
    assert _within_ulp(got, want, 2) and float((got == want).float().mean()) >= 0.999


@pytest.mark.parametrize("t", [1, 77, 1000])
def test_moe_gathers_the_quantised_rows(t):
    """fp8 experts given x's quantised rows (the fused norm's QuantAct) gather them per (token, expert) pair instead
    of gathering x and quantising again: the same bytes into the grouped GEMMs, so the same output bit for bit."""
    from cpkv.model.experts import ExpertWeights
    from cpkv.model.linear import quant_act
    from cpkv.model.moe import experts
    from cpkv.model.weights import quant_fp8_blocks

    gen = torch.Generator(device="cuda").manual_seed(400 + t)
    e, d, i, k = 8, 6144, 2048, 4

    def stack(n, kk):
        pairs = [quant_fp8_blocks(torch.randn(n, kk, generator=gen, device="cuda") / kk ** 0.5) for _ in range(e)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    (gu, gus), (dn, dns) = stack(2 * i, d), stack(d, i)
    ew = ExpertWeights(gu, dn, gus, dns)
    x = torch.randn(t, d, generator=gen, device="cuda").bfloat16()
    idx = torch.randint(0, e, (t, k), generator=gen, device="cuda")
    w = torch.rand(t, k, generator=gen, device="cuda")
    qa = quant_act(x)
    want = experts(x, idx, w, ew)
    got = sync_free(lambda: experts(x, idx, w, ew, xq=(qa.q, qa.s)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("t", TOKENS)
def test_head_weights_kernel(t):
    """The indexer's head weights (GLM-5: [T, 6144] bf16 x float32 [32, 6144]) without a float32 copy of x: within
    float32 rounding of cuBLAS's float32 GEMM (2^-20 of the sum of |products|)."""
    from cpkv.indexer import head_weights
    from cpkv.kernels.index_rows.ref import head_weights_ref

    gen = torch.Generator(device="cuda").manual_seed(500 + t)
    x = torch.randn(t, 6144, generator=gen, device="cuda").bfloat16()
    w = torch.randn(32, 6144, generator=gen, device="cuda") / 80
    head_weights(x, w, 32 ** -0.5)
    got = sync_free(lambda: head_weights(x, w, 32 ** -0.5))
    want = head_weights_ref(x, w, 32 ** -0.5)
    bound = (x.float().abs() @ w.abs().t()) * 32 ** -0.5 * 2.0 ** -20
    assert got.dtype == torch.float32 and bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("with_add", [True, False])
def test_combine_kernel(t, with_add):
    """GLM-5's combine (k 8, D 6144): each token's 8 rows gathered and summed in one kernel, within one bf16 ulp of
    torch's gather + reduction (its float32 sum pairs the rows in another order), then one of the add."""
    from cpkv.kernels.combine.ref import combine_ref
    from cpkv.model.moe import combine_pairs

    gen = torch.Generator(device="cuda").manual_seed(600 + t)
    k, d = 8, 6144
    y = torch.randn(t * k, d, generator=gen, device="cuda").bfloat16()
    order = torch.randperm(t * k, generator=gen, device="cuda")
    add = torch.randn(t, d, generator=gen, device="cuda").bfloat16() if with_add else None
    combine_pairs(y, order, t, k, add)
    got = sync_free(lambda: combine_pairs(y, order, t, k, add))
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device="cuda"))
    want, part = combine_ref(y, inv, t, k, add), combine_ref(y, inv, t, k)

    def ulp(x):
        _, e = torch.frexp(x.float())
        return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8).clamp(min=2.0 ** -126)

    assert bool(((got.float() - want.float()).abs() <= ulp(part) + ulp(want)).all())


@pytest.mark.parametrize("spec,layers,fp8", [("tiny", 3, False), ("glm5", 2, True)])
def test_model_with_the_fused_kernels_near_the_torch_path(spec, layers, fp8, monkeypatch):
    """The whole single-process prefill with every fused kernel (tiny: bf16 weights, MoE with the bf16 experts'
    activation and the combine; GLM-5's first 2 layers with fp8 weights: every norm quantising for its fp8
    readers) against the same model with Triton disabled (torch's ops): logits within bf16 / fp8 rounding."""
    from cpkv.model.model import DSAModel, load_model

    model = load_model(spec, seed=3, device="cuda", num_layers=layers, weights="fp8" if fp8 else "bf16")
    assert isinstance(model, DSAModel) and model.fp8 == fp8
    tokens = torch.randint(0, model.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    got = model.reference_prefill(tokens)
    monkeypatch.setenv("CPKV_DISABLE_TRITON", "1")  # read when a model is loaded: the same model on torch's ops
    torch_ops = load_model(spec, seed=3, device="cuda", num_layers=layers, weights="fp8" if fp8 else "bf16")
    assert model.backends.triton and not torch_ops.backends.triton
    want = torch_ops.reference_prefill(tokens)
    assert bool(torch.isfinite(got).all())
    # bf16 weights: the two paths differ by bf16 roundings; fp8 weights: a norm output one bf16 ulp apart can
    # land in another fp8 step (an e4m3 step is 6-12 % of the value) and every layer compounds it: the engine's
    # CUDA verification tolerance (cpkv.engine.engine.TOLERANCE), as two valid quantisations of one model
    from cpkv.engine.engine import TOLERANCE

    atol, rtol = TOLERANCE["cuda"] if fp8 else (0.0, 0.02)
    diff, top = float((got - want).abs().max()), float(want.abs().max())
    assert diff <= atol + (rtol if fp8 else 0.02) * top, (diff, top)


@pytest.mark.parametrize("t", TOKENS)
def test_query_rope_kernel(t):
    """GLM-5's query rope (64 heads, 64 dims of a [T, 64, 256] projection) into the absorbed query's slice: the
    bytes of the separate float32 products (``interleaved_ref``), within one bf16 ulp of the complex product."""
    from cpkv.kernels.rope.ref import rope_interleaved_ref
    from cpkv.model.ops import Rotary

    gen = torch.Generator(device="cuda").manual_seed(700 + t)
    q = (torch.randn(t, 64, 256, generator=gen, device="cuda") * 3).bfloat16()[..., 192:]
    rot = Rotary.build(torch.arange(t, device="cuda") * 11, 64, 10000.0)
    out = torch.zeros(t, 64, 576, dtype=torch.bfloat16, device="cuda")
    rot.interleaved_into(q, out[..., 512:])
    sync_free(lambda: rot.interleaved_into(q, out[..., 512:]))
    assert torch.equal(out[..., 512:], rope_interleaved_ref(q, rot.cos, rot.sin, torch.bfloat16))
    assert not out[..., :512].any()
    # the complex product (torch's, with FMA) rounds each float32 product differently: a result much smaller than
    # its products (cancellation) can then differ by more than its own bf16 ulp, never by more than the products'
    # float32 rounding (2 x 2^-24 x |q|, cos and sin at most 1 here) plus one bf16 ulp
    cplx = rot.interleaved(q, out=torch.empty_like(out[..., 512:])).float()
    _, e = torch.frexp(cplx)
    ulp = torch.ldexp(torch.ones_like(cplx), e - 8)
    assert bool(((out[..., 512:].float() - cplx).abs() <= ulp + 2.0 ** -23 * float(q.abs().max())).all())
