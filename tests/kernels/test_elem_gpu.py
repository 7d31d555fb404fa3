"""GPU tests (skip without CUDA or Triton) of the MoE router kernel at GLM-5's shapes, T = 1, 77, 4096 (the index-row
kernel's: tests/kernels/test_fused_gpu.py): router scores within 2^-18 sum_k |x_k g_k| / 4 + 2^-22 of a float64
reference (bf16 and float32 gates), and ``route`` choosing the float32 path's experts except at near ties. Timings:
``benchmarks/elem_kernels.py``.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)

TOKENS = [1, 77, 4096]


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
