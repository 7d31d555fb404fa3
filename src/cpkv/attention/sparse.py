"""Sparse MLA prefill attention over selected KV rows: Triton on CUDA, the torch reference elsewhere."""
from __future__ import annotations

import torch

from cpkv.attention import ref
from cpkv.attention.backend import (
    INDEX_DTYPES, check_same_device, check_tensor, expect, last_dim_contiguous, use_triton,
)


def sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q bf16 [T, H, d_qk], kv bf16 [S, d_qk], indices int32 [T, topk] -> (out bf16 [T, H, d_v], lse f32 [T, H]).

    Scores ``sm_scale * q . kv[j]`` over all d_qk dims; values are ``kv[j, :d_v]``. An index of
    -1 (any negative) or >= S selects nothing; a row with no valid index gives out 0, lse +inf.
    lse is the natural log-sum-exp of the scaled scores. int64 indices are accepted too.
    """
    check_inputs(q, kv, sm_scale, d_v)
    check_tensor("indices", indices, 2, INDEX_DTYPES)
    expect(indices.shape[0] == q.shape[0], f"indices with {q.shape[0]} rows (one per query token)",
           f"shape {tuple(indices.shape)}")
    check_same_device(q=q, kv=kv, indices=indices)
    if not kernel_applies(q, d_v):
        out, lse = ref.sparse_mla_ref(q, kv, indices, sm_scale, d_v)
        return out.to(torch.bfloat16), lse
    from cpkv.kernels.sparse_mla import triton as kernel

    idx = last_dim_contiguous(indices.to(torch.int32))
    out, lse, _ = kernel.launch(last_dim_contiguous(q), last_dim_contiguous(kv), idx, None, None,
                                float(sm_scale), d_v)
    return out, lse


def check_inputs(q: torch.Tensor, kv: torch.Tensor, sm_scale: float, d_v: int) -> None:
    """Shapes and dtypes shared by the sparse and the dense entry points (AttentionError if wrong)."""
    check_tensor("q", q, 3, (torch.bfloat16,))
    check_tensor("kv", kv, 2, (torch.bfloat16,))
    d_qk = q.shape[2]
    expect(kv.shape[1] == d_qk, f"kv rows of d_qk = {d_qk} dims (q's last dim)", f"shape {tuple(kv.shape)}")
    expect(isinstance(d_v, int) and 0 < d_v <= d_qk, f"0 < d_v <= d_qk = {d_qk}", d_v)
    expect(isinstance(sm_scale, (int, float)) and sm_scale > 0, "a positive float sm_scale", sm_scale)


def kernel_applies(q: torch.Tensor, d_v: int) -> bool:
    """Whether the Triton kernel runs for this input (CUDA, Triton present, supported dims)."""
    if not use_triton(q):
        return False
    from cpkv.kernels.sparse_mla import triton as kernel

    return kernel.supported(d_v, q.shape[2] - d_v)
