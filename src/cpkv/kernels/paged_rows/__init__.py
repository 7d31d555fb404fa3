"""Paged rows (decode): KV rows read where they lie, through a page table, from every rank's pool.

    dispatch   cpkv.engine.decode.paged_rows (the decode step's indexer keys and selected token rows)
    reference  ref.paged_rows_ref (pure torch; the CPU path)
    kernel     none: on the GPU the indexer's logits and sparse MLA are to read the rows in place (a paged
               indexer kernel, still to come, and the sparse decode kernel ``cpkv.kernels.sparse_mla.decode``,
               docs/design.md §11), which makes this gather go
"""
