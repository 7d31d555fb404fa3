"""CPU tests of cpkv.attention: token-KV (de)quantisation and sparse / dense MLA against float64.

Tolerances (bf16 outputs, fp32 compute on the CPU path):
  out: ||out - ref|| / ||ref|| <= 1e-2 and max |out - ref| <= 1e-2 * max |ref|   (bf16 rounding ~4e-3)
  lse: |lse - ref| <= 1e-4 + 1e-5 |ref|; exactly +inf (and out exactly 0) on rows with no valid index.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.attention import dense_causal_mla, dequant_token_kv, quant_token_kv, sparse_mla
from cpkv.attention.sparse import sparse_backend
from cpkv.attention.ref import GLM5_TOKEN, dense_indices, row_views, sparse_mla_ref
from cpkv.config import RowFormat, preset
from cpkv.errors import AttentionError

TINY = preset("tiny").token_format
FORMATS = [pytest.param(GLM5_TOKEN, id="glm5"), pytest.param(TINY, id="tiny")]


def random_indices(t: int, topk: int, s: int, gen: torch.Generator, pad: int = 0) -> torch.Tensor:
    """int32 [t, topk]: distinct rows of [0, s) per row, ``pad`` of them replaced by -1 / out-of-range."""
    rows = [torch.randperm(s, generator=gen)[:topk] for _ in range(t)]
    idx = torch.stack(rows).to(torch.int32)
    for r in range(t):
        slots = torch.randperm(topk, generator=gen)[:pad]
        junk = torch.tensor([-1, s, s + 7, -5], dtype=torch.int32)
        idx[r, slots] = junk[torch.arange(pad) % 4]
    return idx


def assert_close_attention(out, lse, ref_out, ref_lse, rtol: float = 1e-2, lse_atol: float = 1e-4) -> None:
    """inf positions of lse equal, empty rows exactly 0 / +inf, then relative error of the rest."""
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "rows with no valid index differ"
    assert torch.all(lse[empty] == math.inf)
    assert torch.all(out[empty] == 0)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    o, r = out.double()[~empty], ref_out.double()[~empty]
    if r.numel():
        err = (o - r).norm() / r.norm()
        worst = (o - r).abs().max()
        assert err <= rtol, f"relative error {err:.3g} > {rtol}"
        assert worst <= rtol * r.abs().max(), f"max abs error {worst:.3g} at {(o - r).abs().argmax()}"
        lerr = (lse[~empty].double() - ref_lse[~empty].double()).abs()
        assert torch.all(lerr <= lse_atol + 1e-5 * ref_lse[~empty].double().abs()), f"lse error {lerr.max():.3g}"


def naive_attention(q, kv, idx, sm_scale, d_v):
    """Independent float64 loop implementation (per token and head) used to check the reference."""
    t, h, _ = q.shape
    out = torch.zeros(t, h, d_v, dtype=torch.float64)
    lse = torch.full((t, h), math.inf, dtype=torch.float64)
    for i in range(t):
        rows = [int(j) for j in idx[i] if 0 <= int(j) < kv.shape[0]]
        if not rows:
            continue
        k = kv[rows].double()
        for hh in range(h):
            s = (k @ q[i, hh].double()) * sm_scale
            w = torch.softmax(s, 0)
            out[i, hh] = w @ k[:, :d_v]
            lse[i, hh] = torch.logsumexp(s, 0).item()
    return out, lse


# ---- token KV rows ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_dequant_round_trip_bounds(fmt: RowFormat) -> None:
    gen = torch.Generator().manual_seed(1)
    width = fmt.fp8_bytes + fmt.rope_dims
    x = torch.randn(33, width, generator=gen) * torch.rand(33, 1, generator=gen) * 10
    rows = quant_token_kv(x, fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (33, fmt.row_bytes)
    y = dequant_token_kv(rows, fmt)
    assert y.dtype == torch.bfloat16 and y.shape == (33, width)
    lat, ylat = x[:, : fmt.fp8_bytes].double(), y[:, : fmt.fp8_bytes].double()
    scale = lat.reshape(33, -1, 128).abs().amax(2).repeat_interleave(128, 1) / 448
    # e4m3: 3 mantissa bits (rel 2^-4), subnormal step scale * 2^-9; then bf16 rounding (2^-8)
    bound = lat.abs() * (2**-4 + 2**-8) * 1.01 + scale * 2**-9
    assert torch.all((ylat - lat).abs() <= bound)
    assert torch.equal(y[:, fmt.fp8_bytes :], x[:, fmt.fp8_bytes :].to(torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_layout_scales_and_zero_group(fmt: RowFormat) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, fmt.fp8_bytes + fmt.rope_dims, generator=gen)
    x[1, :128] = 0
    rows = quant_token_kv(x, fmt)
    fp8, scale, rope = row_views(rows, fmt)
    expect = x[:, : fmt.fp8_bytes].reshape(4, -1, 128).abs().amax(2) / 448
    assert torch.equal(scale, expect)
    assert scale[1, 0] == 0 and torch.all(fp8[1, :128].view(torch.uint8) == 0)
    assert torch.all(dequant_token_kv(rows, fmt)[1, :128] == 0)
    amax_codes = fp8.float().abs().reshape(4, -1, 128).amax(2)
    assert torch.all((amax_codes == 448) | (scale == 0))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_exact_on_constructed_rows(fmt: RowFormat) -> None:
    """Random fp8 codes with power-of-two scales: dequant is exact, checked against float64."""
    gen = torch.Generator().manual_seed(3)
    s = 17
    rows = torch.randint(0, 256, (s, fmt.row_bytes), dtype=torch.uint8, generator=gen)
    fp8, scale, rope = row_views(rows, fmt)
    codes = fp8.view(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    scale.copy_(2.0 ** torch.randint(-6, 3, scale.shape, generator=gen).float())
    rope.copy_(torch.randn(rope.shape, generator=gen).to(torch.bfloat16))
    y = dequant_token_kv(rows, fmt)
    want = fp8.double() * scale.double().repeat_interleave(128, 1)
    assert torch.equal(y[:, : fmt.fp8_bytes].double(), want.to(torch.bfloat16).double())
    assert torch.equal(y[:, fmt.fp8_bytes :], rope)


def test_default_format_is_glm5_656_bytes() -> None:
    x = torch.randn(3, 576)
    rows = quant_token_kv(x)
    assert rows.shape == (3, 656) and dequant_token_kv(rows).shape == (3, 576)


def test_token_kv_bad_input() -> None:
    with pytest.raises(AttentionError, match="656 bytes"):
        dequant_token_kv(torch.zeros(3, 655, dtype=torch.uint8))
    with pytest.raises(AttentionError, match="uint8"):
        dequant_token_kv(torch.zeros(3, 656, dtype=torch.int8))
    with pytest.raises(AttentionError, match="2 dims"):
        dequant_token_kv(torch.zeros(656, dtype=torch.uint8))
    with pytest.raises(AttentionError, match="576 dims"):
        quant_token_kv(torch.zeros(3, 512))
    with pytest.raises(AttentionError, match="dtype"):
        quant_token_kv(torch.zeros(3, 576, dtype=torch.int32))
    with pytest.raises(AttentionError, match="scale per 128"):
        dequant_token_kv(torch.zeros(3, 656, dtype=torch.uint8), RowFormat(512, 2, 64))


# ---- sparse / dense attention -----------------------------------------------------------------


def test_reference_matches_naive_loop() -> None:
    gen = torch.Generator().manual_seed(4)
    q, kv = torch.randn(5, 3, 40, generator=gen), torch.randn(30, 40, generator=gen)
    idx = random_indices(5, 12, 30, gen, pad=4)
    idx[3] = -1
    out, lse = sparse_mla_ref(q, kv, idx, 0.2, 32, dtype=torch.float64)
    nout, nlse = naive_attention(q, kv, idx, 0.2, 32)
    assert torch.allclose(out, nout, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(nlse))
    assert torch.allclose(lse.double(), nlse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "t,h,d_v,d_r,s,topk,pad",
    [(6, 4, 128, 32, 200, 64, 9), (3, 16, 512, 64, 300, 128, 20), (5, 3, 64, 0, 50, 50, 0), (4, 2, 32, 16, 10, 24, 0)],
)
def test_sparse_matches_float64(t: int, h: int, d_v: int, d_r: int, s: int, topk: int, pad: int) -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(t, h, d_v + d_r, generator=gen).to(torch.bfloat16)
    kv = torch.randn(s, d_v + d_r, generator=gen).to(torch.bfloat16)
    if topk <= s:
        idx = random_indices(t, topk, s, gen, pad)
    else:  # more slots than rows: all rows then padding
        idx = torch.cat([random_indices(t, s, s, gen), torch.full((t, topk - s), -1, dtype=torch.int32)], 1)
    idx[t // 2] = -1  # an all-invalid row
    scale = 1 / math.sqrt(d_v + d_r)
    out, lse = sparse_mla(q, kv, idx, scale, d_v)
    assert out.dtype == torch.bfloat16 and out.shape == (t, h, d_v) and lse.dtype == torch.float32
    assert_close_attention(out, lse, *sparse_mla_ref(q, kv, idx, scale, d_v, dtype=torch.float64))


def test_all_rows_empty_and_zero_tokens() -> None:
    q, kv = torch.randn(2, 4, 160).to(torch.bfloat16), torch.randn(8, 160).to(torch.bfloat16)
    out, lse = sparse_mla(q, kv, torch.tensor([[-1, 8], [9, -3]], dtype=torch.int32), 0.1, 128)
    assert torch.all(out == 0) and torch.all(lse == math.inf)
    out, lse = sparse_mla(q[:0], kv, torch.zeros(0, 4, dtype=torch.int32), 0.1, 128)
    assert out.shape == (0, 4, 128) and lse.shape == (0, 4)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), topk=st.integers(1, 24), extra=st.integers(0, 8))
def test_sparse_invariant_to_order_and_padding(seed: int, topk: int, extra: int) -> None:
    """Permuting a row's indices or appending -1 / out-of-range entries changes nothing (float64)."""
    gen = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(3, 2, 24, generator=gen), torch.randn(30, 24, generator=gen)
    idx = random_indices(3, min(topk, 30), 30, gen, pad=min(topk, 30) // 3)
    perm = idx[:, torch.randperm(idx.shape[1], generator=gen)]
    padded = torch.cat([perm, torch.tensor([-1, 30, 99, -7] * 2, dtype=torch.int32)[:extra].expand(3, extra)], 1)
    a, la = sparse_mla_ref(q, kv, idx, 0.3, 16, dtype=torch.float64)
    b, lb = sparse_mla_ref(q, kv, padded, 0.3, 16, dtype=torch.float64)
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.isinf(la), torch.isinf(lb))
    assert torch.allclose(la[~torch.isinf(la)], lb[~torch.isinf(lb)], rtol=1e-6)


