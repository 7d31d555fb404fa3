"""Token-KV row (de)quantisation: bf16 [S, 576] <-> the 656-byte fp8 token rows of the KV pool.

    dispatch   cpkv.attention.quant.dequant_token_kv / quant_token_kv (checks; kernel on CUDA)
    reference  cpkv.attention.ref.dequant_token_kv_ref / quant_token_kv_ref
    kernel     triton.py
"""
