"""The MoE block of GLM-5 / DeepSeek-V3.2: grouped top-k routing, routed experts, shared experts.

    route(x, gate, bias, cfg) -> (idx int64 [T, k], w float32 [T, k])
        scores = sigmoid(x W_gate^T) (float32; ``router_scores``: a Triton kernel where the backends run Triton);
        choice = scores + e_score_correction_bias;
        a group's score = the sum of its 2 best choices; keep the topk_group best of n_group groups;
        idx = the k best choices within them; w = scores[idx] (/ their sum when norm_topk_prob)
        * routed_scaling_factor
    experts(x, idx, w, gate_up [E, 2I, D], down [E, D, I]) -> [T, D]: sum_k w_k SwiGLU_{idx_k}(x)

``experts`` sorts the (token, expert) pairs by expert (``sort_pairs``: offsets stay on the device, no host
sync), runs the experts as one grouped SwiGLU (``cpkv.model.experts.grouped_swiglu``: each routing weight
applied to the expert's activation before its down projection, the same sum rounded at another point:
within the test tolerance of ``experts_loop``, the reference in tests) and sums each token's k outputs
(``combine_pairs``).

Expert parallelism (cp > 1): rank r holds the routed experts ``expert_block(r, cp, E)``; ``experts_ep``
reads like ``experts`` with two extra verbs of the batch's exchange (``cpkv.compose.dispatch``): dispatch
(every token's x to the ranks holding its k experts, sorted by local expert), the same grouped SwiGLU over
the local experts, combine (the weighted outputs back on the token's rank, its k summed).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from cpkv.config import ModelConfig
from cpkv.errors import ConfigError
from cpkv.kernels.platform import Backends, backends_for
from cpkv.model.experts import ExpertWeights, grouped_swiglu, grouped_takes_quantised


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig,
          fused: bool = True, backends: Backends | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (expert ids int64 [T, k], weights float32 [T, k]) (module docstring). ``fused`` False: the
    scores as ``F.linear`` in float32 also on CUDA (``--precision exact`` runs); ``backends``: ``router_scores``'s."""
    return route_choices(x, gate, bias, cfg, fused, backends)[:2]


def route_choices(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig,
                  fused: bool = True, backends: Backends | None = None) -> tuple[torch.Tensor, ...]:
    """``route`` and the choice values it picked from -> (idx, weights, choice float32 [T, E]): the same work."""
    scores, choice = route_scores(x, gate, bias, fused, backends)
    idx = pick_experts(choice, cfg)
    return idx, route_weights(scores, idx, cfg), choice


