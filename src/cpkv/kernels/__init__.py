"""GPU kernels, grouped by the op they serve; each op has one dispatch point and a pure-torch reference beside it.

    op            dispatch point                         reference                          kernels
    page_gather   compose.runtime.ComposeRuntime.gather  page_gather/ref.py                 page_gather/triton.py
    mqa_logits    indexer.logits.logits_into             mqa_logits/ref.py                  mqa_logits/{triton,gluon}.py
                  indexer.paged.paged_logits (decode)                                       mqa_logits/paged.py
    topk          indexer.topk.topk_into                 topk/ref.py                        topk/triton.py
    sparse_mla    attention.sparse / attention.dense     sparse_mla/ref.py                  sparse_mla/{triton,gluon_ws}.py,
                                                                                            sparse_mla/flashmla.py (FlashMLA)
    token_kv      attention.quant                        token_kv/ref.py                    token_kv/triton.py
    fp8_gemm      model.linear.fp8_linear (torch._scaled_mm) fp8_gemm/ref.py                 fp8_gemm/{triton,gluon_ws}.py,
                  (few rows: the GEMV)                                                      fp8_gemm/gemv.py
                  model.experts.grouped_swiglu (grouped)
    add_norm      model.ops.add_rms_norm                 add_norm/ref.py                    add_norm/triton.py
    token_rows    attention.quant.token_rows             token_rows/ref.py                  token_rows/triton.py
    index_rows    indexer.quant.prepare_index_keys/_queries index_rows/ref.py               index_rows/triton.py
                  indexer.quant.head_weights
    swiglu        model.experts.swiglu_weighted          swiglu/ref.py                      swiglu/triton.py
                  model.linear.swiglu (dense MLPs)
    combine       model.moe.combine_pairs                combine/ref.py                     combine/triton.py
    router        model.moe.router_scores (route)        router/ref.py                      router/triton.py
    rope          model.ops.Rotary.interleaved_into      rope/ref.py                        rope/triton.py
    barrier       compose.barrier.make_barrier           compose.barrier.CountingBarrier    barrier/triton.py
    paged_rows    engine.paged.paged_rows                paged_rows/ref.py                  page_gather/triton.py (a row as its page)

This package imports nothing above it (tests/test_architecture.py): attention, indexer and model import the
references from here and re-export the ones their users know. ``platform`` answers every platform question
(Triton / Gluon importable, capability, SM count) and resolves the ``Backends`` once: every dispatch point takes
the Backends of the object that runs it. Kernel modules import Triton; nothing imports them before a dispatch
point's Backends said Triton runs, so the package imports on machines without Triton.
"""
