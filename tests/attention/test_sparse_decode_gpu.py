"""The sparse decode MLA kernel on a GPU against ``sparse_decode_mla_ref`` in float64 (skip without CUDA or Triton):
GLM-5's shapes (64 heads, 512 + 64, top-k 2048, B 1 and 32, two pools standing for two ranks, one of them a layer
slot of a larger buffer), DeepSeek-V3.2's 128 heads, head counts that fill no block, the tiny model's rows, K not a
multiple of the tile, masked keys, a generation with no key and one whose keys end early, nine pools (bases
gathered, not picked); every launch shape ``cpkv bench attention --decode --sweep`` times at B 1, 8 and 32 (64 and
128 heads); CUDA graphs of the default and of other launch shapes replayed over new inputs.

Tolerance (as test_attention_gpu.py: bf16 operands, fp32 accumulation, bf16 P and output):
  out: ||out - ref|| / ||ref|| <= 1e-2 and max |out - ref| <= 1e-2 * max |ref|
  lse: |lse - ref| <= 1e-3 + 1e-5 |ref|; exactly +inf with out exactly 0 for a generation with no key.
"""
from __future__ import annotations

import math

import pytest
import torch

from cpkv.attention import pool_bases, quant_token_kv, sparse_decode_mla
from cpkv.attention.ref import GLM5_TOKEN, sparse_decode_mla_ref
from cpkv.bench.attention_decode import first_kernel, sweep_configs
from cpkv.config import RowFormat, preset
from cpkv.kernels.sparse_mla import decode as kernel
from test_attention import assert_close_attention  # noqa: E402 (pytest puts tests/ on sys.path)

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)
TINY = preset("tiny").token_format


