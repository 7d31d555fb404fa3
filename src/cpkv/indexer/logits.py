"""MQA logits of the lightning indexer: input checks and dispatch (the Triton kernel where the caller's backends run
it, the reference elsewhere).

    logits[i, j] = k_scale[j] * sum_h weights[i, h] * relu(q[i, h, :] . k[j, :])   ks[i] <= j < ke[i]
                 = -inf elsewhere (clean=True) / unspecified (clean=False)
"""
from __future__ import annotations

import torch

from cpkv.errors import IndexerError
from cpkv.kernels.mqa_logits.ref import mqa_logits_ref
from cpkv.kernels.platform import Backends, backends_for

INPUT_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)


def check_logits_inputs(q, k, k_scale, weights, ks, ke) -> None:
    """Shapes, dtypes and devices of mqa_logits' inputs (host metadata only, no device read)."""
    if q.dim() != 3 or q.dtype not in INPUT_DTYPES:
        raise IndexerError(f"q must be [T, H, D] float8_e4m3fn or bfloat16, got {q.dtype} {tuple(q.shape)}")
    T, H, D = q.shape
    if k.dim() != 2 or k.shape[1] != D or k.dtype not in INPUT_DTYPES:
        raise IndexerError(f"k must be [S, {D}] float8_e4m3fn or bfloat16, got {k.dtype} {tuple(k.shape)}")
    if k_scale.shape != (k.shape[0],) or k_scale.dtype != torch.float32:
        raise IndexerError(f"k_scale must be float32 [{k.shape[0]}], got {k_scale.dtype} {tuple(k_scale.shape)}")
    if weights.shape != (T, H) or weights.dtype != torch.float32:
        raise IndexerError(f"weights must be float32 [{T}, {H}], got {weights.dtype} {tuple(weights.shape)}")
    for name, t in (("ks", ks), ("ke", ke)):
        if t.shape != (T,) or t.dtype != torch.int32:
            raise IndexerError(f"{name} must be int32 [{T}], got {t.dtype} {tuple(t.shape)}")
    devices = {t.device for t in (q, k, k_scale, weights, ks, ke)}
    if len(devices) != 1:
        raise IndexerError(f"all indexer inputs must be on one device, got {sorted(map(str, devices))}")


def aligned_keys(k: torch.Tensor) -> torch.Tensor:
    """k [S, D] with 16-byte aligned rows: k itself, or a packed copy (moved as uint8) when its rows
    are not (the 132-byte index rows are not: one copy of S x D bytes per call, not per chunk)."""
    if (k.stride(0) * k.element_size()) % 16 == 0 and k.data_ptr() % 16 == 0 and k.stride(1) == 1:
        return k
    out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    out.view(torch.uint8).copy_(k.view(torch.uint8))
    return out


def aligned_scales(k_scale: torch.Tensor) -> torch.Tensor:
    """k_scale [S] with unit stride: itself, or a contiguous copy (the scales of the 132-byte index rows
    are a strided view; at unit stride the kernels' scale addresses need no multiply)."""
    return k_scale if k_scale.stride(0) == 1 else k_scale.contiguous()


def logits_into(q, k, k_scale, weights, ks, ke, out: torch.Tensor, *, col_offset: int, clean: bool,
                config=None, work=None, backends: Backends | None = None) -> torch.Tensor:
    """Write out [T, n] float32: column c holds key col_offset + c (inputs already checked).
    config: a cpkv.kernels.mqa_logits.LogitsConfig for the Triton kernel (None: its default); work: a
    function of a cpkv.kernels.mqa_logits.work.WorkShape giving these rows' work items (IndexerPlan.work_items);
    ``backends``: the caller's (None: ``backends_for(q)``)."""
    if (backends or backends_for(q)).triton:
        from cpkv.kernels.mqa_logits import triton as kern

        if kern.supported(q, k):
            return kern.mqa_logits_triton(q, k, k_scale, weights, ks, ke, out, col_offset=col_offset, clean=clean,
                                          config=config, work=work)
    out.copy_(mqa_logits_ref(q, k, k_scale, weights, ks, ke, clean=clean, col_offset=col_offset,
                             num_cols=out.shape[1]))
    return out


def mqa_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    clean: bool = True,
    config=None,
    backends: Backends | None = None,
) -> torch.Tensor:
    """q: [T, H, D] float8_e4m3fn/bf16, k: [S, D] float8_e4m3fn/bf16 (any row stride), k_scale:
    float32 [S] (any stride), weights: float32 [T, H], ks/ke: int32 [T] -> float32 [T, S] logits
    (module docstring). The Triton kernel where ``backends`` (None: ``backends_for(q)``) run it, for H in
    8/16/32/64 and D in 64/128 (``config``: its LogitsConfig, None = default variant); reference otherwise."""
    check_logits_inputs(q, k, k_scale, weights, ks, ke)
    backends = backends or backends_for(q)
    out = torch.empty(q.shape[0], k.shape[0], dtype=torch.float32, device=q.device)
    if backends.triton:
        k, k_scale = aligned_keys(k), aligned_scales(k_scale)
    return logits_into(q, k, k_scale, weights, ks, ke, out, col_offset=0, clean=clean, backends=backends,
                       config=config)
