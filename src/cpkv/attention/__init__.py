"""Sparse MLA prefill attention over the composed KV (docs/design.md §6).

    dequant_token_kv(rows uint8 [S, 656]) -> bf16 [S, 576]      (and quant_token_kv, its inverse)
    token_rows(kv, weight, cos, sin, eps) -> uint8 [T, 656]      kv_a output -> rows (norm, RoPE, quant fused)
    sparse_mla(q [T, H, 576], kv [S, 576], indices [T, topk], sm_scale, d_v=512) -> (out, lse)
    dense_causal_mla(q, kv, ks [T], ke [T], sm_scale, d_v) -> (out, lse)   short rows, no indexer
    sparse_decode_mla(q [B, H, 576], pools, owner [B, K], row [B, K], sm_scale, d_v, fmt) -> (out, lse)
                                                                  decode: fp8 token rows read in place (§11)

Each entry point takes the caller's ``cpkv.kernels.platform.Backends`` (the model's, chosen once at its load):
the kernels of ``cpkv.kernels.sparse_mla`` (and FlashMLA where chosen), ``token_kv`` and ``token_rows`` where they
run Triton; the pure-torch references beside those kernels (re-exported in ``cpkv.attention.ref``) define the
semantics and run everywhere else.
"""
from __future__ import annotations

from cpkv.attention.dense import dense_causal_mla
from cpkv.attention.quant import dequant_token_kv, quant_token_kv, token_rows
from cpkv.attention.ref import dense_causal_mla_ref, sparse_decode_mla_ref, sparse_mla_ref
from cpkv.attention.sparse import sparse_mla
from cpkv.attention.sparse_decode import pool_bases, sparse_decode_mla

__all__ = [
    "dense_causal_mla", "dense_causal_mla_ref", "dequant_token_kv", "pool_bases", "quant_token_kv",
    "sparse_decode_mla", "sparse_decode_mla_ref", "sparse_mla", "sparse_mla_ref", "token_rows",
]
