"""``--precision exact``: KV rows, indexer keys and queries kept unquantised in the model dtype.

    pack_rows(x [S, d] float, fmt: PlainFormat) -> uint8 [S, d * elem]     (a byte view, no rounding beyond
    unpack_rows(rows uint8 [S, row_bytes], fmt) -> [S, d] fmt.dtype           the model dtype's own)
    index_topk_exact(q [T, Hi, Di], k [S, Di], w float32 [T, Hi], plan, softmax_scale) -> int32 [T, topk] rows

The indexer here is transformers' formula: logits[i, j] = sum_h w[i, h] relu(q[i, h] . k[j] * Di^-1/2),
over keys [ks[i], ke[i]) of the dense buffer, in float32, a bounded block of query rows at a time, then the
top-k of ``cpkv.kernels.topk.ref.topk_ref`` (ties toward the lower index). No Hadamard rotation: it exists to
help fp8 quantisation and leaves dot products unchanged. The CP machinery (layout, compose, prefix cache)
moves these rows as bytes like any others. The layer's path of this precision: ``cpkv.model.precision.ExactPrecision``.
"""
from __future__ import annotations

import torch

from cpkv.config import PlainFormat

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK_BYTES = 1 << 28  # bounds the float32 [rows, Hi, keys] temporary of the exact indexer


def pack_rows(x: torch.Tensor, fmt: PlainFormat) -> torch.Tensor:
    """x [S, dims] float -> uint8 [S, row_bytes]: the values in fmt.dtype, as bytes."""
    return x.to(TORCH_DTYPES[fmt.dtype]).contiguous().view(torch.uint8)


def unpack_rows(rows: torch.Tensor, fmt: PlainFormat) -> torch.Tensor:
    """uint8 [S, row_bytes] -> [S, dims] fmt.dtype (a view when rows are contiguous)."""
    return rows.contiguous().view(TORCH_DTYPES[fmt.dtype])


def index_topk_exact(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor,
                     topk: int, softmax_scale: float) -> torch.Tensor:
    """q [T, Hi, Di], k [S, Di], w float32 [T, Hi] (head weights, n_heads^-1/2 folded), ks/ke int32 [T]
    -> int32 [T, topk] absolute dense rows of the selected keys (-1 none)."""
    from cpkv.kernels.topk.ref import topk_ref

    t, hi, _ = q.shape
    s = k.shape[0]
    out = torch.empty(t, topk, dtype=torch.int32, device=q.device)
    kf = k.float()
    step = max(1, BLOCK_BYTES // max(1, 4 * hi * s))
    for r0 in range(0, t, step):
        r = slice(r0, min(t, r0 + step))
        dots = torch.einsum("thd,sd->ths", q[r].float(), kf) * softmax_scale
        logits = torch.einsum("th,ths->ts", w[r].float(), dots.relu_())
        rel = topk_ref(logits, ks[r], ke[r], topk)
        out[r] = torch.where(rel >= 0, rel + ks[r, None], -1)
    return out
