"""Rank processes in one ``torch.distributed`` group (docs/design.md §4, transports).

    launch(fn, world_size, device="cpu", args=(...)) -> [fn(ctx_0, *args), ..., fn(ctx_{n-1}, *args)]
    context_from_env(device)  -> RankContext of this process under torchrun (env:// rendezvous)
    RankGroup(fn, world_size, ...)  -> long-lived ranks fed through inboxes (``cpkv serve``)

``fn(ctx, *args)`` receives a :class:`RankContext` (rank, world_size, device, group, backend,
shared_device). A rank that raises or dies makes ``launch`` raise :class:`cpkv.errors.RankFailure`
naming it, never hang.
"""
from __future__ import annotations

from cpkv.dist.launch import RankContext, RankGroup, context_from_env, launch, pick_backend

__all__ = ["RankContext", "RankGroup", "context_from_env", "launch", "pick_backend"]
