"""The MoE block of GLM-5 / DeepSeek-V3.2: grouped top-k routing, routed experts, shared experts.

    route(x, gate, bias, cfg) -> (idx int64 [T, k], w float32 [T, k])
        scores = sigmoid(x W_gate^T) (float32); choice = scores + e_score_correction_bias;
        a group's score = the sum of its 2 best choices; keep the topk_group best of n_group groups;
        idx = the k best choices within them; w = scores[idx] (/ their sum when norm_topk_prob)
        * routed_scaling_factor
    experts(x, idx, w, gate_up [E, 2I, D], down [E, D, I]) -> [T, D]: sum_k w_k SwiGLU_{idx_k}(x)

``experts`` runs one grouped GEMM per projection over the (token, expert) pairs sorted by expert
(``torch._grouped_mm``: offsets stay on the device, no host sync) where the dtype and strides allow it,
and a loop over the experts hit otherwise (``experts_loop``, also the reference in tests). The grouped
path applies each routing weight to the expert's activation before its down projection (the same sum,
rounded at another point: within the test tolerance of the loop) and sums a token's k outputs per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cpkv.config import ModelConfig


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (expert ids int64 [T, k], weights float32 [T, k]) (module docstring)."""
    t, e, g = x.shape[0], cfg.n_routed_experts, cfg.n_group
    scores = F.linear(x.float(), gate.float()).sigmoid()
    choice = scores + bias.float()
    group_scores = choice.view(t, g, e // g).topk(2, dim=-1).values.sum(dim=-1)
    groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // g, dim=1), float("-inf"))
    idx = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


_GROUPED_FAILED: set[str] = set()  # device types where torch._grouped_mm raised once (then: the loop)


def _grouped_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.device.type in _GROUPED_FAILED:
        return False
    dtype_ok = x.dtype == (torch.bfloat16 if x.is_cuda else torch.float32)
    es = x.element_size()
    return dtype_ok and all((n * es) % 16 == 0 for n in (x.shape[1], gate_up.shape[1], down.shape[2]))


def experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """x [T, D], idx int64 [T, k], w float32 [T, k], gate_up [E, 2I, D], down [E, D, I] -> [T, D] (x's dtype)."""
    if _grouped_ok(x, gate_up, down):
        try:
            return _experts_grouped(x, idx, w, gate_up, down)
        except RuntimeError:  # a build or device without this grouped GEMM layout: remember, use the loop
            _GROUPED_FAILED.add(x.device.type)
    return experts_loop(x, idx, w, gate_up, down)


def _experts_grouped(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor) -> torch.Tensor:
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // k
    xs = x.index_select(0, token)
    gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    # the routing weight scales the activation (down is linear), so the expert outputs come out weighted in
    # x's dtype and each token's k outputs are summed in one reduction (float32 accumulation, one rounding)
    # instead of float32 [pairs, D] copies, products and an atomic scatter
    act = F.silu(g).mul_(u).mul_(w.reshape(-1)[order, None])
    y = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    return y.index_select(0, inv).view(t, k, x.shape[1]).sum(dim=1)


def experts_loop(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
    """``experts`` one expert at a time (reads which experts were hit back to the host)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e])
        out.index_add_(0, tok, y.float() * w[tok, slot, None])
    return out.to(x.dtype)
