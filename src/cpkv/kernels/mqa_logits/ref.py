"""MQA logits of the lightning indexer, pure torch (docs/design.md §5): they run on any device and define the
edge cases the kernels must match.

    logits[i, j] = k_scale[j] * sum_h weights[i, h] * relu(q[i, h, :] . k[j, :])   for ks[i] <= j < ke[i]
                 = -inf                                                           elsewhere
"""
from __future__ import annotations

import torch

REF_BLOCK_BYTES = 1 << 27  # bounds the reference's float64 [rows, H, keys] temporary


def mqa_logits_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    clean: bool = True,
    dtype: torch.dtype = torch.float32,
    col_offset: int = 0,
    num_cols: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D] fp8/bf16/float, k: [S, D] fp8/bf16/float, k_scale: [S] float32, weights: [T, H]
    float32, ks/ke: [T] int32 -> logits [T, num_cols] in ``dtype`` (float32 by default; float64 for tests).

    Column c holds key ``col_offset + c`` (default: all S keys). ``clean=False`` leaves positions outside
    [ks, ke) unspecified (here: their unmasked values)."""
    num_cols = k.shape[0] - col_offset if num_cols is None else num_cols
    kf = k[col_offset:col_offset + num_cols].double()
    scale = k_scale[col_offset:col_offset + num_cols].to(dtype)
    out = torch.empty(q.shape[0], num_cols, dtype=dtype, device=q.device)
    step = max(1, REF_BLOCK_BYTES // max(1, 8 * q.shape[1] * num_cols))
    for r0 in range(0, q.shape[0], step):
        out[r0:r0 + step] = _head_sum(q[r0:r0 + step], kf, weights[r0:r0 + step], dtype) * scale[None, :]
    if clean:
        out.masked_fill_(~_valid_mask(ks, ke, col_offset, num_cols), float("-inf"))
    return out


def _head_sum(q: torch.Tensor, kf: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [t, H, D], kf float64 [s, D], weights [t, H] -> [t, s] in dtype: sum_h w * relu(q_h . k).

    The dots run in float64 (exact for fp8 inputs) and the head sum is a fixed sequence of
    elementwise ops, so an entry does not depend on which other rows or keys are computed with it."""
    dots = torch.einsum("thd,sd->ths", q.double(), kf).to(dtype).relu_()
    w = weights.to(dtype)
    acc = dots[:, 0] * w[:, 0:1]
    for h in range(1, q.shape[1]):
        acc += dots[:, h] * w[:, h:h + 1]
    return acc


def _valid_mask(ks: torch.Tensor, ke: torch.Tensor, col_offset: int, num_cols: int) -> torch.Tensor:
    """[T, num_cols] bool: key col_offset + c is inside [ks[i], ke[i])."""
    j = torch.arange(num_cols, device=ks.device, dtype=torch.int64)[None, :] + col_offset
    return (j >= ks.long()[:, None]) & (j < ke.long()[:, None])
