"""Cases of the index-row kernel and the router kernel under Triton's interpreter on CPU tensors (not
collected by pytest: ``test_elem_kernels.py`` runs each in a subprocess with TRITON_INTERPRET=1).

    python tests/kernels/elem_cases.py <case>      exit 0 when every check holds

Tolerances: index rows (keys and queries) with scales and folded weights within 1e-5 relative of the float32
reference (the module docstring of ``cpkv.kernels.index_rows.triton`` states 2e-5), fp8 values within one e4m3 step; router logits within
2^-18 sum_k |x_k g_k| of a float64 reference (the float32 reference meets the same bound), scores within a quarter
of that (sigmoid' <= 1/4) plus 2^-22; the experts route chooses equal to the float32 reference's except at a
near tie (two choices, or two groups' scores, within twice that bound).
"""
from __future__ import annotations

import sys

import torch

from fused_cases import (SKIP, _gen, near_fp8, patch_interpreter_index,  # noqa: F401  (same directory)
                         patch_interpreter_rounding, rel)

LOGIT_TOL = 2.0 ** -18


def patch_interpreter_bf16_dot() -> None:
    """Triton 3.6's interpreter multiplies bfloat16 operands of ``tl.dot`` as their raw uint16 bits; this makes it
    widen them to float32 first (exact), as the tensor cores take them."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16 or h.dtype == tl.bfloat16:
            bits = np.ascontiguousarray(h.data).astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


def case_index_rows_shapes() -> None:
    from cpkv.indexer.quant import FP8, dequantize_index_rows
    from cpkv.kernels.index_rows import triton as kern
    from cpkv.kernels.index_rows.ref import index_keys_ref, index_queries_ref
    from cpkv.model.ops import Rotary

    # (tokens, heads, D, rope, interleaved): 148 to 280 rows over several blocks and a partial last one; D 64 / 128
    # / 256
    shapes = [(5, 1, 128, 64, True), (3, 1, 64, 32, False), (3, 4, 64, 32, False), (3, 4, 128, 64, True),
              (150, 1, 128, 64, True), (37, 1, 128, 64, False), (37, 4, 128, 64, True), (2, 3, 64, 32, False),
              (70, 4, 128, 64, True), (70, 4, 128, 64, False), (40, 1, 256, 64, True)]
    for t, h, d, r, interleaved in shapes:
        gen = _gen(t * d + r + h)
        rot = Rotary.build(torch.arange(t) * 31 + 1, r, 10000.0)
        x = (torch.randn(t, h, d, generator=gen) * 2).bfloat16()
        at = (t, h, d, r, interleaved)
        if h == 1:
            k = x[:, 0]
            k[1] = 0.5  # an all-equal row: LayerNorm gives the bias
            k[2] = 0.0
            w = (torch.randn(d, generator=gen) * 0.2 + 1).bfloat16()
            b = (torch.randn(d, generator=gen) * 0.1).bfloat16()
            rows = torch.zeros(t, d + 4, dtype=torch.uint8)
            fp8, scale = dequantize_index_rows(rows)
            kern.index_rows(k, 1, rot.cos, rot.sin, r, interleaved, fp8, scale, norm=(w, b, 1e-6))
            want_fp8, want_s = dequantize_index_rows(index_keys_ref(k, w, b, rot.cos, rot.sin, r, interleaved))
            assert rel(scale, want_s) <= 1e-5, f"key scales at {at}: {rel(scale, want_s)}"
            assert near_fp8(fp8, want_fp8), f"key fp8 values at {at}"
        x[0, 0] = 0.0  # an all-zero row: scale 1e-10, fp8 zeros
        wts = torch.rand(t, h, generator=gen) + 0.1
        q8 = torch.zeros(t, h, d, dtype=FP8)
        folded = torch.zeros(t, h)
        kern.index_rows(x.view(t * h, d), h, rot.cos, rot.sin, r, interleaved, q8.view(t * h, d), folded.view(-1),
                        weights=wts.view(-1))
        want_q, want_w = index_queries_ref(x, wts, rot.cos, rot.sin, r, interleaved)
        assert rel(folded, want_w) <= 1e-5, f"folded weights at {at}: {rel(folded, want_w)}"
        assert near_fp8(q8, want_q), f"query fp8 values at {at}"
        assert float(folded[0, 0]) == float(wts[0, 0]) * 1e-10 or rel(folded[:1, :1], want_w[:1, :1]) <= 2e-5
    empty = torch.zeros(0, 132, dtype=torch.uint8)
    fp8, scale = dequantize_index_rows(empty)
    kern.index_rows(torch.zeros(0, 128), 1, torch.ones(1, 32), torch.zeros(1, 32), 64, True, fp8, scale)  # no rows


def _logit_bound(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return (x.double().abs() @ gate.double().abs().t()) * LOGIT_TOL


def case_router_scores() -> None:
    from cpkv.kernels.router import triton as kern
    from cpkv.kernels.router.ref import router_scores_ref

    for t, k, n, gdtype in [(37, 300, 20, torch.bfloat16), (37, 300, 20, torch.float32), (1, 256, 4, torch.float32),
                            (70, 128, 160, torch.bfloat16),
                            (5, 2100, 40, torch.float32), (5, 2100, 40, torch.bfloat16)]:  # K in 8 slices
        gen = _gen(t + k + n)
        x = (torch.randn(t, k + 2, generator=gen) * 3).bfloat16()[:, 2:]  # a wider row stride
        gate = (torch.randn(n, k, generator=gen) / k ** 0.5).to(gdtype)
        want64 = x.double() @ gate.double().t()
        bound = _logit_bound(x, gate)
        ref32 = router_scores_ref(x, gate)
        assert bool(((ref32.double() - want64.sigmoid()).abs() <= bound / 4 + 2.0 ** -22).all()), "float32 ref"
        out = torch.full((t, n), float("nan"))
        kern.router_scores(x, gate, out)
        err = (out.double() - want64.sigmoid()).abs()
        assert bool((err <= bound / 4 + 2.0 ** -22).all()), f"router scores at {(t, k, n, gdtype)}"
    kern.router_scores(torch.zeros(0, 64).bfloat16(), torch.zeros(8, 64), torch.zeros(0, 8))  # T = 0


def case_route_dispatch() -> None:
    """``route`` through the kernel (backends that run Triton, on CPU tensors) against ``fused=False`` (float32
    torch)."""
    from cpkv.config import PRESETS
    from cpkv.kernels.platform import Backends
    from cpkv.model import moe

    for name in ("glm5", "deepseek-v32"):  # 1 group; 8 groups keeping 4
        _route_case(moe, PRESETS[name], Backends(triton=True))


def _route_case(moe, cfg, backends) -> None:
    e, d, t = cfg.n_routed_experts, 256, 64
    gen = _gen(5)
    x = torch.randn(t, d, generator=gen).bfloat16()
    gate = (torch.randn(e, d, generator=gen) / d ** 0.5).bfloat16()
    bias = torch.randn(e, generator=gen) * 0.01
    scores = moe.router_scores(x, gate, backends)
    want = (x.double() @ gate.double().t()).sigmoid()
    tol = _logit_bound(x, gate) / 4 + 2.0 ** -22
    assert bool(((scores.double() - want).abs() <= tol).all())
    idx, w = moe.route(x, gate, bias, cfg, backends=backends)
    idx_ref, w_ref = moe.route(x, gate, bias, cfg, fused=False)
    from cpkv.kernels.router.ref import route_differences

    differ, unexplained = route_differences(idx, idx_ref, want + bias.double(), 2 * tol.max(dim=1).values,
                                            cfg.n_group, cfg.topk_group)
    assert not unexplained and differ <= t // 50, (differ, unexplained)
    same = (idx.sort(dim=1).values == idx_ref.sort(dim=1).values).all(dim=1)
    wg = w.gather(1, idx.argsort(dim=1))[same]
    wr = w_ref.gather(1, idx_ref.argsort(dim=1))[same]
    assert bool(((wg - wr).abs() <= 1e-5 * wr.abs() + 1e-7).all())


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}

if __name__ == "__main__":
    patch_interpreter_rounding()
    patch_interpreter_index()
    patch_interpreter_bf16_dot()
    CASES[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
