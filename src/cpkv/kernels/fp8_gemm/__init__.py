"""Block-scaled fp8 GEMMs (DeepSeek / GLM-5 format: 128 x 128 weight blocks, 1 x 128 activation groups).

    dispatch   cpkv.model.linear.fp8_linear / quant_act / swiglu   (dense layers: torch._scaled_mm on CUDA; at most
                                                                    Backends.fp8_gemv_rows rows: gemv.py)
               cpkv.model.experts.grouped_swiglu                    (routed experts: the grouped kernel)
    reference  ref.py (fp8_linear_ref, fp8_linear_quant_ref, grouped_fp8_ref, act_quant_ref, dequant_blocks)
    kernels    triton.py (act_quant, swiglu_quant, grouped_gemm and its VARIANTS), gluon_ws.py (the grouped GEMM
               warp-specialised for Hopper: the GLUON variants), gemv.py (the few-row block-scaled product: the
               weight streamed once, split over K, reduced in a fixed order)
"""
