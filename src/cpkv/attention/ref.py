"""The pure-torch references of the attention's ops, kept beside their kernels and re-exported here:
token-KV row (de)quantisation (``cpkv.kernels.token_kv.ref``), sparse / dense MLA and sparse decode MLA over
paged fp8 rows (``cpkv.kernels.sparse_mla.ref``). They define the semantics the kernels match, and are the CPU
path."""
from __future__ import annotations

from cpkv.kernels.sparse_mla.ref import dense_causal_mla_ref, dense_indices, sparse_decode_mla_ref, sparse_mla_ref
from cpkv.kernels.token_kv.ref import FP8_MAX, GLM5_TOKEN, dequant_token_kv_ref, quant_token_kv_ref, row_views

__all__ = ["FP8_MAX", "GLM5_TOKEN", "dense_causal_mla_ref", "dense_indices", "dequant_token_kv_ref",
           "quant_token_kv_ref", "row_views", "sparse_decode_mla_ref", "sparse_mla_ref"]
