"""The MoE combine: each token's k expert outputs gathered from the expert-sorted rows and summed (plus the shared
experts' output) in one pass, instead of a gather of every row, a reduction and an add.

    dispatch   cpkv.model.moe.combine_pairs
    reference  ref.py (combine_ref: the torch ops it replaces)
    kernel     triton.py
"""
