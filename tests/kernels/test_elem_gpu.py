"""GPU tests (skip without CUDA or Triton) of the index-row kernel and the MoE router kernel at GLM-5's
shapes, T = 1, 77, 4096: index rows against ``cpkv.kernels.index_rows.ref`` (scales and folded weights within 2e-5
relative, fp8 values within one e4m3 step), router scores within 2^-18 sum_k |x_k g_k| / 4 + 2^-22 of a float64
reference (bf16 and float32 gates), and ``route`` choosing the float32 path's experts except at near ties. Timings:
``benchmarks/elem_kernels.py``.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)

TOKENS = [1, 77, 4096]


def _near_fp8(got: torch.Tensor, want: torch.Tensor) -> bool:
    g, w = got.float(), want.float()
    return bool(((g - w).abs() <= w.abs() * 2.0 ** -3 + 2.0 ** -9).all()) and float((g != w).float().mean()) <= 0.02


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)).max())


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("interleaved", [True, False])
def test_index_rows(t, interleaved):
    from cpkv.indexer.quant import FP8, dequantize_index_rows
    from cpkv.kernels.index_rows import triton as kern
    from cpkv.kernels.index_rows.ref import index_keys_ref, index_queries_ref
    from cpkv.model.ops import Rotary

    gen = torch.Generator(device="cuda").manual_seed(900 + t)
    rot = Rotary.build(torch.arange(t, device="cuda") * 13, 64, 1e6)
    k = (torch.randn(t, 128, generator=gen, device="cuda") * 2).bfloat16()
    w = (torch.randn(128, generator=gen, device="cuda") * 0.2 + 1).bfloat16()
    b = (torch.randn(128, generator=gen, device="cuda") * 0.1).bfloat16()
    q = (torch.randn(t, 32, 128, generator=gen, device="cuda") * 2).bfloat16()
    wts = torch.rand(t, 32, generator=gen, device="cuda") + 0.1
    args = (rot.cos, rot.sin, 64, interleaved)
    rows = torch.zeros(t, 132, dtype=torch.uint8, device="cuda")
    k8, ks = dequantize_index_rows(rows)
    kern.index_rows(k, 1, *args, k8, ks, norm=(w, b, 1e-6))
    want_k, want_s = dequantize_index_rows(index_keys_ref(k, w, b, *args))
    assert _rel(ks, want_s) <= 2e-5 and _near_fp8(k8, want_k)
    q8 = torch.zeros(t, 32, 128, dtype=FP8, device="cuda")
    folded = torch.zeros(t, 32, device="cuda")
    kern.index_rows(q.view(-1, 128), 32, *args, q8.view(-1, 128), folded.view(-1), weights=wts.view(-1))
    want_q, want_w = index_queries_ref(q, wts, *args)
    assert _rel(folded, want_w) <= 2e-5 and _near_fp8(q8, want_q)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32])
def test_router_scores(t, gate_dtype):
    from cpkv.kernels.router import triton as kern

    gen = torch.Generator(device="cuda").manual_seed(950 + t)
    x = torch.randn(t, 6144, generator=gen, device="cuda").bfloat16()
    gate = (torch.randn(256, 6144, generator=gen, device="cuda") / 6144 ** 0.5).to(gate_dtype)
    want = (x.double() @ gate.double().t()).sigmoid()
    tol = (x.double().abs() @ gate.double().abs().t()) * 2.0 ** -20 + 2.0 ** -22
    out = torch.full((t, 256), float("nan"), device="cuda")
    kern.router_scores(x, gate, out)
    assert bool(((out.double() - want).abs() <= tol).all())


@pytest.mark.parametrize("preset", ["glm5", "deepseek-v32"])
def test_route_chooses_the_float32_paths_experts(preset):
    from cpkv.config import PRESETS
    from cpkv.kernels.router.ref import route_differences
    from cpkv.model.moe import route

    cfg = PRESETS[preset]
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(4096, cfg.hidden_size, generator=gen, device="cuda").bfloat16()
    gate = (torch.randn(256, cfg.hidden_size, generator=gen, device="cuda") / cfg.hidden_size ** 0.5).bfloat16()
    bias = torch.randn(256, generator=gen, device="cuda") * 0.01
    idx, w = route(x, gate, bias, cfg)
    idx_ref, w_ref = route(x, gate, bias, cfg, fused=False)
    want = (x.double() @ gate.double().t()).sigmoid()
    tol = (x.double().abs() @ gate.double().abs().t()) * 2.0 ** -20 + 2.0 ** -22
    differ, unexplained = route_differences(idx, idx_ref, want + bias.double(), 2 * tol.max(dim=1).values,
                                            cfg.n_group, cfg.topk_group)
    assert not unexplained and differ <= 40
    same = (idx.sort(dim=1).values == idx_ref.sort(dim=1).values).all(dim=1)
    wg, wr = w.gather(1, idx.argsort(dim=1))[same], w_ref.gather(1, idx_ref.argsort(dim=1))[same]
    assert bool(((wg - wr).abs() <= 1e-5 * wr.abs()).all())