def causal_ranges(t: int, s: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ke = torch.randint(0, s + 1, (t,), generator=gen, dtype=torch.int32)
    ks = (ke - torch.randint(0, 40, (t,), generator=gen, dtype=torch.int32)).clamp(min=0)
    ks[0], ke[0] = 5, 5  # empty range
    return ks, ke


def test_dense_matches_float64_and_sparse() -> None:
    gen = torch.Generator().manual_seed(6)
    t, h, s = 9, 4, 60
    q = torch.randn(t, h, 160, generator=gen).to(torch.bfloat16)
    kv = torch.randn(s, 160, generator=gen).to(torch.bfloat16)
    ks, ke = causal_ranges(t, s, gen)
    out, lse = dense_causal_mla(q, kv, ks, ke, 0.08, 128)
    idx = dense_indices(ks, ke)
    assert_close_attention(out, lse, *sparse_mla_ref(q, kv, idx, 0.08, 128, dtype=torch.float64))
    sout, slse = sparse_mla(q, kv, idx, 0.08, 128)
    assert torch.equal(out, sout) and torch.equal(lse, slse)


def test_dense_indices_layout() -> None:
    idx = dense_indices(torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([2, 6, 7], dtype=torch.int32))
    assert idx.tolist() == [[0, 1, -1], [3, 4, 5], [-1, -1, -1]]


def test_attention_bad_input() -> None:
    q, kv = torch.randn(2, 4, 160).to(torch.bfloat16), torch.randn(8, 160).to(torch.bfloat16)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    cases = [
        (lambda: sparse_mla(q.float(), kv, idx, 0.1, 128), "bfloat16"),
        (lambda: sparse_mla(q, kv[:, :150], idx, 0.1, 128), "d_qk = 160"),
        (lambda: sparse_mla(q, kv, idx[:1], 0.1, 128), "2 rows"),
        (lambda: sparse_mla(q, kv, idx.float(), 0.1, 128), "int32"),
        (lambda: sparse_mla(q, kv, idx, 0.1, 161), "d_v"),
        (lambda: sparse_mla(q, kv, idx, -1.0, 128), "sm_scale"),
        (lambda: sparse_mla(q[0], kv, idx, 0.1, 128), "3 dims"),
        (lambda: dense_causal_mla(q, kv, idx[:, 0], idx[:1, 0], 0.1, 128), "ke of 2"),
        (lambda: dense_causal_mla(q, kv, idx, idx, 0.1, 128), "1 dims"),
    ]
    for call, msg in cases:
        with pytest.raises(AttentionError, match=msg):
            call()


def test_kernel_config_choice_without_hopper() -> None:
    """The Gluon kernel is chosen only on sm_90 with 512 + 64 dims and > 32 heads; tags name configs."""
    from cpkv.kernels.sparse_mla import triton as kernel

    for cap in (None, (8, 0), (10, 0)):
        assert kernel.default_config(64, 512, 64, cap).impl == "triton"
    assert kernel.default_config(16, 512, 64, (9, 0)).impl == "triton"
    assert kernel.default_config(64, 128, 32, (9, 0)).impl == "triton"
    assert not kernel.gluon_supported(256, 64, (9, 0))
    assert kernel.Config(64, 64, 8, 2).tag() == "h64 k64 w8 s2"
    assert kernel.GLUON_WS.tag() == "h64 k64 w12 s2 gluon_ws"
    with pytest.raises(AttentionError, match="expected impl one of triton, gluon_ws, got 'gluon_ws_persist'"):
        kernel.Config(64, 64, 12, 2, impl="gluon_ws_persist")


def test_sparse_backend_choice(monkeypatch):
    """The sparse attention backend, resolved once (``platform.resolve``): cpkv pins cpkv's kernel; flashmla where
    ``flash_mla`` does not import is one error naming it; auto falls back to cpkv's kernel, and to it too off
    Hopper; a bad name is refused, naming the choices. ``sparse_mla`` with flashmla's backends, where FlashMLA
    imports and applies, gives it kv [S, 1, d_qk] and int32 indices [T, 1, topk] and its (out, max_logits, lse)
    becomes (out, lse [T, H]); where it does not apply (8 heads) cpkv's path runs."""
    import sys
    import types

    from cpkv.errors import ConfigError
    from cpkv.kernels import platform
    from cpkv.kernels.sparse_mla import flashmla

    monkeypatch.setenv("CPKV_SPARSE_MLA", "auto")
    assert sparse_backend() == "auto" and sparse_backend("cpkv") == "cpkv"
    with pytest.raises(AttentionError, match="backend one of"):
        sparse_backend("fast")
    with pytest.raises(ConfigError, match="expected one of auto, cpkv, flashmla, got 'fast'"):
        platform._sparse_mla("fast", True)
    with pytest.raises(ConfigError, match="expected one of flashmla, cpkv"):
        platform.Backends(sparse_mla="auto")
    assert platform.resolve("cpu") == platform.REFERENCE
    flashmla.load.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import fails
    assert platform._sparse_mla("auto", True) == "cpkv" and platform._sparse_mla("cpkv", True) == "cpkv"
    with pytest.raises(ConfigError, match="flash_mla package"):
        platform._sparse_mla("flashmla", True)
    calls = []

    def fwd(q, kv, idx, scale, d_v):
        calls.append((q.shape, kv.shape, idx.shape, idx.dtype, scale, d_v))
        return torch.ones(q.shape[0], q.shape[1], d_v), None, torch.zeros(q.shape[0], q.shape[1], 1)

    flashmla.load.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_mla", types.SimpleNamespace(flash_mla_sparse_fwd=fwd))
    assert platform._sparse_mla("auto", True) == "flashmla" == platform._sparse_mla("flashmla", True)
    assert platform._sparse_mla("auto", False) == "cpkv" == platform._sparse_mla("cpkv", True)
    monkeypatch.setattr(flashmla, "applies", lambda q, kv, d_v: q.shape[1] in flashmla.HEADS)
    q, kv = torch.zeros(3, 64, 576, dtype=torch.bfloat16), torch.zeros(10, 576, dtype=torch.bfloat16)
    peer = platform.Backends(sparse_mla="flashmla")
    out, lse = sparse_mla(q, kv, torch.zeros(3, 4, dtype=torch.int64), 0.5, 512, peer)
    assert calls == [((3, 64, 576), (10, 1, 576), (3, 1, 4), torch.int32, 0.5, 512)]
    assert out.shape == (3, 64, 512) and lse.shape == (3, 64) and lse.dtype == torch.float32
    out, _ = sparse_mla(q[:, :8], kv, torch.zeros(3, 4, dtype=torch.int64), 0.5, 512, peer)  # 8 heads: not FlashMLA's
    assert len(calls) == 1 and out.shape == (3, 8, 512)
    sparse_mla(q, kv, torch.zeros(3, 4, dtype=torch.int64), 0.5, 512, platform.REFERENCE)
    assert len(calls) == 1
    flashmla.load.cache_clear()


def test_flashmla_applies_only_to_its_shapes():
    from cpkv.attention import flashmla

    q, kv = torch.zeros(3, 64, 576, dtype=torch.bfloat16), torch.zeros(10, 576, dtype=torch.bfloat16)
    assert not flashmla.applies(q, kv, 512)  # CPU tensors


@pytest.mark.parametrize("disable,torch_mm,triton,grouped", [
    (False, False, True, "gluon"), (True, False, False, "torch"), (False, True, True, "torch"), (True, True, False, "torch"),
])
def test_backends_on_a_hopper_gpu_follow_the_switches(monkeypatch, disable, torch_mm, triton, grouped):
    """``resolve`` on a (pretended) Hopper GPU with Triton and Gluon importable: ``CPKV_DISABLE_TRITON`` turns off
    every Triton and Gluon kernel, the bf16 grouped expert GEMM included; ``CPKV_GROUPED_MM_TORCH`` that one alone."""
    from cpkv.kernels import platform

    monkeypatch.setattr(platform, "capability", lambda device: (9, 0))
    monkeypatch.setattr(platform, "triton_importable", lambda: True)
    monkeypatch.setattr(platform, "gluon_importable", lambda: True)
    b = platform.resolve("cuda", disable_triton=disable, sparse_mla="cpkv", grouped_mm_torch=torch_mm)
    assert (b.triton, b.grouped_mm, b.sparse_mla) == (triton, grouped, "cpkv")