def route_scores(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, fused: bool = True,
                 backends: Backends | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (scores float32 [T, E] = sigmoid(x W_gate^T), choice float32 [T, E] = scores + bias)."""
    scores = router_scores(x, gate, backends) if fused else F.linear(x.float(), gate.float()).sigmoid()
    return scores, scores + bias.float()


def pick_experts(choice: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """choice float32 [T, E] -> the k chosen expert ids int64 [T, k] (unordered): the k best choices within the
    topk_group best groups (a group's score: the sum of its 2 best choices)."""
    e, g = cfg.n_routed_experts, cfg.n_group
    if cfg.topk_group < g:  # group-limited routing (every group kept, GLM-5's one group: nothing to mask)
        choice = choice.masked_fill(~kept_groups(choice, cfg).repeat_interleave(e // g, dim=1), float("-inf"))
    return choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices


def group_scores(choice: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """choice float32 [T, E] -> float32 [T, n_group]: each group's score (the sum of its 2 best choices)."""
    t, e, g = choice.shape[0], cfg.n_routed_experts, cfg.n_group
    return choice.view(t, g, e // g).topk(2, dim=-1).values.sum(dim=-1)


def kept_groups(choice: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """choice float32 [T, E] -> bool [T, n_group]: the topk_group best groups of each token."""
    scores = group_scores(choice, cfg)
    groups = scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, groups, True)


def route_weights(scores: torch.Tensor, idx: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """scores float32 [T, E], idx int64 [T, k] -> the routing weights float32 [T, k]: the chosen scores (/ their
    sum when norm_topk_prob) * routed_scaling_factor."""
    w = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * cfg.routed_scaling_factor


def router_scores(x: torch.Tensor, gate: torch.Tensor, backends: Backends | None = None) -> torch.Tensor:
    """x [T, D], gate [E, D] -> float32 [T, E] = sigmoid(float32(x) @ float32(gate)^T): one Triton kernel where
    ``backends`` (None: ``backends_for(x)``) run Triton, for a bf16 / fp16 x (``cpkv.kernels.router``: no float32
    copy of x; float32 products and sums, in another order than cuBLAS's), ``F.linear`` in float32 elsewhere."""
    from cpkv.kernels.router.ref import router_scores_ref

    if not (backends or backends_for(x)).triton:
        return router_scores_ref(x, gate)
    from cpkv.kernels.router import triton as kern

    if not kern.supported(x, gate):
        return router_scores_ref(x, gate)
    out = torch.empty(x.shape[0], gate.shape[0], dtype=torch.float32, device=x.device)
    kern.router_scores(x if x.stride(-1) == 1 else x.contiguous(), gate.contiguous(), out)
    return out


def experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor | ExpertWeights,
            down: torch.Tensor | None = None, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
            add: torch.Tensor | None = None, fused: bool = True) -> torch.Tensor:
    """x [T, D], idx int64 [T, k], w float32 [T, k], gate_up [E, 2I, D], down [E, D, I] (or ExpertWeights as
    ``gate_up``, fp8 ones included) -> [T, D] (x's dtype). ``xq``: x quantised already (fp8 [T, D], float32
    scales (T, ceil(D/128)), any strides: a QuantAct's q, s), for fp8 experts on the grouped kernel. ``add``
    [T, D]: added to the result in its combine (the shared experts' output). ``fused`` False: the combine as
    torch's gather, reduction and add also on CUDA (``--precision exact`` runs). The backends: ``gate_up``'s when
    ExpertWeights, else those of x's device.

    Sort the (token, expert) pairs by expert (counts and offsets stay on the device), run the experts as
    one grouped SwiGLU (``cpkv.model.experts``), then sum each token's k weighted outputs. With ``xq`` the
    pairs' rows are gathered from x's quantised rows (the quantisation is per row: the bytes a quantisation of
    the gathered rows would give) instead of gathered and quantised again."""
    ew = gate_up if isinstance(gate_up, ExpertWeights) else ExpertWeights(gate_up, down)
    t, k = idx.shape
    order, offs = sort_pairs(idx, ew.num_experts)
    rows = order // k
    if xq is not None and grouped_takes_quantised(ew):
        q, s = xq
        pairs = (q.view(torch.uint8).index_select(0, rows).view(q.dtype), s.index_select(0, rows))
        shape = x.new_empty(1, x.shape[1]).expand(rows.shape[0], -1)  # the rows' shape, dtype and device only
        y = grouped_swiglu(shape, offs, w.reshape(-1)[order], ew, pairs)
    else:
        y = grouped_swiglu(x.index_select(0, rows), offs, w.reshape(-1)[order], ew)
    return combine_pairs(y, order, t, k, add, fused, ew.backends)


def expert_block(rank: int, cp: int, num_experts: int) -> range:
    """The routed experts rank ``rank`` of ``cp`` holds: [rank E/cp, (rank + 1) E/cp). ConfigError unless cp
    divides E."""
    if cp < 1 or num_experts % cp:
        raise ConfigError(f"cp {cp} must divide the model's n_routed_experts {num_experts} (expert parallelism "
                          f"splits the routed experts evenly over the CP group)")
    per = num_experts // cp
    return range(rank * per, (rank + 1) * per)


def experts_ep(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ew: ExpertWeights,
               ep) -> torch.Tensor:
    """``experts`` under expert parallelism: x [T, D] (this rank's tokens, T may be 0), idx int64 [T, k], w
    float32 [T, k]; ``ew`` this rank's experts (gate_up [El, 2I, D], down [El, D, I]); ``ep`` the batch's exchange
    (``cpkv.compose.dispatch.EPBatch``) -> [T, D]. Every rank calls it for every MoE layer."""
    xs, offs, rw = ep.dispatch(x, idx, w)
    return ep.combine(grouped_swiglu(xs, offs, rw, ew, out=ep.output_rows()))


def sort_pairs(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """idx int64 [T, k] -> (order int64 [T*k]: flat pair ids sorted by expert (stable), offs int32 [E]: the
    cumulative row end of each expert), both on the device."""
    flat = idx.reshape(-1)
    if num_experts <= 1 << 15:  # 16-bit keys: two radix passes where int64 takes eight (the same stable order)
        flat = flat.to(torch.int16)
    keys, order = torch.sort(flat, stable=True)
    # an expert's end = the number of keys <= it (the counts' cumulative sum, without a scatter or a memset)
    return order, torch.searchsorted(keys, _expert_ids(num_experts, flat.dtype, idx.device), right=True,
                                     out_int32=True)


@lru_cache(maxsize=16)
def _expert_ids(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[0, n) as ``dtype`` on ``device``, made once."""
    return torch.arange(n, dtype=dtype, device=device)


def combine_pairs(y: torch.Tensor, order: torch.Tensor, t: int, k: int, add: torch.Tensor | None = None,
                  fused: bool = True, backends: Backends | None = None) -> torch.Tensor:
    """y [T*k, D] in sorted pair order -> [T, D]: each token's k outputs summed (float32 accumulation, one
    rounding), plus ``add`` [T, D] when given (one more rounding). One Triton kernel where ``fused`` and
    ``backends`` (None: ``backends_for(y)``) run Triton (the k rows gathered and summed in one pass,
    ``cpkv.kernels.combine``: within one ulp of the reduction's other summation order); elsewhere the gather, the
    reduction and the add."""
    from cpkv.kernels.combine.ref import combine_ref

    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=y.device))
    fits = y.stride(-1) == 1 and (add is None or add.stride(-1) == 1 and add.dtype == y.dtype)
    if not (fused and fits and (backends or backends_for(y)).triton):
        return combine_ref(y, inv, t, k, add)
    from cpkv.kernels.combine import triton as kern

    out = torch.empty(t, y.shape[1], dtype=y.dtype, device=y.device)
    kern.combine(y, inv, add, out)
    return out


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
