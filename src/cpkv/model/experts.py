"""A rank's routed experts over rows already sorted by expert: the compute half of a MoE layer.

    ExpertWeights: gate_up [E, 2I, D], down [E, D, I] (the rank's E local experts, stacked; compute dtype)
    grouped_swiglu(xs [N, D], offs int32 [E], rw float32 [N], ew) -> [N, D] (xs' dtype)
        row i belongs to local expert e when offs[e-1] <= i < offs[e] (offs: cumulative row ends, on the
        device: no host sync); out[i] = rw[i] * down_e(silu(gate_e xs[i]) * up_e xs[i]). Rows at or past
        offs[-1] are padding: their output is unspecified (callers ignore them).

Routing, the sort by expert and (expert parallelism) moving rows between ranks live in ``cpkv.model.moe``;
this module only multiplies. ``torch._grouped_mm`` where the dtype and strides allow it, else one expert
at a time (``grouped_swiglu_loop``, also the reference in tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExpertWeights:
    """The local experts of one MoE layer, stacked: gate_up [E, 2I, D] (gate rows first), down [E, D, I]."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])


_GROUPED_FAILED: set[str] = set()  # device types where torch._grouped_mm raised once (then: the loop)


def _grouped_ok(xs: torch.Tensor, ew: ExpertWeights) -> bool:
    if not hasattr(torch, "_grouped_mm") or xs.device.type in _GROUPED_FAILED:
        return False
    dtype_ok = xs.dtype == (torch.bfloat16 if xs.is_cuda else torch.float32)
    es = xs.element_size()
    return dtype_ok and all((n * es) % 16 == 0 for n in (xs.shape[1], ew.gate_up.shape[1], ew.down.shape[2]))


def grouped_swiglu(xs: torch.Tensor, offs: torch.Tensor, rw: torch.Tensor, ew: ExpertWeights) -> torch.Tensor:
    """xs [N, D] sorted by local expert, offs int32 [E] row ends, rw float32 [N] -> weighted outputs [N, D]."""
    if _grouped_ok(xs, ew):
        try:
            return _grouped(xs, offs, rw, ew)
        except RuntimeError:  # a build or device without this grouped GEMM layout: remember, use the loop
            _GROUPED_FAILED.add(xs.device.type)
    return grouped_swiglu_loop(xs, offs, rw, ew)


def _grouped(xs: torch.Tensor, offs: torch.Tensor, rw: torch.Tensor, ew: ExpertWeights) -> torch.Tensor:
    gu = torch._grouped_mm(xs, ew.gate_up.transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    # the routing weight scales the activation (down is linear), so the outputs come out weighted in xs' dtype
    act = F.silu(g).mul_(u).mul_(rw[:, None])
    return torch._grouped_mm(act, ew.down.transpose(1, 2), offs=offs)


def grouped_swiglu_loop(xs: torch.Tensor, offs: torch.Tensor, rw: torch.Tensor, ew: ExpertWeights) -> torch.Tensor:
    """``grouped_swiglu`` one expert at a time (reads the offsets back to the host); padding rows give 0."""
    out = torch.zeros_like(xs)
    ends = offs.tolist()
    for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
        if t > s:
            g, u = F.linear(xs[s:t], ew.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, ew.down[e])
            out[s:t] = (y.float() * rw[s:t, None]).to(xs.dtype)
    return out
