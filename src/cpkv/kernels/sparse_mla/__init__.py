"""Sparse MLA prefill attention over the composed KV (and its dense causal form for short rows).

    dispatch   cpkv.attention.sparse.sparse_mla, cpkv.attention.dense.dense_causal_mla (checks; FlashMLA or the
               kernel as the backends chose)
    reference  ref.py (sparse_mla_ref / dense_causal_mla_ref: pure torch, float64 in tests)
    kernels    triton.py (any sm_80+ GPU; its ``launch`` picks the kernel), gluon_ws.py (Hopper, 64 heads,
               512 + 64 dims: warp-specialised, the default there), flashmla.py (FlashMLA's kernel where the
               ``flash_mla`` package is installed: ``CPKV_SPARSE_MLA``)
"""
