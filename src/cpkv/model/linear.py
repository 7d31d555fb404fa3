"""A linear layer's weight as the model keeps it: the compute dtype, or fp8 with 128 x 128 block scales.

    Linear(weight [N, K])                         y = x W^T (F.linear)
    Linear(weight fp8 [N, K], scale f32 [N/128, K/128])
                                                  y = quant(x) dequant(W)^T: the block-scaled fp8 GEMM
    quant_act(x [M, K]) -> QuantAct(q fp8 [M, K], s float32 (M, K/128) strides (1, M))
        per token per 1 x 128 group (one Triton kernel where the backends run Triton); a QuantAct feeds every fp8
        Linear reading the same input (quantised once)
    fp8_linear(x | QuantAct, w, w_scale) -> [M, N] bf16        (the dispatch point of kernels/fp8_gemm)

Path: cpkv's Triton GEMV (``kernels.fp8_gemm.gemv``: the weight streamed once, split over K with a deterministic
reduction) for a quantised activation of at most ``Backends.fp8_gemv_rows`` rows (``CPKV_FP8_GEMV``: decode's
few rows, where cuBLAS reads the weight at about half the copy rate) where the backends run Triton; else
``torch._scaled_mm`` with DeepSeek block scales (1 x 128 activation groups, 128 x 128 weight blocks;
cuBLAS, sm90+) when the tensors are on CUDA, the output dtype is bfloat16, K is a multiple of 512 (whole
128-groups, in the multiple of 4 cuBLAS wants for the scale rows) and N of 16. Elsewhere (CPU, other
shapes, or a weight shape this build's ``_scaled_mm`` refused once: remembered, one line on stderr) the
reference ``kernels.fp8_gemm.ref.fp8_linear_ref``: the fp8 weight dequantised per call in float32, the
activation not quantised. Neither path reads anything back to the host. A Linear holds the backends it runs
with (``cpkv.kernels.platform.Backends``: the model's, or its weight's device's when built on its own).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cpkv.kernels.fp8_gemm.ref import BLOCK, act_dequant_ref, act_quant_ref, dequant_blocks, fp8_linear_ref
from cpkv.kernels.platform import Backends, backends_for

FP8 = torch.float8_e4m3fn
_GEMV_OUT = (torch.bfloat16, torch.float16, torch.float32)  # the output dtypes the fp8 GEMV writes
_SCALED_MM_FAILED: set[tuple[int, int]] = set()  # weight shapes (N, K) torch._scaled_mm refused once


@dataclass
class QuantAct:
    """An activation quantised per token per 1 x 128 group: q fp8 [M, K], s float32 (M, ceil(K/128)) with
    strides (1, M) (outer-dim-major, as ``torch._scaled_mm`` wants); ``dtype``: the output dtype; ``x``: the
    unquantised input when the caller has it (a dense layer reading the same input takes it)."""

    q: torch.Tensor
    s: torch.Tensor
    dtype: torch.dtype = torch.bfloat16
    x: torch.Tensor | None = None

    def dequant(self) -> torch.Tensor:
        """[M, K] in ``dtype``: the input itself when kept, else the dequantised values."""
        return self.x if self.x is not None else act_dequant_ref(self.q, self.s).to(self.dtype)


@dataclass
class Linear:
    """One linear layer's weight [N, K]: the compute dtype (``scale`` None) or float8_e4m3fn with float32
    ``scale`` [ceil(N/128), ceil(K/128)] (the checkpoint's ``weight_scale_inv``); ``backends``: the kernels it
    runs (None: ``backends_for`` its weight's device, resolved here once); ``tickets``: the fp8 GEMV's split-K
    counters of this weight (made here, zeroed, where that kernel may run on a CUDA weight; the GEMV leaves them
    zeroed, so one Linear must not run on two streams at once)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    backends: Backends | None = None
    tickets: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.backends is None:
            self.backends = backends_for(self.weight.device)
        if self.tickets is None and self.fp8 and self.backends.fp8_gemv_rows and self.weight.is_cuda:
            from cpkv.kernels.fp8_gemm import gemv

            self.tickets = gemv.new_tickets(self.weight.shape[0], self.weight.device)

    @property
    def fp8(self) -> bool:
        return self.scale is not None

    def __call__(self, x: torch.Tensor | QuantAct) -> torch.Tensor:
        """x [M, K] (or its QuantAct) -> [M, N] in x's dtype."""
        if self.scale is not None:
            return fp8_linear(x, self.weight, self.scale, self.backends, self.tickets)
        return F.linear(x.dequant() if isinstance(x, QuantAct) else x, self.weight)

    def quantised_input(self, x: torch.Tensor | QuantAct) -> torch.Tensor | QuantAct:
        """x itself, or (an fp8 weight on the ``_scaled_mm`` path) x quantised, to be shared by every fp8
        layer reading x. A QuantAct (x quantised already, e.g. by its fused norm) is returned as it is."""
        if isinstance(x, QuantAct):
            return x
        return quant_act(x, self.backends) if self.quantises(x) else x

    def quantises(self, x: torch.Tensor) -> bool:
        """True when ``prepare`` quantises an input with x's device, dtype and shape (the fused norms ask
        before they write x, to quantise it in the same pass)."""
        return self.fp8 and scaled_mm_ok(x, self.weight)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in ``dtype`` (fp8 dequantised)."""
        return self.weight.to(dtype) if self.scale is None else dequant_blocks(self.weight, self.scale, dtype)

    @classmethod
    def cat(cls, parts: list["Linear"]) -> "Linear | None":
        """The parts' rows stacked into one Linear [sum N, K], or None when fp8 block rows would not stay
        whole (an fp8 part but the last whose N is not a multiple of 128) or the parts mix kinds."""
        backends = parts[0].backends
        if all(p.scale is None for p in parts):
            return cls(torch.cat([p.weight for p in parts]), None, backends)
        if not all(p.fp8 for p in parts) or any(p.weight.shape[0] % BLOCK for p in parts[:-1]):
            return None
        return cls(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), backends)


def scaled_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when ``torch._scaled_mm``'s block-scaled path takes x [M, K] and w fp8 [N, K] (module docstring)."""
    n, k = w.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == FP8 and k % (4 * BLOCK) == 0 and n % 16 == 0
            and hasattr(torch, "_scaled_mm") and (n, k) not in _SCALED_MM_FAILED)


def quant_act(x: torch.Tensor, backends: Backends | None = None) -> QuantAct:
    """x [M, K] -> QuantAct (the Triton kernel where ``backends`` (None: ``backends_for(x)``) run Triton; else
    ``act_quant_ref``, relaid out)."""
    m, k = x.shape
    if (backends or backends_for(x)).triton:
        from cpkv.kernels.fp8_gemm import triton as kern

        q, s = empty_quant(m, k, x.device)
        kern.act_quant(x.contiguous(), q, s)
        return QuantAct(q, s, x.dtype, x)
    q, s = act_quant_ref(x)
    s_col = empty_quant(m, k, x.device)[1]
    s_col.copy_(s)  # strides (1, M) for any M (a (1, G) tensor's .contiguous() would keep strides (G, 1))
    return QuantAct(q, s_col, x.dtype, x)


def empty_quant(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [m, k], float32 (m, ceil(k/128)) with strides (1, m4)), uninitialised; m4 = m rounded up to a
    multiple of 4: both are views of buffers of m4 rows, so ``_scaled_mm`` can hand cuBLAS a scale matrix
    whose leading dimension is a multiple of 4 (it refuses others, e.g. one decode token) without a copy."""
    g, m4 = -(-k // BLOCK), _round4(m)
    q = torch.empty(m4, k, dtype=FP8, device=device)
    return q[:m], torch.empty(g, m4, dtype=torch.float32, device=device).t()[:m]


def _round4(m: int) -> int:
    return max(4, -(-m // 4) * 4)


def fp8_linear(x: torch.Tensor | QuantAct, w: torch.Tensor, w_scale: torch.Tensor,
               backends: Backends | None = None, tickets: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (or its QuantAct), w fp8 [N, K], w_scale float32 [ceil(N/128), ceil(K/128)] -> [M, N] in
    x's dtype (module docstring: the path; ``backends``: those of ``quant_act`` and the GEMV's choice, None:
    ``backends_for(w)``; ``tickets``: the GEMV's counters for w, ``Linear.tickets``)."""
    if isinstance(x, QuantAct):
        return _block_scaled(x, w, w_scale, backends, tickets)
    if scaled_mm_ok(x, w):
        return _block_scaled(quant_act(x, backends), w, w_scale, backends, tickets)
    return fp8_linear_ref(x, w, w_scale)


def gemv_ok(x: QuantAct, w: torch.Tensor, backends: Backends) -> bool:
    """True when the Triton fp8 GEMV takes x's product with w: the backends run Triton and send it x's 1 ..
    ``fp8_gemv_rows`` rows, K a multiple of 128, unit K strides, an output dtype it writes."""
    m, k = x.q.shape
    return (backends.triton and 0 < m <= backends.fp8_gemv_rows and k % BLOCK == 0 and w.dtype == FP8
            and x.q.stride(1) == 1 and w.stride(1) == 1 and x.dtype in _GEMV_OUT)


def _block_scaled(x: QuantAct, w: torch.Tensor, w_scale: torch.Tensor, backends: Backends | None,
                  tickets: torch.Tensor | None) -> torch.Tensor:
    if gemv_ok(x, w, backends or backends_for(w)):
        from cpkv.kernels.fp8_gemm import gemv

        return gemv.gemv(x.q, x.s, w, w_scale, tickets=tickets, dtype=x.dtype)
    return _scaled_mm(x, w, w_scale)


def _scaled_mm(x: QuantAct, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    shape = tuple(w.shape)
    if x.q.shape[0] == 0 or shape in _SCALED_MM_FAILED:
        return fp8_linear_ref(x.dequant(), w, w_scale)
    m = x.q.shape[0]
    q, s = _padded(x.q, x.s)
    try:
        out = torch._scaled_mm(q, w.t(), scale_a=s, scale_b=w_scale.t(), out_dtype=x.dtype)
    except torch.OutOfMemoryError:
        raise  # not a refused layout: the dequantising path would allocate more, and hide where memory ran out
    except (RuntimeError, NotImplementedError) as exc:  # a build / GPU without this block layout: remember
        _SCALED_MM_FAILED.add(shape)
        print(f"cpkv: torch._scaled_mm refused the 1x128 / 128x128 block-scaled layout for a weight of shape "
              f"{list(shape)} ({exc}); that layer runs dequantised", file=sys.stderr)
        return fp8_linear_ref(x.dequant(), w, w_scale)
    return out if out.shape[0] == m else out[:m]


def _padded(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q fp8 [M, K], s (M, G) outer-dim-major -> the same with a multiple of 4 rows (cuBLAS's scale leading
    dimension): the ``empty_quant`` buffers' own padding rows when present (their values only reach output
    rows that are dropped: GEMM rows are independent), else a zero-padded copy."""
    m, k = q.shape
    m4 = _round4(m)
    if m4 == m and s.stride() == (1, m):
        return q, s
    if s.stride() == (1, m4) and q.stride() == (k, 1) and _room(q, m4 * k) and _room(s, s.shape[1] * m4):
        return q.as_strided((m4, k), (k, 1)), s.as_strided((m4, s.shape[1]), (1, m4))
    qp = torch.zeros(m4, k, dtype=q.dtype, device=q.device)
    qp[:m] = q
    sp = torch.zeros(s.shape[1], m4, dtype=s.dtype, device=s.device).t()
    sp[:m] = s
    return qp, sp


def _room(t: torch.Tensor, elements: int) -> bool:
    """True when ``t``'s storage holds ``elements`` elements from its offset."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + elements) * t.element_size()


def swiglu(x: torch.Tensor | QuantAct, gate_up: Linear, down: Linear) -> torch.Tensor:
    """x [T, D] (or its QuantAct) -> down(silu(g) * u) [T, D], (g | u) = gate_up(x) [T, 2I]. fp8 ``down`` on the
    ``_scaled_mm`` path: SiLU, product and the 1 x 128 quantisation in one Triton kernel (where ``down``'s
    backends run Triton)."""
    gu = gate_up(gate_up.quantised_input(x))
    m, i = gu.shape[0], gu.shape[1] // 2
    triton = down.backends.triton
    if down.fp8 and scaled_mm_ok(gu, down.weight) and triton:
        from cpkv.kernels.fp8_gemm import triton as kern

        q, s = empty_quant(m, i, gu.device)
        kern.swiglu_quant(gu, None, q, s)
        return down(QuantAct(q, s, gu.dtype))
    if triton and gu.stride(-1) == 1:  # SiLU and product in one pass (F.silu(g) * u's bytes)
        from cpkv.kernels.swiglu import triton as act

        a = torch.empty(m, i, dtype=gu.dtype, device=gu.device)
        act.swiglu_weighted(gu, None, a)
        return down(a)
    g, u = gu.chunk(2, dim=-1)
    return down(F.silu(g) * u)
