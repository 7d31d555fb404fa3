"""A layer's token-KV rows straight from its kv_a projection: latent RMSNorm, interleaved RoPE of the rope key and
the fp8 row quantisation in one pass.

    dispatch   cpkv.attention.quant.token_rows     (DSALayer.project, fp8 rows)
    reference  ref.py (token_rows_ref: the torch ops it replaces)
    kernel     triton.py
"""
