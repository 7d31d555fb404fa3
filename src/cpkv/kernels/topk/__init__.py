"""Top-k of the lightning indexer over ragged row ranges: indices relative to each row's start, ascending, -1 pad.

    dispatch   cpkv.indexer.topk.topk / topk_into (input checks; the kernel where the backends run Triton, else the
               reference)
    reference  ref.py (topk_ref: pure torch, defines ties and short rows)
    kernel     triton.py (sampled threshold, one streaming compaction pass, exact selection: one program a row, or,
               for few rows, each row's pass split over several programs and a merge launch; chosen from the shapes)
"""
