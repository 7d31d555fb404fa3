"""The router's scores, pure torch (what ``cpkv.model.moe.route`` computes off CUDA).

    router_scores_ref(x [T, K], gate [N, K]) -> float32 [T, N] = sigmoid(F.linear(float32(x), float32(gate)))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def router_scores_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """float32 [T, N] scores (module docstring)."""
    return F.linear(x.float(), gate.float()).sigmoid()


def route_differences(idx: torch.Tensor, idx_ref: torch.Tensor, choice: torch.Tensor, tol: torch.Tensor,
                      n_group: int, topk_group: int) -> tuple[int, list[int]]:
    """Tokens whose chosen experts (idx, idx_ref int [T, k], any order) differ -> (how many, those without a near
    tie in the reference ``choice`` (scores + bias, float64 [T, E]) within ``tol`` [T]: the k-th and (k+1)-th
    choice among the kept groups within tol, or the topk_group-th and next group score (the sum of a group's two
    best) within 2 tol). For tests and benchmarks: a score error within tol can swap only near-tied choices."""
    t, k = idx.shape
    e = choice.shape[1]
    differ = (~(idx.sort(dim=1).values == idx_ref.sort(dim=1).values).all(dim=1)).nonzero().flatten().tolist()
    unexplained = []
    for tok in differ:
        c = choice[tok].view(n_group, e // n_group)
        groups = c.topk(2, dim=-1).values.sum(dim=-1)
        ranked = groups.sort(descending=True).values
        group_tie = topk_group < n_group and float(ranked[topk_group - 1] - ranked[topk_group]) <= 2 * float(tol[tok])
        inside = c[groups.topk(topk_group).indices].flatten().sort(descending=True).values
        expert_tie = float(inside[k - 1] - inside[k]) <= float(tol[tok])
        if not (group_tie or expert_tie):
            unexplained.append(tok)
    return len(differ), unexplained
