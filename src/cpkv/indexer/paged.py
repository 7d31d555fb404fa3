"""The indexer's decode logits over paged index rows: input checks and dispatch (the Triton kernel where the
caller's backends run it, the reference elsewhere). docs/design.md §11.

    out[b, s] = k_scale(s) * sum_h weights[b, h] * relu(q[b, h, :] . k(s))   s < ctx[b]
              = -inf                                                         ctx[b] <= s < L

k(s), k_scale(s): the index row of generation b's key s, row ``page_tab[slot[b], s // P] * P + s % P`` of rank
``owner_tab[slot[b], s // P]``'s pool, read in place. The definition is ``mqa_logits_ref`` per generation
(``paged_mqa_logits_ref``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from cpkv.errors import IndexerError
from cpkv.kernels.mqa_logits.ref import paged_mqa_logits_ref
from cpkv.kernels.platform import Backends, backends_for

FP8 = torch.float8_e4m3fn


def check_paged_inputs(q, weights, owner_tab, page_tab, slot, ctx, page_size: int, out) -> None:
    """Shapes, dtypes and devices of paged_logits' inputs (host metadata only, no device read)."""
    if q.dim() != 3 or q.dtype != FP8:
        raise IndexerError(f"q must be float8_e4m3fn [B, H, D], got {q.dtype} {tuple(q.shape)}")
    B, H, _ = q.shape
    if weights.shape != (B, H) or weights.dtype != torch.float32:
        raise IndexerError(f"weights must be float32 [{B}, {H}], got {weights.dtype} {tuple(weights.shape)}")
    if owner_tab.dim() != 2 or owner_tab.shape != page_tab.shape or owner_tab.stride() != page_tab.stride():
        raise IndexerError(f"owner_tab and page_tab must be [slots, max_pages] of one shape and stride, got "
                           f"{tuple(owner_tab.shape)} {owner_tab.stride()} and {tuple(page_tab.shape)} {page_tab.stride()}")
    for name, t, shape in (("owner_tab", owner_tab, None), ("page_tab", page_tab, None), ("slot", slot, (B,)),
                           ("ctx", ctx, (B,))):
        if t.dtype != torch.int64 or shape is not None and t.shape != shape or t.stride(-1) != 1:
            raise IndexerError(f"{name} must be unit-stride int64{list(shape) if shape else ''}, got {t.dtype} "
                               f"{tuple(t.shape)}")
    if page_size < 1 or page_size & (page_size - 1):
        raise IndexerError(f"page_size must be a power of two, got {page_size}")
    if out.dim() != 2 or out.shape[0] != B or out.dtype != torch.float32:
        raise IndexerError(f"out must be float32 [{B}, L], got {out.dtype} {tuple(out.shape)}")
    devices = {t.device for t in (q, weights, owner_tab, page_tab, slot, ctx, out)}
    if len(devices) != 1:
        raise IndexerError(f"all paged logits inputs must be on one device, got {sorted(map(str, devices))}")


def check_pools(pools: Sequence[torch.Tensor], dim: int, page_size: int) -> None:
    """Every pool uint8 [pages * page_size, dim + 4] (D fp8 values then a float32 scale), at least one: whole
    pages, as the kernel reads a live page's rows past a context's end."""
    if not pools:
        raise IndexerError("paged logits read every rank's pool: none given")
    for r, p in enumerate(pools):
        if p.dtype != torch.uint8 or p.dim() != 2 or p.shape[1] != dim + 4 or p.shape[0] % page_size:
            raise IndexerError(f"pool {r} must be uint8 [pages * {page_size}, {dim + 4}], got {p.dtype} "
                               f"{tuple(p.shape)}")


def paged_logits(q: torch.Tensor, weights: torch.Tensor, pools: Sequence[torch.Tensor], bases: torch.Tensor | None,
                 owner_tab: torch.Tensor, page_tab: torch.Tensor, slot: torch.Tensor, ctx: torch.Tensor,
                 page_size: int, out: torch.Tensor, *, config=None, backends: Backends | None = None) -> torch.Tensor:
    """q: fp8 e4m3 [B, H, D], weights: float32 [B, H], pools: per rank uint8 [pages * P, D + 4] (this layer's index
    rows, peers' as peer memory maps them), bases: int64 [cp] on the device, each pool's byte address (4-byte
    aligned; None where the kernels do not run), owner_tab / page_tab: int64 [slots, max_pages], slot / ctx: int64
    [B] on the device, out: float32 [B, L], L >= max(ctx) -> out (module docstring).

    The Triton kernel (cpkv.kernels.mqa_logits.paged; ``config``: its PagedLogitsConfig) where ``backends``
    (None: ``backends_for(q)``) run Triton and bases are given: no host synchronisation, the launch depends only
    on B and L, so it can be captured in a CUDA graph; the reference otherwise (it reads every pool at every
    position)."""
    check_paged_inputs(q, weights, owner_tab, page_tab, slot, ctx, page_size, out)
    check_pools(pools, q.shape[2], page_size)
    if bases is not None and (backends or backends_for(q)).triton:
        from cpkv.kernels.mqa_logits import paged as kern

        if kern.supported(q):
            return kern.paged_logits_triton(q, weights, bases, owner_tab, page_tab, slot, ctx, page_size, out,
                                            config=config)
    out.copy_(paged_mqa_logits_ref(q, weights, pools, owner_tab, page_tab, slot, ctx, page_size, out.shape[1]))
    return out