def gpu_case(fmt: RowFormat, h: int, b: int, k: int, rows: int = 16384, seed: int = 0, extra_pools: int = 0):
    """Two pools (pool 1 the second layer slot of a [2, rows, row_bytes] buffer; ``extra_pools`` more), distinct
    rows per generation, ~1/8 of keys -1 (their owner garbage), generation 1 (if any) with no key, the last one's
    keys ending at k/3."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d = fmt.fp8_bytes + fmt.rope_dims
    layered = torch.empty(2, rows, fmt.row_bytes, dtype=torch.uint8, device="cuda")
    layered[1] = quant_token_kv(torch.randn(rows, d, device="cuda", generator=gen), fmt)
    pools = [quant_token_kv(torch.randn(rows + 77, d, device="cuda", generator=gen), fmt), layered[1]]
    pools += [quant_token_kv(torch.randn(rows, d, device="cuda", generator=gen), fmt) for _ in range(extra_pools)]
    row = torch.rand(b, rows, device="cuda", generator=gen).topk(k, dim=1).indices
    owner = torch.randint(0, len(pools), (b, k), device="cuda", generator=gen)
    drop = torch.rand(b, k, device="cuda", generator=gen) < 0.125
    row, owner = row.masked_fill(drop, -1), owner.masked_fill(drop, 5)
    if b > 1:
        row[1] = -1
    row[-1, k // 3:] = -1
    q = torch.randn(b, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    return q, pools, owner, row.to(torch.int32), 1 / math.sqrt(192 + 64)


def check(q, pools, owner, row, scale, fmt, **kw) -> None:
    out, lse = sparse_decode_mla(q, pools, owner, row, scale, fmt.fp8_bytes, fmt, **kw)
    ref = sparse_decode_mla_ref(q, pools, owner, row, scale, fmt.fp8_bytes, fmt, dtype=torch.float64)
    torch.cuda.synchronize()
    assert_close_attention(out.cpu(), lse.cpu(), ref[0].cpu(), ref[1].cpu(), lse_atol=1e-3)


@pytest.mark.parametrize("fmt,h,b,k", [
    (GLM5_TOKEN, 64, 1, 2048), (GLM5_TOKEN, 64, 32, 2048), (GLM5_TOKEN, 64, 3, 100), (GLM5_TOKEN, 64, 8, 1),
    (GLM5_TOKEN, 128, 4, 2048), (GLM5_TOKEN, 128, 32, 2048), (GLM5_TOKEN, 72, 5, 777), (GLM5_TOKEN, 20, 3, 300),
    (TINY, 4, 8, 64), (TINY, 4, 3, 100),
])
def test_kernel_equals_the_reference(fmt, h, b, k):
    check(*gpu_case(fmt, h, b, k), fmt)


def test_nine_pools_gather_their_bases():
    q, pools, owner, row, scale = gpu_case(GLM5_TOKEN, 64, 4, 2048, rows=4096, extra_pools=7)
    assert len(pools) > kernel.MAX_SELECT
    check(q, pools, owner, row, scale, GLM5_TOKEN)


@pytest.mark.parametrize("h", [64, 128])
def test_every_swept_launch_shape_equals_the_reference(h):
    bad = []
    for b in (1, 8, 32):
        q, pools, owner, row, scale = gpu_case(GLM5_TOKEN, h, b, 2048)
        bases = pool_bases(pools, "cuda")
        ref = sparse_decode_mla_ref(q, pools, owner, row, scale, 512, GLM5_TOKEN, dtype=torch.float64)
        for cfg in sweep_configs(b, h, 2048, kernel.sm_count_of(q)):
            out, lse = kernel.sparse_decode_mla(q, bases, owner, row, scale, 512, GLM5_TOKEN, config=cfg)
            try:
                assert_close_attention(out.cpu(), lse.cpu(), ref[0].cpu(), ref[1].cpu(), lse_atol=1e-3)
            except AssertionError as exc:
                bad.append(f"B {b} {cfg.tag()}: {str(exc)[:200]}")
    assert not bad, "\n".join(bad)


def test_no_generation_launches_nothing():
    q, pools, owner, row, scale = gpu_case(GLM5_TOKEN, 64, 2, 64)
    out, lse = sparse_decode_mla(q[:0], pools, owner[:0], row[:0], scale, 512, GLM5_TOKEN)
    assert out.shape == (0, 64, 512) and lse.shape == (0, 64)


GRAPHED = [None, kernel.DecodeConfig(64, 32, 4, 5, block_v=128), kernel.DecodeConfig(16, 16, 4, 5),
           first_kernel(4, 64, 2048, 132), kernel.DecodeConfig(64, 32, 8, 5, splits=1)]


@pytest.mark.parametrize("cfg", GRAPHED, ids=lambda c: "default" if c is None else c.tag().replace(" ", "-"))
def test_a_captured_graph_replays_over_new_inputs(cfg):
    q, pools, owner, row, scale = gpu_case(GLM5_TOKEN, 64, 4, 2048)
    bases, out = pool_bases(pools, "cuda"), torch.empty(4, 64, 512, dtype=torch.bfloat16, device="cuda")
    run = lambda: kernel.sparse_decode_mla(q, bases, owner, row, scale, 512, GLM5_TOKEN, out, config=cfg)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = run()
    q2, _, owner2, row2, _ = gpu_case(GLM5_TOKEN, 64, 4, 2048, seed=1)
    q.copy_(q2), owner.copy_(owner2), row.copy_(row2)
    out.fill_(7.0)
    graph.replay()
    ref = sparse_decode_mla_ref(q, pools, owner, row, scale, 512, GLM5_TOKEN, dtype=torch.float64)
    torch.cuda.synchronize()
    assert_close_attention(out.cpu(), lse.cpu(), ref[0].cpu(), ref[1].cpu(), lse_atol=1e-3)


def test_the_dispatch_captures_too():
    """``cpkv.attention.sparse_decode_mla`` (the engine's entry: checks, then the default launch) in a graph."""
    q, pools, owner, row, scale = gpu_case(GLM5_TOKEN, 64, 32, 2048)
    bases, out = pool_bases(pools, "cuda"), torch.empty(32, 64, 512, dtype=torch.bfloat16, device="cuda")
    run = lambda: sparse_decode_mla(q, pools, owner, row, scale, 512, GLM5_TOKEN, bases=bases, out=out)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = run()
    q2, _, owner2, row2, _ = gpu_case(GLM5_TOKEN, 64, 32, 2048, seed=2)
    q.copy_(q2), owner.copy_(owner2), row.copy_(row2)
    graph.replay()
    ref = sparse_decode_mla_ref(q, pools, owner, row, scale, 512, GLM5_TOKEN, dtype=torch.float64)
    torch.cuda.synchronize()
    assert_close_attention(out.cpu(), lse.cpu(), ref[0].cpu(), ref[1].cpu(), lse_atol=1e-3)
