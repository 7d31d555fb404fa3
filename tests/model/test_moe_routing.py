"""Routing and the pair sort of the MoE layer against their plain forms: the group mask skipped when every group is
kept changes nothing; the 16-bit stable sort with ``searchsorted`` ends gives the int64 argsort's order and the
counts' cumulative sum exactly."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cpkv.config import preset
from cpkv.model.moe import route, sort_pairs


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t, e, k", [(0, 16, 2), (1, 256, 8), (37, 256, 8), (300, 64, 6), (50, 40000, 4),
                                     (20000, 256, 8)])
def test_sort_pairs_equals_argsort_and_cumulative_counts(t, e, k, device):
    g = torch.Generator().manual_seed(t + e)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
    if t > 5:
        idx[: t // 2, 0] = 3  # a crowded expert (ties across tokens: the order must stay token-major)
    idx = idx.to(device)
    order, offs = sort_pairs(idx, e)
    flat = idx.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    counts = torch.zeros(e, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    assert offs.dtype == torch.int32 and torch.equal(offs, torch.cumsum(counts, 0).to(torch.int32))


def _route_masked(x, gate, bias, cfg):
    """The group-limited routing with its mask applied whatever the group count (the form before the skip)."""
    t, e, g = x.shape[0], cfg.n_routed_experts, cfg.n_group
    scores = torch.nn.functional.linear(x.float(), gate.float()).sigmoid()
    choice = scores + bias.float()
    group_scores = choice.view(t, g, e // g).topk(2, dim=-1).values.sum(dim=-1)
    groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // g, dim=1), float("-inf"))
    idx = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


@pytest.mark.parametrize("groups", [(1, 1), (8, 8), (8, 4)])
def test_route_skips_the_group_mask_only_when_every_group_is_kept(groups):
    cfg = dataclasses.replace(preset("glm5"), n_group=groups[0], topk_group=groups[1])
    g = torch.Generator().manual_seed(sum(groups))
    x = torch.randn(64, 96, generator=g)
    gate, bias = torch.randn(cfg.n_routed_experts, 96, generator=g), torch.randn(cfg.n_routed_experts, generator=g)
    idx, w = route(x, gate, bias, cfg)
    want_idx, want_w = _route_masked(x, gate, bias, cfg)
    assert torch.equal(idx, want_idx) and torch.equal(w, want_w)
