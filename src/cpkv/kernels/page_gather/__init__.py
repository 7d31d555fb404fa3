"""Page gather (compose): whole pages copied as bytes from a table of sources into a dense buffer.

    dispatch   cpkv.compose.runtime.ComposeRuntime.gather (Triton launch prepared once per plan, or the reference)
    reference  ref.page_gather_ref / ref.gather_group (pure torch; the CPU path)
    kernel     triton.py (one kernel for one target, one for two targets in one launch)
"""
