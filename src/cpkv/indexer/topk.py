"""Top-k selection of the lightning indexer and the memory-bounded logits + top-k loop.

Contract (cpkv.kernels.topk.ref): per row the indices, relative to ks, of the k largest logits in
[ks, ke), ties toward the lower index, listed in ascending order; a row with <= k keys gives
0..n-1 then -1. ``index_topk`` == ``topk(mqa_logits(...))`` exactly, without the full logits matrix.
"""
from __future__ import annotations

import torch

from cpkv.errors import IndexerError
from cpkv.indexer.logits import aligned_keys, aligned_scales, check_logits_inputs, logits_into
from cpkv.indexer.plan import IndexerPlan, padded
from cpkv.kernels.platform import Backends, backends_for
from cpkv.kernels.topk.ref import short_rows_topk, topk_ref


def _check_topk_inputs(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, k: int) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise IndexerError(f"logits must be float32 [T, N], got {logits.dtype} {tuple(logits.shape)}")
    for name, t in (("ks", ks), ("ke", ke)):
        if t.shape != (logits.shape[0],) or t.dtype != torch.int32 or t.device != logits.device:
            raise IndexerError(f"{name} must be int32 [{logits.shape[0]}] on {logits.device}, got {t.dtype} "
                               f"{tuple(t.shape)} on {t.device}")
    if not isinstance(k, int) or k < 1:
        raise IndexerError(f"k must be a positive int, got {k!r}")


def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """x [T, N] float32 laid out as the top-k kernel reads it (unit column stride, 16-byte aligned
    rows, readable up to the next multiple of 4 columns): x itself, or a padded copy."""
    T, N = x.shape
    end = (x.storage_offset() + (T - 1) * x.stride(0) + padded(N)) * 4
    if (x.stride(1) == 1 and x.stride(0) % 4 == 0 and x.data_ptr() % 16 == 0
            and end <= x.untyped_storage().nbytes()):
        return x
    out = torch.empty(T, padded(N), dtype=x.dtype, device=x.device)
    out[:, :N] = x
    return out


def topk_into(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int, out: torch.Tensor, config=None,
              base: torch.Tensor | None = None, backends: Backends | None = None) -> torch.Tensor:
    """out [T, k] int32 <- top-k of x[i, lo[i]:hi[i]] relative to lo[i] (inputs already checked;
    0 <= lo, hi <= N required where hi > lo + k); with ``base`` (int32 [T]) each index plus base[i], -1 kept
    (``topk_to_slots`` of the result, written by the kernel itself). config: a cpkv.kernels.topk.TopkConfig
    (None: default); ``backends``: the caller's (None: ``backends_for(x)``)."""
    if (backends or backends_for(x)).triton:
        from cpkv.kernels.topk.triton import topk_triton

        return topk_triton(_kernel_ready(x), lo, hi, k, out, config=config, base=base)
    rel = topk_ref(x, lo, hi, k)
    out.copy_(rel if base is None else topk_to_slots(rel, base))
    return out


def topk(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, k: int = 2048, *, config=None,
         backends: Backends | None = None) -> torch.Tensor:
    """logits: float32 [T, N], ks/ke: int32 [T] columns (0 <= ks, ke <= N) -> int32 [T, k] indices
    relative to ks (module docstring). The Triton select where ``backends`` (None: ``backends_for(logits)``) run
    it (``config``: its TopkConfig, None = default variant), reference elsewhere."""
    _check_topk_inputs(logits, ks, ke, k)
    out = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    return topk_into(logits, ks, ke, k, out, config=config, backends=backends)


def topk_to_slots(idx: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """idx: int32 [T, k] relative indices (-1 = none), ks: int32 [T] dense base rows -> int32 [T, k]
    absolute rows of the composed dense key buffer (idx + ks, -1 kept)."""
    if idx.dim() != 2 or ks.shape != (idx.shape[0],):
        raise IndexerError(f"expected idx [T, k] and ks [T], got {tuple(idx.shape)} and {tuple(ks.shape)}")
    return torch.where(idx >= 0, idx + ks[:, None], -1).to(torch.int32)


def index_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    topk: int = 2048,
    chunk_max_bytes: int | None = None,
    plan: IndexerPlan | None = None,
    logits_config=None,
    topk_config=None,
    absolute: bool = False,
    backends: Backends | None = None,
) -> torch.Tensor:
    """Inputs as mqa_logits -> int32 [T, topk] indices relative to ks, equal to
    ``topk(mqa_logits(q, k, k_scale, weights, ks, ke), ks, ke, topk)``; ``absolute``: the key rows themselves
    (``topk_to_slots(indices, ks)``: index + ks, -1 kept), which the top-k kernel writes directly.

    Query rows run in the plan's chunks: one logits block rows x (max ke - min ks) x 4 B at a time,
    within ``chunk_max_bytes`` (default CPKV_MQA_LOGITS_CHUNK_MAX_GB GiB). A chunk whose rows all see
    <= topk keys computes no logits. Pass ``plan`` (IndexerPlan.build, once per batch; its ks/ke and
    budget are used) to avoid reading ks/ke back from the device on every call; its logits work items
    (cpkv.kernels.mqa_logits.work: only the non-empty programs) are built on first use and reused. logits_config /
    topk_config pick the Triton kernels' variants (None: the defaults); ``backends``: the caller's (None:
    ``backends_for(q)``)."""
    check_logits_inputs(q, k, k_scale, weights, ks, ke)
    reused = plan is not None  # a caller's plan, reused across layers, is worth its logits work items
    if plan is None:
        plan = IndexerPlan.from_tensors(ks, ke, chunk_max_bytes)
    elif plan.num_tokens != q.shape[0]:
        raise IndexerError(f"plan has {plan.num_tokens} query rows, q has {q.shape[0]}")
    out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    if plan.max_len <= topk:
        rel = short_rows_topk(plan.ke - plan.ks, topk)
        return topk_to_slots(rel, plan.ks) if absolute else rel
    backends = backends or backends_for(q)
    if backends.triton:
        k, k_scale = aligned_keys(k), aligned_scales(k_scale)
    buf = torch.empty(plan.max_chunk_elems, dtype=torch.float32, device=q.device)
    for c in plan.chunks:
        _run_chunk(q, k, k_scale, weights, plan, c, buf, out, topk, backends, logits_config, topk_config, reused,
                   absolute)
    return out


def _run_chunk(q, k, k_scale, weights, plan: IndexerPlan, c, buf: torch.Tensor, out: torch.Tensor, topk: int,
               backends: Backends, logits_config=None, topk_config=None, items: bool = True,
               absolute: bool = False) -> None:
    """Logits of chunk c into buf (clean=False: only [ks, ke) is read), then its top-k into out (``absolute``:
    plus each row's ks). items: launch the logits kernel over the plan's work items (built on the host on first
    use, then cached in the plan)."""
    r = slice(c.row_start, c.row_end)
    if c.max_len <= topk:
        rel = short_rows_topk(plan.ke[r] - plan.ks[r], topk)
        out[r] = topk_to_slots(rel, plan.ks[r]) if absolute else rel
        return
    logits = buf[: c.rows * padded(c.width)].view(c.rows, padded(c.width))[:, : c.width]
    logits_into(q[r], k, k_scale, weights[r], plan.ks[r], plan.ke[r], logits, col_offset=c.key_start, clean=False,
                backends=backends, config=logits_config,
                work=(lambda shape: plan.work_items(c, shape)) if items else None)
    topk_into(logits, plan.rel_ks[r], plan.rel_ke[r], topk, out[r], config=topk_config,
              base=plan.ks[r] if absolute else None, backends=backends)
