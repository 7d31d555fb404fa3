"""The router's scores, pure torch (what ``cpkv.model.moe.route`` computes off CUDA).

    router_scores_ref(x [T, K], gate [N, K]) -> float32 [T, N] = sigmoid(F.linear(float32(x), float32(gate)))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def router_scores_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """float32 [T, N] scores (module docstring)."""
    return F.linear(x.float(), gate.float()).sigmoid()
