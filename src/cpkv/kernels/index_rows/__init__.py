"""The indexer's keys and queries from their projections: (LayerNorm,) first-dims RoPE, Hadamard rotation and fp8
quantisation in one pass.

    dispatch   cpkv.indexer.quant.prepare_index_keys / prepare_index_queries   (DSALayer, fp8 rows)
    reference  ref.py (the torch ops they replace)
    kernel     triton.py
"""
