"""Pure-torch references: token-KV (de)quantisation and sparse / dense MLA attention.

These define the semantics the Triton kernels must match, and are the CPU path.

Token row (``RowFormat``; GLM-5: 512 + 16 + 128 = 656 B):

    [0, D_L)              float8_e4m3fn values, group g covers dims [128 g, 128 g + 128)
    [D_L, D_L + 4 G)      float32 scales, G = D_L / 128
    [D_L + 4 G, row)      bfloat16 rope, D_R values

Attention edge cases (as FlashMLA's reference): an index of -1 or >= S (or any negative) selects
nothing; a query row with no valid index gets out 0 and lse +inf.
"""
from __future__ import annotations

import torch

from cpkv.config import QUANT_GROUP, RowFormat

FP8_MAX = 448.0
GLM5_TOKEN = RowFormat(512, 4, 64)


def row_views(rows: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows uint8 [S, row_bytes] -> typed views (fp8 [S, D_L], scale fp32 [S, G], rope bf16 [S, D_R]).

    The views share the rows' storage (no copy), so they can be written through.
    """
    fp8 = rows[:, : fmt.fp8_bytes].view(torch.float8_e4m3fn)
    scale = rows[:, fmt.scale_offset : fmt.rope_offset].view(torch.float32)
    rope = rows[:, fmt.rope_offset : fmt.row_bytes].view(torch.bfloat16)
    return fp8, scale, rope


def dequant_token_kv_ref(rows: torch.Tensor, fmt: RowFormat = GLM5_TOKEN) -> torch.Tensor:
    """rows uint8 [S, row_bytes] -> bfloat16 [S, D_L + D_R]: ``bf16(fp32(fp8) * scale)`` | rope."""
    fp8, scale, rope = row_views(rows, fmt)
    latent = fp8.float() * scale.repeat_interleave(QUANT_GROUP, dim=1)
    return torch.cat([latent.to(torch.bfloat16), rope], dim=1)


def quant_token_kv_ref(kv: torch.Tensor, fmt: RowFormat = GLM5_TOKEN) -> torch.Tensor:
    """kv float [S, D_L + D_R] -> uint8 [S, row_bytes].

    scale = amax / 448 per 128-value group (float32); values rne(clamp(x / scale, +-448)) in e4m3;
    a group of zeros stores scale 0 and zero values; rope rounded to bfloat16.
    """
    s = kv.shape[0]
    d_l = fmt.fp8_bytes
    rows = torch.empty((s, fmt.row_bytes), dtype=torch.uint8, device=kv.device)
    fp8, scale, rope = row_views(rows, fmt)
    x = kv[:, :d_l].float().reshape(s, fmt.scale_count, QUANT_GROUP)
    amax = x.abs().amax(dim=2)
    sc = amax / torch.full_like(amax, FP8_MAX)  # tensor / tensor: IEEE division on every device
    safe = torch.where(sc > 0, sc, torch.ones_like(sc))
    vals = (x / safe[:, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(s, d_l)
    fp8.copy_(vals.to(torch.float8_e4m3fn))
    scale.copy_(sc)
    rope.copy_(kv[:, d_l:].to(torch.bfloat16))
    return rows


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
