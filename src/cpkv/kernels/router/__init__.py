"""The MoE router's scores from the layer's input: sigmoid(float32(x) @ gate^T) without a float32 copy of x.

    dispatch   cpkv.model.moe.route   (CUDA, x bf16 / fp16)
    reference  ref.py (the torch ops it replaces)
    kernel     triton.py
"""
