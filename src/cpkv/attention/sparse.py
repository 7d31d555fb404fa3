"""Sparse MLA prefill attention over selected KV rows: FlashMLA where the backends chose it and it takes the call
(``cpkv.kernels.sparse_mla.flashmla``), else cpkv's kernel where they run Triton, the torch reference elsewhere."""
from __future__ import annotations

import torch

from cpkv.attention.checks import INDEX_DTYPES, check_same_device, check_tensor, expect, last_dim_contiguous
from cpkv.config import SPARSE_BACKENDS
from cpkv.kernels.platform import Backends, backends_for
from cpkv.kernels.sparse_mla import flashmla
from cpkv.kernels.sparse_mla.ref import sparse_mla_ref


def sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
    backends: Backends | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q bf16 [T, H, d_qk], kv bf16 [S, d_qk], indices int32 [T, topk] -> (out bf16 [T, H, d_v], lse f32 [T, H]).

    Scores ``sm_scale * q . kv[j]`` over all d_qk dims; values are ``kv[j, :d_v]``. An index of
    -1 (any negative) or >= S selects nothing; a row with no valid index gives out 0, lse +inf.
    lse is the natural log-sum-exp of the scaled scores. int64 indices are accepted too.
    ``backends``: the caller's (``cpkv.kernels.platform.Backends``); None: ``backends_for(q)``.
    """
    check_inputs(q, kv, sm_scale, d_v)
    check_tensor("indices", indices, 2, INDEX_DTYPES)
    if indices.shape[0] != q.shape[0]:  # messages built only on failure (these run once per layer)
        expect(False, f"indices with {q.shape[0]} rows (one per query token)", f"shape {tuple(indices.shape)}")
    check_same_device(q=q, kv=kv, indices=indices)
    backends = backends or backends_for(q)
    if backends.sparse_mla == "flashmla" and flashmla.applies(q, kv, d_v):
        return flashmla.sparse_fwd(flashmla.load(), q, kv, indices, sm_scale, d_v)
    if not kernel_applies(q, d_v, backends):
        out, lse = sparse_mla_ref(q, kv, indices, sm_scale, d_v)
        return out.to(torch.bfloat16), lse
    from cpkv.kernels.sparse_mla import triton as kernel

    idx = last_dim_contiguous(indices.to(torch.int32))
    out, lse, _ = kernel.launch(last_dim_contiguous(q), last_dim_contiguous(kv), idx, None, None,
                                float(sm_scale), d_v)
    return out, lse


def sparse_backend(backend: str | None = None) -> str:
    """The sparse attention backend asked for (the choice ``cpkv.kernels.platform.resolve`` turns into an
    implementation): ``backend``, else ``CPKV_SPARSE_MLA`` (auto, cpkv or flashmla)."""
    if backend is None:
        from cpkv import envs

        return envs.get("CPKV_SPARSE_MLA")
    expect(backend in SPARSE_BACKENDS, f"backend one of {', '.join(SPARSE_BACKENDS)}", repr(backend))
    return backend


def check_inputs(q: torch.Tensor, kv: torch.Tensor, sm_scale: float, d_v: int) -> None:
    """Shapes and dtypes shared by the sparse and the dense entry points (AttentionError if wrong)."""
    check_tensor("q", q, 3, (torch.bfloat16,))
    check_tensor("kv", kv, 2, (torch.bfloat16,))
    d_qk = q.shape[2]
    if kv.shape[1] != d_qk:  # messages built only on failure (these run once per layer)
        expect(False, f"kv rows of d_qk = {d_qk} dims (q's last dim)", f"shape {tuple(kv.shape)}")
    if not (isinstance(d_v, int) and 0 < d_v <= d_qk):
        expect(False, f"0 < d_v <= d_qk = {d_qk}", d_v)
    expect(isinstance(sm_scale, (int, float)) and sm_scale > 0, "a positive float sm_scale", sm_scale)


def kernel_applies(q: torch.Tensor, d_v: int, backends: Backends) -> bool:
    """Whether cpkv's kernel runs for this input (``backends.triton``, supported dims)."""
    if not backends.triton:
        return False
    from cpkv.kernels.sparse_mla import triton as kernel

    return kernel.supported(d_v, q.shape[2] - d_v)
