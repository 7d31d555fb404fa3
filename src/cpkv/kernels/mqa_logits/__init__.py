"""MQA logits of the lightning indexer: fp8 q . k, relu, head-weighted sum, key scale, causal window.

    dispatch   cpkv.indexer.logits.mqa_logits / logits_into (input checks; the kernel where the backends run
               Triton, else the reference)
    reference  ref.py (mqa_logits_ref: pure torch, defines the edge cases; paged_mqa_logits_ref: the decode form)
    kernels    triton.py (any sm_80+ GPU), gluon.py (Hopper: the default there), config.py (LogitsConfig),
               work.py (the non-empty (token group, key span) programs of a ragged batch, planned once per batch),
               paged.py (decode: one query row per generation over its index rows read in place through the
               page table; dispatch cpkv.indexer.paged.paged_logits)
"""
