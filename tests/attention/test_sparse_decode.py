"""Sparse decode MLA over paged fp8 token rows, on the CPU: the reference against an independent float64 loop, the
dispatch (the reference here) and its named errors, and the kernel's split plan (pure Python). The kernel itself:
tests/kernels/test_sparse_decode_interpret.py (Triton's interpreter) and test_sparse_decode_gpu.py."""
from __future__ import annotations

import math

import pytest
import torch

from cpkv.attention import pool_bases, sparse_decode_mla
from cpkv.attention.ref import GLM5_TOKEN, dequant_token_kv_ref, quant_token_kv_ref, sparse_decode_mla_ref
from cpkv.config import PlainFormat, RowFormat, preset
from cpkv.errors import AttentionError
from cpkv.kernels.sparse_mla import decode as kernel
from test_attention import assert_close_attention  # noqa: E402 (pytest puts tests/ on sys.path)

TINY = preset("tiny").token_format


def make_case(fmt: RowFormat, h: int, b: int, k: int, seed: int = 0, rows: tuple[int, ...] = (29, 41)):
    gen = torch.Generator().manual_seed(seed)
    d = fmt.fp8_bytes + fmt.rope_dims
    pools = [quant_token_kv_ref(torch.randn(n, d, generator=gen), fmt) for n in rows]
    owner = torch.randint(0, len(rows), (b, k), generator=gen)
    row = torch.randint(0, min(rows), (b, k), generator=gen)
    row[torch.rand(b, k, generator=gen) < 0.2] = -1
    if b > 1:
        row[1] = -1
    return pools, owner, row, torch.randn(b, h, d, generator=gen).to(torch.bfloat16), 1 / math.sqrt(d)


def naive(q, pools, owner, row, scale, d_v, fmt):
    """float64, one generation and head at a time, each key dequantised on its own."""
    b, h, _ = q.shape
    out, lse = torch.zeros(b, h, d_v, dtype=torch.float64), torch.full((b, h), math.inf, dtype=torch.float64)
    for i in range(b):
        keys = [dequant_token_kv_ref(pools[int(o)][int(r)][None], fmt)[0] for o, r in zip(owner[i], row[i]) if r >= 0]
        if not keys:
            continue
        kv = torch.stack(keys).double()
        for hh in range(h):
            s = kv @ q[i, hh].double() * scale
            out[i, hh] = torch.softmax(s, 0) @ kv[:, :d_v]
            lse[i, hh] = torch.logsumexp(s, 0)
    return out, lse


@pytest.mark.parametrize("fmt,h,b,k", [(GLM5_TOKEN, 8, 3, 40), (TINY, 4, 4, 64), (TINY, 4, 1, 1), (TINY, 3, 2, 7)])
def test_reference_equals_a_naive_loop(fmt, h, b, k):
    pools, owner, row, q, scale = make_case(fmt, h, b, k)
    out, lse = sparse_decode_mla_ref(q, pools, owner, row, scale, fmt.fp8_bytes, fmt, dtype=torch.float64)
    want_out, want_lse = naive(q, pools, owner, row, scale, fmt.fp8_bytes, fmt)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse.float()))
    assert torch.allclose(out, want_out, rtol=1e-10, atol=1e-12)
    fin = torch.isfinite(want_lse)
    assert torch.allclose(lse.double()[fin], want_lse[fin], rtol=1e-6)


def test_dispatch_on_cpu_is_the_reference_in_bf16():
    pools, owner, row, q, scale = make_case(TINY, 4, 3, 64)
    ref_out, ref_lse = sparse_decode_mla_ref(q, pools, owner, row, scale, 128, TINY, dtype=torch.float64)
    out, lse = sparse_decode_mla(q, pools, owner, row, scale, 128, TINY)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 4, 128)
    assert_close_attention(out, lse, ref_out, ref_lse, rtol=1e-2, lse_atol=1e-4)
    buf = torch.empty_like(out)
    got, _ = sparse_decode_mla(q, pools, owner, row, scale, 128, TINY, out=buf)
    assert got is buf and torch.equal(buf, out)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == math.inf)  # generation 1: no key


