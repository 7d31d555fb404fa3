"""FlashMLA's sparse MLA prefill, a peer kernel of the sparse_mla op, where the ``flash_mla`` package is installed.

FlashMLA (deepseek-ai/FlashMLA, built from source; SGLang and vLLM run the same kernel for DSA models) has
``flash_mla_sparse_fwd(q [T, H, d_qk], kv [S, 1, d_qk], indices [T, 1, topk], sm_scale, d_v) -> (out [T, H, d_v],
max_logits, lse)`` with cpkv's semantics: an index of -1 or >= S selects nothing. cpkv's own kernel is a little
slower on its shapes (BENCHMARKS.md, ``cpkv bench attention --peer flashmla``), so where FlashMLA imports and
takes the call (Hopper, bf16, 64 or 128 heads, d_qk 576 or 512, d_v 512) the sparse attention runs it.
``CPKV_SPARSE_MLA`` chooses, once (``cpkv.kernels.platform.resolve``): ``auto`` (that rule, the default), ``cpkv``
(always cpkv's kernel; the tests of cpkv's kernel pin it) or ``flashmla`` (FlashMLA where it applies, an error
where it does not import).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import torch

HEADS = (64, 128)
D_QK = (576, 512)
D_V = 512


@lru_cache(maxsize=1)
def load() -> Callable[..., Any] | None:
    """``flash_mla_sparse_fwd``, or None when the package does not import (tried once)."""
    try:
        from flash_mla import flash_mla_sparse_fwd
    except Exception:  # ImportError, or a build whose CUDA library fails to load
        return None
    return flash_mla_sparse_fwd


def import_error() -> str:
    """Why ``flash_mla`` does not import (for the one-line error of ``CPKV_SPARSE_MLA=flashmla``)."""
    try:
        import flash_mla  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return "it imports"


def applies(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """Whether FlashMLA's sparse prefill takes these inputs: CUDA, bf16, 64 or 128 heads, d_qk 576 or 512, d_v 512
    (the GPU, a Hopper one, is checked once, when the backends are resolved: ``cpkv.kernels.platform.resolve``)."""
    if not (q.is_cuda and kv.is_cuda) or q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return False
    return q.shape[1] in HEADS and q.shape[2] in D_QK and kv.shape[1] == q.shape[2] and d_v == D_V


def sparse_fwd(fn: Callable[..., Any], q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
               d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_mla``'s (out bf16 [T, H, d_v], lse float32 [T, H]) through FlashMLA's ``fn``."""
    idx = indices.to(torch.int32).contiguous()
    out, _, lse = fn(q.contiguous(), kv.contiguous()[:, None, :], idx[:, None, :], float(sm_scale), d_v)
    return out, lse.reshape(q.shape[0], q.shape[1]).float()
