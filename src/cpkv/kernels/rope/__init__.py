"""The interleaved RoPE of the MLA query's rope part, written straight into its slice of the absorbed query.

    dispatch   cpkv.model.ops.Rotary.interleaved_into   (DSALayer._query, fp8 rows)
    reference  ref.py (rope_interleaved_ref: separate float32 products and sums, one rounding)
    kernel     triton.py
"""
