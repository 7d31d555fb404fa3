"""Sparse and dense causal MLA attention, and sparse decode MLA over paged fp8 token rows, pure torch: the semantics
the kernels match, and the CPU path.

Edge cases (as FlashMLA's reference): an index of -1 or >= S (or any negative) selects nothing; a query row
with no valid index gets out 0 and lse +inf.
"""
from __future__ import annotations

from typing import Sequence

import torch

from cpkv.config import RowFormat
from cpkv.kernels.paged_rows.ref import paged_rows_ref
from cpkv.kernels.token_kv.ref import dequant_token_kv_ref


def sparse_mla_ref(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
    dtype: torch.dtype = torch.float32, chunk: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, d_qk], kv [S, d_qk], indices int [T, topk] -> (out [T, H, d_v], lse float32 [T, H]).

    Computed in ``dtype`` (float64 for tests), ``chunk`` query rows at a time to bound memory.
    ``out`` is returned in ``dtype``; lse in natural log, +inf for a row with no valid index.
    """
    t, h, _ = q.shape
    kvc = kv.to(dtype)
    out = torch.empty((t, h, d_v), dtype=dtype, device=q.device)
    lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        out[t0:t1], lse[t0:t1] = _sparse_chunk(q[t0:t1].to(dtype), kvc, indices[t0:t1], sm_scale, d_v)
    return out, lse


def _sparse_chunk(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    s = kv.shape[0]
    idx = indices.long()
    valid = (idx >= 0) & (idx < s)
    keys = kv[torch.where(valid, idx, torch.zeros_like(idx))]  # [c, topk, d_qk]
    scores = torch.einsum("thd,tkd->thk", q, keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where no key
    empty = torch.isneginf(lse)
    p = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("thk,tkd->thd", p, keys[..., :d_v])
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return out, lse.float()


def dense_indices(ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
    """ks, ke int [T] -> int32 [T, max(ke - ks)]: row i holds ks[i] .. ke[i]-1, then -1 padding.

    Reads ``max(ke - ks)`` on the host (a device sync on CUDA): reference / fallback use only.
    """
    ks64, ke64 = ks.long(), ke.long()
    width = int((ke64 - ks64).clamp(min=0).max().item()) if ks.numel() else 0
    idx = ks64[:, None] + torch.arange(width, device=ks.device)[None, :]
    return torch.where(idx < ke64[:, None], idx, torch.full_like(idx, -1)).to(torch.int32)


def dense_causal_mla_ref(
    q: torch.Tensor, kv: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, sm_scale: float,
    d_v: int = 512, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query i attends kv rows [ks[i], ke[i]) (rows outside [0, S) ignored): sparse_mla_ref on those indices."""
    return sparse_mla_ref(q, kv, dense_indices(ks, ke), sm_scale, d_v, dtype=dtype)


def sparse_decode_mla_ref(
    q: torch.Tensor, pools: Sequence[torch.Tensor], owner: torch.Tensor, row: torch.Tensor, sm_scale: float,
    d_v: int, fmt: RowFormat, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, d_qk], pools cp x uint8 [rows, row_bytes], owner / row int [B, K] -> (out [B, H, d_v], lse f32 [B, H]).

    Generation b attends the token rows ``pools[owner[b, j]][row[b, j]]`` (``fmt``: fp8 | scales | rope), each
    dequantised as ``dequant_token_kv_ref`` (bf16(fp32(fp8) * scale) | rope): ``sparse_mla_ref`` over them, a row
    < 0 selecting nothing (the rest as there: out 0 and lse +inf for a generation with no key). ``out`` in
    ``dtype`` (float64 for tests)."""
    b, k = row.shape
    rows = paged_rows_ref(pools, owner.reshape(-1).long(), row.reshape(-1).long())
    kv = dequant_token_kv_ref(rows, fmt)  # [B * K, d_qk]: generation b's keys at b * K + j
    ind = torch.arange(b * k, device=row.device).view(b, k)
    return sparse_mla_ref(q, kv, torch.where(row >= 0, ind, -1), sm_scale, d_v, dtype=dtype, chunk=8)
