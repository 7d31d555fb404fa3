"""GPU tests of the Triton kernels against the float64 references (skip without CUDA or Triton).

Tolerances (bf16 operands, fp32 accumulation, bf16 P and output):
  out: ||out - ref|| / ||ref|| <= 1e-2 and max |out - ref| <= 1e-2 * max |ref|
  lse: |lse - ref| <= 1e-3 + 1e-5 |ref|; exactly +inf with out exactly 0 on rows with no valid index.
Token-KV quant/dequant: byte- and bit-identical to the torch reference.
"""
from __future__ import annotations

import math

import pytest
import torch

from cpkv.attention import dense_causal_mla, dequant_token_kv, quant_token_kv, sparse_mla
from cpkv.attention.ref import (
    GLM5_TOKEN, dense_indices, dequant_token_kv_ref, quant_token_kv_ref, sparse_mla_ref,
)
from cpkv.config import preset
from test_attention import assert_close_attention  # noqa: E402 (pytest puts tests/ on sys.path)

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)
TINY = preset("tiny").token_format


def gpu_indices(t: int, topk: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [t, topk] on CUDA: distinct rows per row, ~1/8 replaced by -1 / >= S / < -1, row t//2 all -1."""
    keys = torch.rand(t, s, generator=gen, device="cuda")
    idx = keys.topk(min(topk, s), dim=1).indices.to(torch.int32)
    if topk > s:
        idx = torch.cat([idx, torch.full((t, topk - s), -1, dtype=torch.int32, device="cuda")], 1)
    junk = torch.rand(t, topk, generator=gen, device="cuda") < 0.125
    codes = torch.tensor([-1, s, s + 1000, -9], dtype=torch.int32, device="cuda")
    fill = codes[torch.randint(0, 4, (t, topk), generator=gen, device="cuda")]
    idx = torch.where(junk, fill, idx)
    idx[t // 2] = -1
    return idx


def check_sparse(t: int, h: int, d_v: int, d_r: int, s: int, topk: int, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, h, d_v + d_r, generator=gen, device="cuda").to(torch.bfloat16)
    kv = torch.randn(s, d_v + d_r, generator=gen, device="cuda").to(torch.bfloat16)
    idx = gpu_indices(t, topk, s, gen)
    scale = 1 / math.sqrt(d_v + d_r)
    out, lse = sparse_mla(q, kv, idx, scale, d_v)
    torch.cuda.synchronize()
    ref_out, ref_lse = sparse_mla_ref(q.cpu(), kv.cpu(), idx.cpu(), scale, d_v, dtype=torch.float64)
    assert_close_attention(out.cpu(), lse.cpu(), ref_out, ref_lse, lse_atol=1e-3)


@pytest.mark.parametrize("h", [16, 32, 64, 128])
def test_sparse_glm5_dims(h: int) -> None:
    check_sparse(t=5, h=h, d_v=512, d_r=64, s=5000, topk=2048, seed=h)


@pytest.mark.parametrize("t,h,topk,s", [(7, 4, 64, 300), (3, 20, 100, 90), (4, 64, 40, 1000)])
def test_sparse_small_dims_and_odd_shapes(t: int, h: int, topk: int, s: int) -> None:
    check_sparse(t=t, h=h, d_v=128, d_r=32, s=s, topk=topk, seed=t * h)


def test_sparse_odd_topk_glm5() -> None:
    check_sparse(t=3, h=64, d_v=512, d_r=64, s=700, topk=333, seed=11)


def _configs() -> list:
    from cpkv.kernels.sparse_mla.triton import GLUON_WS, Config

    return [Config(64, 64, 8, 2), Config(64, 32, 8, 3), Config(16, 64, 4, 2), GLUON_WS]


def _skip_unless_gluon(cfg) -> None:
    from cpkv.kernels.platform import capability
    from cpkv.kernels.sparse_mla.triton import gluon_supported

    if cfg.impl.startswith("gluon") and not gluon_supported(512, 64, capability(torch.device("cuda"))):
        pytest.skip("the Gluon kernel needs sm_90 and triton.experimental.gluon")


@pytest.mark.parametrize("i", range(4), ids=["default-triton", "k32-s3", "h16", "gluon-ws"])
def test_sparse_kernel_configs(i: int) -> None:
    """Every kernel config against float64: large-magnitude scores, leading invalid tiles, odd topk."""
    from cpkv.kernels.sparse_mla import triton as kernel

    cfg = _configs()[i]
    _skip_unless_gluon(cfg)
    gen = torch.Generator(device="cuda").manual_seed(12)
    q = (torch.randn(6, 64, 576, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    kv = torch.randn(2000, 576, generator=gen, device="cuda").to(torch.bfloat16)
    idx = gpu_indices(6, 1000, 2000, gen)
    idx[0, :700] = -1  # leading invalid tiles
    idx[1, 130:] = -1  # trailing invalid tiles
    out, lse, _ = kernel.launch(q, kv, idx, None, None, 0.1, 512, cfg)
    ref = sparse_mla_ref(q.cpu(), kv.cpu(), idx.cpu(), 0.1, 512, dtype=torch.float64)
    assert_close_attention(out.cpu(), lse.cpu(), *ref, lse_atol=1e-3)


@pytest.mark.parametrize("h,topk,t", [(16, 64, 3), (32, 333, 4), (64, 2048, 3), (128, 100, 2), (64, 0, 2)])
def test_gluon_kernel_heads_and_lengths(h: int, topk: int, t: int) -> None:
    """Gluon kernel: heads padded to 64 (16, 32) or split in blocks of 64 (128), partial / single / no tiles."""
    from cpkv.kernels.sparse_mla import triton as kernel

    cfg = kernel.GLUON_WS
    _skip_unless_gluon(cfg)
    gen = torch.Generator(device="cuda").manual_seed(h + topk)
    q = torch.randn(t, h, 576, generator=gen, device="cuda").to(torch.bfloat16)
    kv = torch.randn(3000, 576, generator=gen, device="cuda").to(torch.bfloat16)
    idx = gpu_indices(t, topk, 3000, gen) if topk else torch.empty(t, 0, dtype=torch.int32, device="cuda")
    out, lse, _ = kernel.launch(q, kv, idx, None, None, 0.07, 512, cfg)
    ref = sparse_mla_ref(q.cpu(), kv.cpu(), idx.cpu(), 0.07, 512, dtype=torch.float64)
    assert_close_attention(out.cpu(), lse.cpu(), *ref, lse_atol=1e-3)
    _, tri_lse, _ = kernel.launch(q, kv, idx, None, None, 0.07, 512, kernel.default_config(h, 512, 64))
    assert torch.equal(torch.isinf(lse), torch.isinf(tri_lse))


def test_sparse_strided_q() -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    big = torch.randn(4, 96, 576, generator=gen, device="cuda").to(torch.bfloat16)
    q = big[:, 16:80]  # head stride 576, token stride 96 * 576
    kv = torch.randn(900, 576, generator=gen, device="cuda").to(torch.bfloat16)
    idx = gpu_indices(4, 256, 900, gen)
    out, lse = sparse_mla(q, kv, idx, 0.05)
    ref = sparse_mla_ref(q.cpu(), kv.cpu(), idx.cpu(), 0.05, 512, dtype=torch.float64)
    assert_close_attention(out.cpu(), lse.cpu(), *ref, lse_atol=1e-3)


@pytest.mark.parametrize("d_v,d_r,h", [(512, 64, 64), (128, 32, 4)])
def test_dense_matches_sparse_and_reference(d_v: int, d_r: int, h: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(8)
    t, s = 12, 3000
    q = torch.randn(t, h, d_v + d_r, generator=gen, device="cuda").to(torch.bfloat16)
    kv = torch.randn(s, d_v + d_r, generator=gen, device="cuda").to(torch.bfloat16)
    ke = torch.randint(0, s + 1, (t,), generator=gen, device="cuda", dtype=torch.int32)
    ks = (ke - torch.randint(0, 2048, (t,), generator=gen, device="cuda", dtype=torch.int32)).clamp(min=0)
    ks[0] = ke[0]
    out, lse = dense_causal_mla(q, kv, ks, ke, 0.04, d_v)
    idx = dense_indices(ks, ke)
    sout, slse = sparse_mla(q, kv, idx, 0.04, d_v)
    assert torch.equal(out, sout) and torch.equal(lse, slse)
    ref = sparse_mla_ref(q.cpu(), kv.cpu(), idx.cpu(), 0.04, d_v, dtype=torch.float64)
    assert_close_attention(out.cpu(), lse.cpu(), *ref, lse_atol=1e-3)


@pytest.mark.parametrize("fmt", [pytest.param(GLM5_TOKEN, id="glm5"), pytest.param(TINY, id="tiny")])
def test_token_kv_kernels_bit_exact(fmt) -> None:
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(1000, fmt.fp8_bytes + fmt.rope_dims, generator=gen, device="cuda") * 4
    x[3, :128] = 0
    for src in (x, x.to(torch.bfloat16)):
        rows = quant_token_kv(src, fmt)
        assert torch.equal(rows, quant_token_kv_ref(src, fmt))
        assert torch.equal(rows.cpu(), quant_token_kv_ref(src.cpu(), fmt))
        y = dequant_token_kv(rows, fmt)
        assert torch.equal(y, dequant_token_kv_ref(rows, fmt))
        assert torch.equal(y.cpu(), dequant_token_kv_ref(rows.cpu(), fmt))
    raw = torch.randint(0, 256, (777, fmt.row_bytes), generator=gen, device="cuda", dtype=torch.uint8)
    raw[:, : fmt.fp8_bytes][(raw[:, : fmt.fp8_bytes] & 0x7F) == 0x7F] = 0  # no NaN codes
    raw[:, fmt.scale_offset : fmt.rope_offset].view(torch.float32).uniform_(0.001, 2.0)
    got, want = dequant_token_kv(raw, fmt), dequant_token_kv_ref(raw, fmt)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("h,topk,t", [(64, 1000, 6), (16, 64, 3), (128, 333, 4), (64, 2048, 2), (64, 0, 2)])
def test_gluon_ws_against_reference(h: int, topk: int, t: int) -> None:
    """The Gluon kernel against float64: 0, 1, 3 and 16 key-block pairs, heads padded (16) or in two blocks
    (128), large-magnitude scores, leading and trailing invalid tiles, a row of -1."""
    from cpkv.kernels.sparse_mla import triton as kernel

    cfg = kernel.GLUON_WS
    _skip_unless_gluon(cfg)
    gen = torch.Generator(device="cuda").manual_seed(h * 7 + topk)
    q = (torch.randn(t, h, 576, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    kv = torch.randn(3000, 576, generator=gen, device="cuda").to(torch.bfloat16)
    idx = gpu_indices(t, topk, 3000, gen) if topk else torch.empty(t, 0, dtype=torch.int32, device="cuda")
    if topk >= 1000:
        idx[0, :700] = -1  # leading invalid tiles
        idx[1, 130:] = -1  # trailing invalid tiles
    out, lse, _ = kernel.launch(q, kv, idx, None, None, 0.1, 512, cfg)
    ref = sparse_mla_ref(q.cpu(), kv.cpu(), idx.cpu(), 0.1, 512, dtype=torch.float64)
    assert_close_attention(out.cpu(), lse.cpu(), *ref, lse_atol=1e-3)


def test_gluon_ws_dense() -> None:
    """The Gluon kernel's dense causal form (ks .. ke - 1, empty and clipped ranges) against float64."""
    from cpkv.kernels.sparse_mla import triton as kernel

    cfg = kernel.GLUON_WS
    _skip_unless_gluon(cfg)
    gen = torch.Generator(device="cuda").manual_seed(21)
    t, s = 9, 3000
    q = torch.randn(t, 64, 576, generator=gen, device="cuda").to(torch.bfloat16)
    kv = torch.randn(s, 576, generator=gen, device="cuda").to(torch.bfloat16)
    ke = torch.randint(0, s + 1, (t,), generator=gen, device="cuda", dtype=torch.int32)
    ks = (ke - torch.randint(0, 2048, (t,), generator=gen, device="cuda", dtype=torch.int32)).clamp(min=0)
    ks[0] = ke[0]  # empty range
    out, lse, _ = kernel.launch(q, kv, None, ks, ke, 0.04, 512, cfg)
    ref = sparse_mla_ref(q.cpu(), kv.cpu(), dense_indices(ks, ke).cpu(), 0.04, 512, dtype=torch.float64)
    assert_close_attention(out.cpu(), lse.cpu(), *ref, lse_atol=1e-3)


@pytest.mark.parametrize("h,topk,t", [(128, 333, 300), (64, 2048, 200), (64, 64, 401)])
def test_gluon_ws_many_tiles(h: int, topk: int, t: int) -> None:
    """The persistent Gluon kernel with more tiles than SMs (each program loops over tiles; barrier parities run
    on across them) against float64 on the device: every row, a row of -1 among them."""
    from cpkv.kernels.sparse_mla import triton as kernel

    cfg = kernel.GLUON_WS
    _skip_unless_gluon(cfg)
    assert t * h // 64 > torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(t + h)
    q = (torch.randn(t, h, 576, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    kv = torch.randn(5000, 576, generator=gen, device="cuda").to(torch.bfloat16)
    idx = gpu_indices(t, topk, 5000, gen)
    out, lse, _ = kernel.launch(q, kv, idx, None, None, 0.1, 512, cfg)
    ref = sparse_mla_ref(q, kv, idx, 0.1, 512, dtype=torch.float64)
    assert_close_attention(out.cpu(), lse.cpu(), ref[0].cpu(), ref[1].cpu(), lse_atol=1e-3)
    ks = torch.randint(0, 5000, (t,), generator=gen, device="cuda", dtype=torch.int32)
    ke = (ks + torch.randint(0, 700, (t,), generator=gen, device="cuda", dtype=torch.int32)).clamp(max=5000)
    ke[::7] = ks[::7]  # empty ranges: tiles of no key pairs between full ones
    out, lse, _ = kernel.launch(q, kv, None, ks, ke, 0.1, 512, cfg)
    ref = sparse_mla_ref(q, kv, dense_indices(ks, ke), 0.1, 512, dtype=torch.float64)
    assert_close_attention(out.cpu(), lse.cpu(), ref[0].cpu(), ref[1].cpu(), lse_atol=1e-3)
