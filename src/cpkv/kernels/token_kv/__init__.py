"""Token-KV row (de)quantisation: bf16 [S, 576] <-> the 656-byte fp8 token rows of the KV pool.

    dispatch   cpkv.attention.quant.dequant_token_kv / quant_token_kv (checks; the kernel where the backends run
               Triton)
    reference  ref.py (dequant_token_kv_ref / quant_token_kv_ref, row_views, the row layout)
    kernel     triton.py
"""
