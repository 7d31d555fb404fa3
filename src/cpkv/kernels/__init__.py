"""GPU kernels, grouped by the op they serve; each op has one dispatch point and a pure-torch reference.

    op            dispatch point                         reference                          kernels
    page_gather   compose.runtime.ComposeRuntime.gather  kernels.page_gather.ref            page_gather/triton.py
    mqa_logits    indexer.logits.logits_into             indexer.ref.mqa_logits_ref         mqa_logits/{triton,gluon}.py
    topk          indexer.topk.topk_into                 indexer.ref.topk_ref               topk/triton.py
    sparse_mla    attention.sparse / attention.dense     attention.ref.sparse_mla_ref       sparse_mla/{triton,gluon_ws}.py
    token_kv      attention.quant                        attention.ref.*_token_kv_ref       token_kv/triton.py
    fp8_gemm      model.linear.fp8_linear (torch._scaled_mm) kernels.fp8_gemm.ref             fp8_gemm/{triton,gluon_ws}.py
                  model.experts.grouped_swiglu (grouped)
    add_norm      model.ops.add_rms_norm                 kernels.add_norm.ref               add_norm/triton.py
    token_rows    attention.quant.token_rows             kernels.token_rows.ref             token_rows/triton.py
    index_rows    indexer.quant.prepare_index_keys/_queries kernels.index_rows.ref          index_rows/triton.py
                  indexer.quant.head_weights
    swiglu        model.experts.swiglu_weighted          kernels.swiglu.ref                 swiglu/triton.py
                  model.linear.swiglu (dense MLPs)
    combine       model.moe.combine_pairs                kernels.combine.ref                combine/triton.py
    router        model.moe.router_scores (route)        kernels.router.ref                 router/triton.py
    rope          model.ops.Rotary.interleaved_into      kernels.rope.ref                   rope/triton.py

``platform`` answers every platform question (Triton / Gluon importable, CUDA and ``CPKV_DISABLE_TRITON``,
capability, SM count). Kernel modules import Triton; nothing imports them before the dispatch point has asked
``platform.use_triton``, so the package imports on machines without Triton.
"""
