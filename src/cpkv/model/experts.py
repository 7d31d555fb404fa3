"""A rank's routed experts over rows already sorted by expert: the compute half of a MoE layer.

    ExpertWeights: gate_up [E, 2I, D], down [E, D, I] (the rank's E local experts, stacked): the compute
        dtype, or float8_e4m3fn with 128 x 128 block scales gate_up_scale float32 [E, 2I/128, ceil(D/128)]
        and down_scale float32 [E, ceil(D/128), ceil(I/128)] (I a multiple of 128: gate and up blocks whole)
    grouped_swiglu(xs [N, D], offs int32 [E], rw float32 [N], ew) -> [N, D] (xs' dtype)
        row i belongs to local expert e when offs[e-1] <= i < offs[e] (offs: cumulative row ends, on the
        device: no host sync); out[i] = rw[i] * down_e(silu(gate_e xs[i]) * up_e xs[i]). Rows at or past
        offs[-1] are padding: their output is unspecified (callers ignore them).

Routing, the sort by expert and (expert parallelism) moving rows between ranks live in ``cpkv.model.moe``;
this module only multiplies, with the backends the ExpertWeights hold (``cpkv.kernels.platform.Backends``, chosen
once). bf16 weights where ``grouped_mm`` is ``gluon`` (a Hopper GPU with Gluon): the warp-specialised grouped GEMM
of ``kernels/fp8_gemm/gluon_ws.py`` without scales (both GEMMs; SwiGLU x routing weight in one Triton kernel
between them), which reads the weights near the copy rate where ``torch._grouped_mm`` does not (a cached turn's
~100 rows per expert: BENCHMARKS.md). Other dense weights (and ``grouped_mm`` ``torch``, which
``CPKV_GROUPED_MM_TORCH=1`` chooses to compare): ``torch._grouped_mm`` where the dtype and strides allow it, else
one expert at a time (``grouped_swiglu_loop``, also the reference in tests). fp8 weights where the backends run
Triton: the block-scaled grouped GEMM of ``kernels/fp8_gemm`` (rows quantised per 1 x 128 group, gate_up GEMM,
SiLU x up x routing weight quantised again in one kernel, down GEMM; offsets stay on the device); elsewhere the
loop over dequantised experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cpkv.kernels.platform import Backends, backends_for


@dataclass
class ExpertWeights:
    """The local experts of one MoE layer, stacked: gate_up [E, 2I, D] (gate rows first), down [E, D, I];
    fp8 with their block scales when ``gate_up_scale`` / ``down_scale`` are set (module docstring). ``backends``:
    the kernels they run (None: ``backends_for`` the weights' device, resolved here once)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    backends: Backends | None = None

    def __post_init__(self) -> None:
        if self.backends is None:
            self.backends = backends_for(self.gate_up.device)

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])

    @property
    def fp8(self) -> bool:
        return self.gate_up_scale is not None

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, D], down [D, I]) in ``dtype`` (fp8 dequantised)."""
        if not self.fp8:
            return self.gate_up[e], self.down[e]
        from cpkv.kernels.fp8_gemm.ref import dequant_blocks

        return (dequant_blocks(self.gate_up[e], self.gate_up_scale[e], dtype),
                dequant_blocks(self.down[e], self.down_scale[e], dtype))


_GROUPED_FAILED: set[str] = set()  # device types where torch._grouped_mm raised once (then: the loop)


def _grouped_ok(xs: torch.Tensor, ew: ExpertWeights) -> bool:
    if ew.fp8 or not hasattr(torch, "_grouped_mm") or xs.device.type in _GROUPED_FAILED:
        return False
    dtype_ok = xs.dtype == (torch.bfloat16 if xs.is_cuda else torch.float32)
    es = xs.element_size()
    return dtype_ok and all((n * es) % 16 == 0 for n in (xs.shape[1], ew.gate_up.shape[1], ew.down.shape[2]))


def grouped_takes_quantised(ew: ExpertWeights) -> bool:
    """True when ``grouped_swiglu`` runs the fp8 grouped kernel (fp8 experts, Triton): it takes rows quantised
    already."""
    return ew.fp8 and ew.backends.triton


def grouped_swiglu(xs: torch.Tensor, offs: torch.Tensor, rw: torch.Tensor, ew: ExpertWeights,
                   xq: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """xs [N, D] sorted by local expert, offs int32 [E] row ends, rw float32 [N] -> weighted outputs [N, D].
    ``xq``: xs quantised already (fp8 [N, D], float32 [N, ceil(D/128)] row-major; only where
    ``grouped_takes_quantised``): xs then only gives the shape, dtype and device (an expanded empty view will do).
    ``out`` [N, D] (xs' dtype): where the outputs go (the fp8 kernels write it; other paths copy into it)."""
    if grouped_takes_quantised(ew):
        return grouped_swiglu_fp8(xs, offs, rw, ew, xq, out)
    assert xq is None, "quantised rows need the fp8 grouped kernel (grouped_takes_quantised)"
    y = _grouped_gluon(xs, offs, rw, ew, out)
    if y is not None:
        return y
    if _grouped_ok(xs, ew):
        try:
            y = _grouped(xs, offs, rw, ew)
        except RuntimeError:  # a build or device without this grouped GEMM layout: remember, use the loop
            _GROUPED_FAILED.add(xs.device.type)
    y = grouped_swiglu_loop(xs, offs, rw, ew) if y is None else y
    return y if out is None else out.copy_(y)


def _grouped_gluon(xs: torch.Tensor, offs: torch.Tensor, rw: torch.Tensor, ew: ExpertWeights,
                   out: torch.Tensor | None) -> torch.Tensor | None:
    """Both GEMMs through the warp-specialised grouped kernel (bf16, the backends' ``grouped_mm`` ``gluon``;
    ``gluon_ws.BF16``'s switches), or None (nothing launched) where it does not apply. Rows at or past offs[-1]
    are not computed."""
    if ew.backends.grouped_mm != "gluon" or ew.fp8 or xs.dtype != torch.bfloat16 or not xs.is_cuda:
        return None
    from cpkv.kernels.fp8_gemm import gluon_ws
    from cpkv.kernels.fp8_gemm.triton import tile_ends

    r, d = xs.shape
    like = lambda n: xs.new_empty(1, n).expand(r, -1)  # noqa: E731  ([r, n] as a fresh buffer: shape, dtype, device)
    if (gluon_ws.applies(xs, ew.gate_up, like(ew.gate_up.shape[1]))
            or gluon_ws.applies(like(ew.down.shape[2]), ew.down, like(d) if out is None else out)):
        return None  # checked before anything is allocated
    gu = torch.empty(r, ew.gate_up.shape[1], dtype=xs.dtype, device=xs.device)
    out = torch.empty(r, d, dtype=xs.dtype, device=xs.device) if out is None else out
    tiles = tile_ends(offs, gluon_ws.BLOCK)
    gluon_ws.launch(xs, None, offs, ew.gate_up, None, gu, tiles, **gluon_ws.BF16)
    live = offs[-1:] if offs.numel() else None  # the real row count (a static buffer's tail is padding)
    gluon_ws.launch(swiglu_weighted(gu, rw, live, ew.backends), None, offs, ew.down, None, out, tiles,
                    **gluon_ws.BF16)
    return out


def _grouped(xs: torch.Tensor, offs: torch.Tensor, rw: torch.Tensor, ew: ExpertWeights) -> torch.Tensor:
    gu = torch._grouped_mm(xs, ew.gate_up.transpose(1, 2), offs=offs)
    # the routing weight scales the activation (down is linear), so the outputs come out weighted in xs' dtype
    return torch._grouped_mm(swiglu_weighted(gu, rw, backends=ew.backends), ew.down.transpose(1, 2), offs=offs)


def swiglu_weighted(gu: torch.Tensor, rw: torch.Tensor, live: torch.Tensor | None = None,
                    backends: Backends | None = None) -> torch.Tensor:
    """gu [N, 2I] (gate | up), rw float32 [N] -> silu(g) * u * rw [N, I] in gu's dtype, rounded after each op as
    ``F.silu(g).mul_(u).mul_(rw[:, None])`` (``cpkv.kernels.swiglu``: one Triton kernel where ``backends`` (None:
    ``backends_for(gu)``) run Triton). ``live``: int32 [1] on the device, the rows that matter (the kernel computes
    only those; the rest of the output is unspecified)."""
    from cpkv.kernels.swiglu.ref import swiglu_weighted_ref

    if not ((backends or backends_for(gu)).triton and gu.stride(-1) == 1):
        return swiglu_weighted_ref(gu, rw)
    from cpkv.kernels.swiglu import triton as kern

    out = torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype, device=gu.device)
    kern.swiglu_weighted(gu, rw.float().contiguous(), out, live)
    return out


