"""Residual add + RMSNorm (+ the fp8 activation quantisation of the normed rows) in one pass.

    dispatch   cpkv.model.ops.add_rms_norm      (the layers' input and post-attention norms)
    reference  ref.py (add_rms_norm_ref: the torch ops it replaces)
    kernel     triton.py
"""
