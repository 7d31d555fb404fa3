"""The measurement harness behind ``cpkv bench`` and ``cpkv check``: never imported by the core library.

    compose.py / compose_cmd.py   ``cpkv bench compose``: every mode on real rank processes, against device copy
    check.py / check_cmd.py       ``cpkv check compose``: every mode byte-compared with a single-process reference
    indexer.py                    ``cpkv bench indexer``: logits against the fp8 GEMM, top-k against torch.topk
    attention.py                  ``cpkv bench attention``: sparse MLA against the bf16 GEMM
    engine.py                     ``cpkv bench engine``: prefill tokens/s through the whole CP engine
    serve.py / serve_report.py / serve_cmd.py   ``cpkv bench serve``: HTTP load generator, report, cost calibration
    moe.py                        ``cpkv bench moe``: grouped fp8 expert GEMM vs the dense block-scaled GEMM
    gemv.py                       ``cpkv bench gemv``: the fp8 linears at decode rows, Triton GEMV vs cuBLAS
    timing.py                     shared timing and ceiling helpers (CUDA-event medians, GEMM rates)

Each command module exposes ``HELP``, ``add_arguments(parser)`` and ``run(args)`` (see ``cpkv.cli``).
"""
