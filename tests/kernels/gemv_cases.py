"""Cases of the fp8 GEMV (``cpkv.kernels.fp8_gemm.gemv``) run by Triton's interpreter on CPU tensors (not collected by
pytest: ``test_fp8_gemv.py`` runs each case in a subprocess with TRITON_INTERPRET=1, set before Triton loads).

    python tests/kernels/gemv_cases.py <case>      exit 0 when every check holds

Tolerance (``within_bound``), against the float64 product of the dequantised operands (``ref64``): the kernel
forms each 128-group's dot of exact fp8 x fp8 products in float32 (at most 128 roundings), scales it (2), adds it
to the float32 accumulator (one per group) and, split over K, adds the partials (fewer than G more), so its float32
value is within (130 + 2 G) 2^-24 A of the exact one, A = sum |q s w ws| over K (the product of the absolute
values); the output dtype's rounding adds half an ulp of the value: |y - ref| <= 2^-p |ref| + (130 + 2 G) 2^-23 A
(p = 8 bf16, 11 fp16, 24 fp32; the bound doubled for slack). Bit-for-bit where the arithmetic is the same: the
two reductions, TMA boxes and pointer loads, a row alone and in a batch of the same BM, two runs.
"""
from __future__ import annotations

import sys

import torch
from fused_cases import patch_interpreter_index, patch_interpreter_rounding

FP8 = torch.float8_e4m3fn
_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q fp8 [m, k] with row 0's group 1 zero (scale 0, as the quantisation writes it), s float32 (m, k/128)
    outer-dim-major and varying per group, w fp8 [n, k], ws float32 [ceil(n/128), k/128] varying per block over
    three decades."""
    from cpkv.model.linear import empty_quant

    gen = torch.Generator().manual_seed(seed)
    g = k // 128
    q = (torch.randn(m, k, generator=gen) * 40).clamp(-448, 448).to(FP8)
    s = empty_quant(m, k, torch.device("cpu"))[1]
    s.copy_(torch.rand(m, g, generator=gen) * 2 + 0.05)
    if g > 1:
        q[0, 128:256] = 0
        s[0, 1] = 0
    w = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(FP8)
    ws = 10 ** (torch.rand(-(-n // 128), g, generator=gen) * 3 - 5)
    return q, s, w, ws


def ref64(q, s, w, ws) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exact product in float64, the product of absolute values A) [M, N]."""
    from cpkv.kernels.fp8_gemm.ref import act_dequant_ref, dequant_blocks

    a, b = act_dequant_ref(q, s).double(), dequant_blocks(w, ws, torch.float64)
    return a @ b.t(), a.abs() @ b.abs().t()


def within_bound(y: torch.Tensor, q, s, w, ws) -> None:
    exact, absolute = ref64(q, s, w, ws)
    g = q.shape[1] // 128
    bound = 2.0 ** -_BITS[y.dtype] * exact.abs() + (130 + 2 * g) * 2.0 ** -23 * absolute
    err = (y.double() - exact).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"{tuple(y.shape)} {y.dtype}: error {float(err.flatten()[worst]):.3e} over "
                                        f"the bound {float(bound.flatten()[worst]):.3e} at {divmod(worst, y.shape[1])}")


def case_shapes() -> None:
    """Rows 1..64 (BM 16, 32, 64), N tails (N not a multiple of BLOCK_N, nor of 128), K of 1..10 groups, split 1 and
    split over K (both reductions), TMA boxes and pointer loads, three output dtypes: within the bound; the
    reductions and the two load forms give the same bytes."""
    from cpkv.kernels.fp8_gemm.gemv import GemvConfig, gemv, plan

    cases = [(1, 256, 512, 128), (3, 200, 384, 64), (16, 576, 1280, 128), (17, 130, 256, 32), (33, 96, 128, 32),
             (64, 300, 640, 128), (5, 1000, 1024, 128)]
    splits = set()
    for i, (m, n, k, bn) in enumerate(cases):
        q, s, w, ws = operands(m, n, k, i)
        outs = {}
        for tma in (True, False):
            for reduce in ("ticket", "reduce"):
                cfg = GemvConfig(block_n=bn, tma=tma, reduce=reduce, min_groups=1, waves=2)
                for dtype in (torch.bfloat16, torch.float32) if (tma, reduce) == (True, "ticket") else (torch.float32,):
                    y = gemv(q, s, w, ws, cfg=cfg, dtype=dtype, sms=4)
                    assert y.shape == (m, n) and y.dtype == dtype
                    within_bound(y, q, s, w, ws)
                outs[tma, reduce] = y
        first = outs[True, "ticket"]
        assert all(torch.equal(y, first) for y in outs.values()), (m, n, k)
        splits.add(plan(m, n, k, 4, cfg).split)
    assert 1 in splits and max(splits) >= 4, splits  # direct stores and split K both ran
    q, s, w, ws = operands(4, 256, 512, 9)
    within_bound(gemv(q, s, w, ws, dtype=torch.float16, sms=4), q, s, w, ws)


