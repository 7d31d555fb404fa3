"""The top-k at the decode step's shapes on the GPU (skip without CUDA or Triton): B generations of 1, 8 and 32,
L = 32768 and 131072 logits columns, k = 2048, each row -inf past its context, top-k over [0, ctx) as
``engine.decode_graph`` bounds it. The split path (``kernels.topk.split``, chosen from the shapes) and the stream
kernel (``TopkConfig(splits=1)``) each equal ``topk_ref`` index for index: random logits, a recency trend (the
candidates crowd the last segments), quantised logits (ties at the threshold), contexts of k, k + 1 and under k,
the -inf tail inside the range, ``base`` (absolute rows), and a CUDA graph captured once (with and without the
merge as a programmatic dependent launch) and replayed over new logits and contexts."""
from __future__ import annotations

import pytest
import torch

from cpkv.indexer import topk, topk_ref, topk_to_slots
from cpkv.indexer.topk import topk_into

pytest.importorskip("triton")  # kernels.topk.triton imports it at module level (the markers skip only the tests)
from cpkv.kernels.topk.triton import DEFAULT_CONFIG, TopkConfig, splits_for  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)
K = 2048
STREAM = TopkConfig(splits=1)


def decode_rows(B: int, L: int, seed: int, kind: str = "randn") -> tuple[torch.Tensor, torch.Tensor]:
    """(logits float32 [B, L] -inf past each context, ctx int32 [B]): contexts in [L / 2, L], the first L, the
    next k + 1, k and 1000 where B allows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ctx = torch.randint(L // 2, L + 1, (B,), device="cuda", generator=g, dtype=torch.int32)
    ctx[: min(B, 4)] = torch.tensor([L, K + 1, K, 1000], dtype=torch.int32, device="cuda")[: min(B, 4)]
    x = torch.randn(B, L, device="cuda", generator=g)
    if kind == "recency":
        x += torch.linspace(0, 6, L, device="cuda")
    elif kind == "ties":
        x = (x * 4).round() / 4
    x[torch.arange(L, device="cuda")[None, :] >= ctx[:, None]] = float("-inf")
    return x, ctx


@pytest.mark.parametrize("kind", ["randn", "recency", "ties"])
@pytest.mark.parametrize("L", [32768, 131072])
@pytest.mark.parametrize("B", [1, 8, 32])
def test_decode_shapes_split_and_stream_equal_the_reference(B, L, kind):
    x, ctx = decode_rows(B, L, seed=B + L, kind=kind)
    lo = torch.zeros(B, dtype=torch.int32, device="cuda")
    assert splits_for(B, L, K, DEFAULT_CONFIG, x.device) > 1, "decode shapes should take the split path"
    want = topk_ref(x, lo, ctx, K)
    assert torch.equal(topk(x, lo, ctx, K), want)
    assert torch.equal(topk(x, lo, ctx, K, config=STREAM), want)
    base = torch.arange(B, dtype=torch.int32, device="cuda") * L
    out = torch.full((B, K), -7, dtype=torch.int32, device="cuda")
    assert torch.equal(topk_into(x, lo, ctx, K, out, base=base), topk_to_slots(want, base))


@pytest.mark.parametrize("splits", [2, 8, 64])
def test_forced_split_counts(splits):
    x, ctx = decode_rows(4, 32768, seed=splits)
    lo = torch.zeros(4, dtype=torch.int32, device="cuda")
    assert torch.equal(topk(x, lo, ctx, K, config=TopkConfig(splits=splits)), topk_ref(x, lo, ctx, K))


@pytest.mark.parametrize("B", [1, 8])
def test_inf_tail_inside_the_range(B):
    """hi = L: a context under k picks its keys, then the tail's first -inf columns (ties toward the lower index)."""
    x, _ = decode_rows(B, 32768, seed=5)
    lo = torch.zeros(B, dtype=torch.int32, device="cuda")
    hi = torch.full((B,), 32768, dtype=torch.int32, device="cuda")
    assert torch.equal(topk(x, lo, hi, K), topk_ref(x, lo, hi, K))


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("B,L", [(1, 32768), (8, 131072), (32, 32768)])
def test_a_captured_graph_replays_over_new_logits_and_contexts(B, L, pdl):
    x, ctx = decode_rows(B, L, seed=0)
    lo = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = torch.empty(B, K, dtype=torch.int32, device="cuda")
    cfg = TopkConfig(pdl=pdl)
    topk_into(x, lo, ctx, K, out, config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_into(x, lo, ctx, K, out, config=cfg)
    for seed, kind in ((1, "randn"), (2, "recency"), (3, "ties")):
        x2, ctx2 = decode_rows(B, L, seed=seed, kind=kind)
        x.copy_(x2), ctx.copy_(ctx2)
        out.fill_(-7)
        graph.replay()
        assert torch.equal(out, topk_ref(x, lo, ctx, K)), (seed, kind)
