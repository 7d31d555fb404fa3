"""Triton kernel: the weighted SwiGLU activation (reference: ``cpkv.kernels.swiglu.ref``).

    swiglu_weighted(gu [N, 2I] (gate | up), rw float32 [N] | None, out [N, I], rows int32 [1] | None)

Per element, in float32 with the reference's three roundings to out's dtype:
    a = rne(div_rn(g, 1 + exp(-g)));  a = rne(a * u);  a = rne(a * rw)
``rw`` None: the plain SwiGLU of the dense MLPs (the first two roundings: ``F.silu(g) * u``'s bytes).
``exp`` is libdevice's ``expf`` on the GPU (the function torch's SiLU kernel calls: the same bytes as
``F.silu``), ``tl.exp`` under Triton's interpreter (which cannot run libdevice: a SiLU an ulp off at times, the
products after it a few ulps at most).
BLOCK_M x BLOCK_N tiles on a flat grid (column blocks fastest); any N (0 included) and any I. ``rows``: a
device row count (the grouped experts' live rows, offs[-1]): rows at or past it are neither read nor written (a
static buffer of worst-case rows costs only its real ones; no host sync).
"""
from __future__ import annotations

import os

import torch

from cpkv.kernels.fp8_gemm.triton import _jit, _live_rows, tl
from cpkv.kernels.grid import cdiv, check_grid, flat_grid

try:
    from triton.language.extra.cuda import libdevice
except ImportError:  # no Triton, or a build without the CUDA libdevice wrappers: tl.exp only
    libdevice = None

BLOCK_M, BLOCK_N = 16, 128


@_jit
def _swiglu_weighted(GU, RW, OUT, M, I, stride_gu, stride_o, G, NROWS, LIBDEVICE: tl.constexpr,
                     WEIGHTED: tl.constexpr, HAS_NROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    g, mb = pid % G, pid // G
    rows = mb * BM + tl.arange(0, BM)
    cols = g * BN + tl.arange(0, BN)
    rmask = rows < _live_rows(M, NROWS, HAS_NROWS)
    m2 = rmask[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)
    src = GU + r64[:, None] * stride_gu + cols[None, :]
    gate = tl.load(src, mask=m2, other=0.0).to(tl.float32)
    up = tl.load(src + I, mask=m2, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    a = tl.div_rn(gate, 1.0 + e).to(OUT.dtype.element_ty)
    a = (a.to(tl.float32) * up).to(OUT.dtype.element_ty)
    if WEIGHTED:
        rw = tl.load(RW + rows, mask=rmask, other=0.0)
        a = (a.to(tl.float32) * rw[:, None]).to(OUT.dtype.element_ty)
    tl.store(OUT + r64[:, None] * stride_o + cols[None, :], a, mask=m2)


def swiglu_weighted(gu: torch.Tensor, rw: torch.Tensor | None, out: torch.Tensor,
                    rows: torch.Tensor | None = None) -> None:
    """Writes out [N, I] from gu [N, 2I] and rw float32 [N] or None (module docstring); unit column strides;
    ``rows``: int32 [1] on the device, the rows to compute (the rest untouched)."""
    m, i = out.shape
    if m == 0 or i == 0:
        return
    g = cdiv(i, BLOCK_N)
    exact_exp = libdevice is not None and not os.environ.get("TRITON_INTERPRET")
    _swiglu_weighted[check_grid(flat_grid(g, cdiv(m, BLOCK_M)))](
        gu, out if rw is None else rw, out, m, i, gu.stride(0), out.stride(0), g, out if rows is None else rows,
        LIBDEVICE=exact_exp, WEIGHTED=rw is not None, HAS_NROWS=rows is not None, BM=BLOCK_M, BN=BLOCK_N,
        num_warps=4, enable_fp_fusion=False)
