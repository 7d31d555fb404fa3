"""The routed experts' weighted SwiGLU activation (compute-dtype weights): silu(g) * u * rw in one pass.

    dispatch   cpkv.model.experts.swiglu_weighted   (the bf16 grouped expert GEMMs' activation)
    reference  ref.py (swiglu_weighted_ref: the torch ops it replaces)
    kernel     triton.py
"""