def case_split_one() -> None:
    """Many column tiles for few SMs: split 1, out stored directly by each program (no workspace), within the
    bound; a strided out (rows of a wider buffer) written in its columns only."""
    from cpkv.kernels.fp8_gemm.gemv import GemvConfig, gemv, plan

    q, s, w, ws = operands(6, 200, 384, 20)
    cfg = GemvConfig(block_n=32, waves=1)
    assert plan(6, 200, 384, 4, cfg).split == 1
    y = gemv(q, s, w, ws, cfg=cfg, sms=4)
    within_bound(y, q, s, w, ws)
    wide = torch.full((6, 260), 7.0, dtype=torch.bfloat16)
    gemv(q, s, w, ws, out=wide[:, 30:230], cfg=cfg, sms=4)
    assert torch.equal(wide[:, 30:230], y) and bool((wide[:, :30] == 7).all()) and bool((wide[:, 230:] == 7).all())


def case_deterministic_and_batch_invariant() -> None:
    """Two runs give the same bytes; each row alone (M 1) gives the bytes it has in a batch of 13 (both BM 16): the
    split and the summation order do not depend on M or on the other rows."""
    from cpkv.kernels.fp8_gemm.gemv import GemvConfig, gemv

    q, s, w, ws = operands(13, 384, 1024, 30)
    cfg = GemvConfig(min_groups=1, waves=2)
    y = gemv(q, s, w, ws, cfg=cfg, sms=4)
    assert torch.equal(gemv(q, s, w, ws, cfg=cfg, sms=4), y)
    for r in (0, 5, 12):
        one = gemv(q[r:r + 1], s[r:r + 1], w, ws, cfg=cfg, sms=4)
        assert torch.equal(one, y[r:r + 1]), r


def case_tickets_left_zeroed() -> None:
    """The caller's counters are zero after every ticket-reduced call, so one set serves every later call (other
    shapes and splits included)."""
    from cpkv.kernels.fp8_gemm.gemv import GemvConfig, gemv, new_tickets

    tickets = new_tickets(512, "cpu")
    cfg = GemvConfig(min_groups=1, waves=4)
    for m, n, k in [(2, 512, 1024), (7, 300, 512), (2, 512, 1024)]:
        q, s, w, ws = operands(m, n, k, m * n)
        y = gemv(q, s, w, ws, tickets=tickets, cfg=cfg, sms=4)
        within_bound(y, q, s, w, ws)
        assert bool((tickets == 0).all()), tickets


def case_linear_dispatch() -> None:
    """A Linear whose backends run Triton with fp8_gemv_rows 4: a QuantAct of 1..4 rows goes through the GEMV (the
    same bytes as a direct call), of 5 rows not (``_scaled_mm``: here replaced by a marker)."""
    from cpkv.kernels.fp8_gemm.gemv import gemv
    from cpkv.kernels.platform import Backends
    from cpkv.model import linear as lin

    lin._scaled_mm = lambda x, w, w_scale: "scaled_mm"
    on = Backends(triton=True, fp8_gemv_rows=4)
    q, s, w, ws = operands(5, 256, 512, 40)
    layer = lin.Linear(w, ws, on)
    for m in (1, 4):
        got = layer(lin.QuantAct(q[:m], s[:m]))
        assert got.dtype == torch.bfloat16 and torch.equal(got, gemv(q[:m], s[:m], w, ws)), m
    assert layer(lin.QuantAct(q, s)) == "scaled_mm"


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


if __name__ == "__main__":
    patch_interpreter_rounding()
    patch_interpreter_index()
    CASES[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