def grouped_swiglu_fp8(xs: torch.Tensor, offs: torch.Tensor, rw: torch.Tensor, ew: ExpertWeights,
                       xq: tuple[torch.Tensor, torch.Tensor] | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``grouped_swiglu`` with fp8 block-scaled experts through the Triton kernels (CUDA): the tile map, the
    quantisation (unless ``xq`` brings it), gate_up, SwiGLU x routing weight + quantisation, down (into
    ``out`` when given); no host sync. Rows at or past offs[-1] are neither quantised nor computed (a static
    buffer of worst-case rows costs only its real rows: at cp 8 the expert exchange's N is 8x the average)
    and come out unspecified."""
    from cpkv.kernels.fp8_gemm import triton as kern

    r, d = xs.shape
    i = ew.down.shape[2]
    tiles = kern.tile_ends(offs)  # the tile map of both GEMMs
    live = offs[-1:] if offs.numel() else None  # the real row count, on the device
    if xq is None:
        q, s = _quant_buffers(r, d, xs.device)
        kern.act_quant(xs.contiguous(), q, s, live)
    else:
        q, s = xq
    gu = torch.empty(r, 2 * i, dtype=xs.dtype, device=xs.device)
    kern.grouped_gemm(q, s, offs, ew.gate_up, ew.gate_up_scale, gu, tiles)
    q, s = _quant_buffers(r, i, xs.device)
    kern.swiglu_quant(gu, rw.float().contiguous(), q, s, live)
    out = torch.empty(r, d, dtype=xs.dtype, device=xs.device) if out is None else out
    kern.grouped_gemm(q, s, offs, ew.down, ew.down_scale, out, tiles)
    return out


def _quant_buffers(r: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [r, k], float32 [r, ceil(k/128)] row-major): the grouped kernel's activation operands."""
    return (torch.empty(r, k, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(r, -(-k // 128), dtype=torch.float32, device=device))


def grouped_swiglu_loop(xs: torch.Tensor, offs: torch.Tensor, rw: torch.Tensor, ew: ExpertWeights) -> torch.Tensor:
    """``grouped_swiglu`` one expert at a time (reads the offsets back to the host; fp8 experts dequantised
    into xs' dtype); padding rows give 0."""
    out = torch.zeros_like(xs)
    ends = offs.tolist()
    for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
        if t > s:
            gate_up, down = ew.expert(e, xs.dtype)
            g, u = F.linear(xs[s:t], gate_up).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, down)
            out[s:t] = (y.float() * rw[s:t, None]).to(xs.dtype)
    return out