def test_dispatch_takes_no_generation():
    pools, owner, row, q, scale = make_case(TINY, 4, 2, 8)
    out, lse = sparse_decode_mla(q[:0], pools, owner[:0], row[:0], scale, 128, TINY)
    assert out.shape == (0, 4, 128) and lse.shape == (0, 4)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(q=a["q"].float()), "q of dtype bfloat16"),
    (lambda a: a.update(q=a["q"][..., :100]), "q of 128 \\+ 32 dims"),
    (lambda a: a.update(row=a["row"][:, :5]), "owner and row"),
    (lambda a: a.update(owner=a["owner"][:1], row=a["row"][:1]), "owner and row"),
    (lambda a: a.update(pools=[p[:, :100] for p in a["pools"]]), "196-byte rows"),
    (lambda a: a.update(pools=[]), "every rank's pool"),
    (lambda a: a.update(fmt=PlainFormat(160, "bfloat16")), "fp8 token row format"),
    (lambda a: a.update(out=torch.empty(3, 4, 128)), "out bf16"),
    (lambda a: a.update(row=a["row"].float()), "row of dtype"),
])
def test_dispatch_names_bad_input(change, match):
    pools, owner, row, q, scale = make_case(TINY, 4, 3, 16)
    args = dict(q=q, pools=pools, owner=owner, row=row, sm_scale=scale, d_v=128, fmt=TINY)
    change(args)
    with pytest.raises(AttentionError, match=match):
        sparse_decode_mla(**args)


def test_pool_bases_are_the_row_zero_addresses():
    pools = make_case(TINY, 4, 1, 4)[0]
    assert pool_bases(pools, "cpu").tolist() == [p.data_ptr() for p in pools]


@pytest.mark.parametrize("fmt,d_v,ok", [(GLM5_TOKEN, 512, True), (TINY, 128, True), (RowFormat(128, 1, 0), 128, True),
                                        (GLM5_TOKEN, 256, False), (RowFormat(384, 3, 64), 384, False),
                                        (RowFormat(128, 1, 8), 128, False), (PlainFormat(576, "bfloat16"), 512, False)])
def test_kernel_supported_formats(fmt, d_v, ok):
    assert kernel.supported(fmt, d_v) is ok


@pytest.mark.parametrize("b,hb,want", [(1, 1, (32, 64)), (8, 1, (16, 128)), (32, 1, (4, 512)), (1, 2, (32, 64)),
                                       (32, 2, (2, 1024)), (64, 2, (1, 2048))])
def test_splits_at_glm5_and_v32_shapes(b, hb, want):
    assert kernel.plan_splits(b, hb, 2048, 32, 132) == want


@pytest.mark.parametrize("b", [1, 2, 3, 7, 32, 200])
@pytest.mark.parametrize("k", [1, 16, 63, 64, 65, 100, 2048, 2049])
@pytest.mark.parametrize("blocks", [1, 2, 4])
@pytest.mark.parametrize("block_k", [16, 32, 64])
def test_splits_cover_the_keys_in_whole_tiles(b, k, blocks, block_k):
    splits, per = kernel.plan_splits(b, blocks, k, block_k, 132)
    assert per % block_k == 0 and splits >= 1
    assert (splits - 1) * per < k <= splits * per  # every split has a key position, every key a split
    assert splits == 1 or b * blocks * splits <= 132  # never a second wave of programs
    assert splits == 1 or per >= kernel.MIN_SPLIT_KEYS  # no split shorter than 64 keys
    if b * blocks * 2 <= 132 and k >= 2 * max(kernel.MIN_SPLIT_KEYS, block_k):
        assert splits >= 2  # SMs to spare and keys for two splits: split


@pytest.mark.parametrize("h,b,block_h", [(64, 1, 64), (64, 32, 64), (64, 4096, 64), (128, 1, 64), (20, 8, 64),
                                         (17, 1, 64), (16, 1, 16), (4, 32, 16)])
def test_default_config_from_heads_and_generations(h, b, block_h):
    cfg = kernel.default_config(h, b)
    assert cfg.block_h == block_h and kernel.check_config(cfg, 512) == 512
    assert cfg.num_stages == 5  # two pipeline stages a link of the address chain: rows double-buffered


@pytest.mark.parametrize("b,h,d", [(1, 64, 128), (8, 64, 256), (32, 64, 512), (1, 128, 128), (4, 4, 128),
                                   (1, 1, 128)])
def test_combine_programs_are_about_four_an_sm(b, h, d):
    assert kernel.combine_block(b, h, 512, 132) == d


@pytest.mark.parametrize("change", [dict(block_h=24), dict(block_h=8), dict(block_k=48), dict(block_v=192),
                                    dict(block_v=1024), dict(block_v=64), dict(combine_d=384), dict(per_sm=0),
                                    dict(splits=0)])
def test_a_config_the_format_cannot_take_is_a_named_error(change):
    import dataclasses

    cfg = dataclasses.replace(kernel.DecodeConfig(), **change)
    with pytest.raises(AttentionError, match="sparse decode config"):
        kernel.check_config(cfg, 512)
