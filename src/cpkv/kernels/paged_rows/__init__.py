"""Paged rows (decode): KV rows read where they lie, through a page table, from every rank's pool.

    dispatch   cpkv.engine.paged.paged_rows (the gather step's context keys and selected token rows)
    reference  ref.paged_rows_ref (pure torch; the CPU path)
    kernel     the page gather kernel (``kernels.page_gather``, a row as its page) on the GPU; the static step
               does without the gather: the paged indexer logits (``kernels.mqa_logits.paged``) and the sparse
               decode kernel (``kernels.sparse_mla.decode``) read the rows in place (docs/design.md §11)
"""
