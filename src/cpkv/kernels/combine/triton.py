"""Triton kernel: the MoE combine (reference: ``cpkv.kernels.combine.ref``).

    combine(y [R, D], inv int64 [T*k], add [T, D] | None, out [T, D])
        out[t] = rne(sum_{j < k} y[inv[t k + j]]) (float32, j in order), then rne(out[t] + add[t]) with ``add``

BLOCK_T tokens x BLOCK_D columns per program, column blocks fastest. The k rows of a token are summed in order
j = 0 .. k - 1; torch's reduction over k may pair them in another order (float32 sums: the bf16 result within
one ulp). Any T (0 included), any D.
"""
from __future__ import annotations

import torch

from cpkv.kernels.fp8_gemm.triton import _jit, tl
from cpkv.kernels.grid import cdiv, check_grid, flat_grid

BLOCK_T, BLOCK_D = 4, 512


@_jit
def _combine(Y, INV, ADD, OUT, T, D, stride_y, stride_a, stride_o, NB, K: tl.constexpr, HAS_ADD: tl.constexpr,
             BT: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    cb, tb = pid % NB, pid // NB
    toks = tb * BT + tl.arange(0, BT)
    cols = cb * BD + tl.arange(0, BD)
    tmask = toks < T
    m2 = tmask[:, None] & (cols < D)[None, :]
    t64 = toks.to(tl.int64)
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(INV + t64 * K + j, mask=tmask, other=0)
        acc += tl.load(Y + row[:, None] * stride_y + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    out = acc.to(OUT.dtype.element_ty)
    if HAS_ADD:
        a = tl.load(ADD + t64[:, None] * stride_a + cols[None, :], mask=m2, other=0.0)
        out = (out.to(tl.float32) + a.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + t64[:, None] * stride_o + cols[None, :], out, mask=m2)


def combine(y: torch.Tensor, inv: torch.Tensor, add: torch.Tensor | None, out: torch.Tensor) -> None:
    """Writes out [T, D] (module docstring); unit column strides, inv contiguous int64."""
    t, d = out.shape
    if t == 0:
        return
    k = inv.shape[0] // t
    nb = cdiv(d, BLOCK_D)
    _combine[check_grid(flat_grid(nb, cdiv(t, BLOCK_T)))](
        y, inv, add if add is not None else out, out, t, d, y.stride(0), add.stride(0) if add is not None else 0,
        out.stride(0), nb, K=k, HAS_ADD=add is not None, BT=BLOCK_T, BD=BLOCK_D, num_warps=4,
        enable_fp_fusion=False)
