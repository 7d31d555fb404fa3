"""GPU: FlashMLA as the sparse attention backend (``cpkv.kernels.sparse_mla.flashmla``; skips unless the ``flash_mla``
package imports on a Hopper GPU): its outputs against cpkv's kernel and the float64 reference on GLM-5's
attention shapes, and GLM-5's first 2 layers at cp 2 run by it under the sync check, against the same run on
cpkv's kernel.

Tolerances: both kernels accumulate in float32 and round the output to bf16. Cosine difference (FlashMLA's test
metric, 1 - 2 x.y / (x.x + y.y)) between the two kernels ≤ 1e-8; against the float64 reference, whose output is
not rounded to bf16, ≤ 1e-5 (bf16's 2^-9 relative rounding alone gives ~2e-6), and |out difference| ≤ 2 % of
max |out|; lse within 1e-4; engine logits within 5e-2 of max |logit| (two layers of bf16 rounding apart; the
first tokens are not compared: random weights leave near-ties at the top).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cpkv.attention import sparse_mla, sparse_mla_ref
from cpkv.kernels.platform import resolve

pytestmark = [pytest.mark.cuda]


@pytest.fixture(scope="module")
def peer():
    from cpkv.attention import flashmla

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    flashmla.load.cache_clear()
    fn = flashmla.load()
    if fn is None:
        pytest.skip(f"flash_mla does not import: {flashmla.import_error()}")
    return fn


def _cos(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


@pytest.mark.parametrize("heads,s_kv", [(64, 8192), (128, 4096)])
def test_flashmla_backend_matches_cpkv_and_the_reference(peer, heads, s_kv):
    """Distinct random keys per query, invalid indices (-1 and >= S) in every row, one row with none valid."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    t, topk = 256, 2048
    q = torch.randn(t, heads, 576, generator=gen, device="cuda").to(torch.bfloat16)
    kv = torch.randn(s_kv, 576, generator=gen, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(s_kv, device="cuda", generator=gen)[:topk] for _ in range(t)]).int()
    idx[:, ::7] = -1
    idx[:, 3::11] = s_kv + 5
    idx[5] = -1
    scale = 576 ** -0.5
    got, lse = sparse_mla(q, kv, idx, scale, backends=resolve(q.device, sparse_mla="flashmla"))
    ours, lse_o = sparse_mla(q, kv, idx, scale, backends=resolve(q.device, sparse_mla="cpkv"))
    ref, _ = sparse_mla_ref(q, kv, idx, scale, 512, dtype=torch.float64)
    assert got.shape == ours.shape == (t, heads, 512) and got.dtype == torch.bfloat16
    assert _cos(got, ours) <= 1e-8  # the same float32 sums, apart from their order (8.5e-11 and 1.3e-10 measured)
    assert _cos(got, ref) <= 1e-5 and _cos(ours, ref) <= 1e-5  # bf16 outputs: 1.9e-6 measured for FlashMLA
    assert float((got.double() - ref).abs().max() / ref.abs().max()) <= 2e-2
    assert not bool(got[5].any())  # no valid key: zero output
    fin = lse.isfinite() & lse_o.isfinite()
    assert bool((lse.isfinite() == lse_o.isfinite()).all()) and float((lse[fin] - lse_o[fin]).abs().max()) <= 1e-4


def test_glm5_layers_on_flashmla_run_without_a_host_sync(peer, monkeypatch):
    """GLM-5's first 2 layers at cp 2 (sparse attention in both) under the sync check with CPKV_SPARSE_MLA=flashmla
    (the rank processes inherit it): finite logits within 5e-2 of max |logit| of the run on cpkv's kernel."""
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_jobs
    from cpkv.engine.instruments import MeasureConfig
    from cpkv.scheduler.trace import TraceRequest

    trace = [TraceRequest("a0", 0.0, 3000), TraceRequest("a1", 0.0, 4500, None, "a0")]
    cfg = EngineConfig(model="glm5", num_layers=2, cp=2, device="cuda", page_size=64, pages_per_rank=200,
                       chunk_size=4096, max_requests=1, warmup=True)
    runs = {}
    for backend in ("flashmla", "cpkv"):
        monkeypatch.setenv("CPKV_SPARSE_MLA", backend)
        (runs[backend],) = run_jobs([(cfg, trace, MeasureConfig(sync_check=True))], timeout_s=500)
    for res in runs.values():
        assert [r.id for r in res.requests] == ["a0", "a1"] and res.stats["attention"]["sparse"] > 0
    for a, b in zip(runs["flashmla"].requests, runs["cpkv"].requests):
        assert bool(torch.isfinite(a.logits).all()), a.id
        assert float((a.logits - b.logits).abs().max() / b.logits.abs().max()) <= 5e-2, a.id
