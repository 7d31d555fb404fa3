"""Sparse MLA prefill attention over the composed KV (and its dense causal form for short rows), and sparse decode
MLA over paged fp8 token rows read in place.

    dispatch   cpkv.attention.sparse.sparse_mla, cpkv.attention.dense.dense_causal_mla (checks; FlashMLA or the
               kernel as the backends chose)
               cpkv.attention.sparse_decode.sparse_decode_mla (the kernel where the backends run Triton)
    reference  ref.py (sparse_mla_ref / dense_causal_mla_ref / sparse_decode_mla_ref: pure torch, float64 in tests)
    kernels    triton.py (any sm_80+ GPU; its ``launch`` picks the kernel), gluon_ws.py (Hopper, 64 heads,
               512 + 64 dims: warp-specialised, the default there), flashmla.py (FlashMLA's kernel where the
               ``flash_mla`` package is installed: ``CPKV_SPARSE_MLA``), decode.py (split-K decode over
               paged fp8 rows: one query token per generation)
"""
