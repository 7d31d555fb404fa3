#!/usr/bin/env bash
# The figures and GPU tests the open issues ask for, so that a session with little device time spends it
# measuring. Every output lands under $OUT (or ./h200_out). Each group fits one device call (at most 10 minutes);
# run a group twice for the issues' "two runs".
#
#     bash benchmarks/h200_round.sh tests|verify|sampling|graphs|serve|host|engine|marks|grouped_bf16|engine_cp2|attention|mla|mla_ncu|gather|elem|compose|fp8|fp8_engine|depth|depth_run|depth_bench|depth_serve|decode|decode2|decode_tpot|decode_kernels|decode_serve ...
#
# FlashMLA for `bench attention --peer flashmla`: copy ../shared/peers to .peers or out/peers (ignored folders) and
# carry it; it is built here first (about 2 minutes). Each step has its own time limit, so one that hangs costs its
# limit and the others still run. NVLink multicast stays off.
set -u
OUT=${OUT:-h200_out}; mkdir -p "$OUT"
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
steps=" $* "
want() { [[ "$steps" == *" $1 "* ]]; }
step() {  # step NAME LIMIT_S COMMAND...: output to $OUT/NAME.txt, exit status appended
    local name=$1 limit=$2; shift 2
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    echo "rc=$?" >>"$OUT/$name.txt"; tail -3 "$OUT/$name.txt"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
if want tests; then  # in two steps: together they outran one limit of 400 s (2026-12-02, beside a FlashMLA build)
    step tests 380 python3 -m pytest -q -p no:cacheprovider tests/engine/test_prefill_gpu.py tests/model/test_model_fused.py \
        tests/compose/test_compose_gpu.py tests/kernels --ignore=tests/kernels/test_fp8_gemm_gpu.py  # group fp8 runs it
    step tests_attn 200 python3 -m pytest -q -p no:cacheprovider tests/attention/test_attention_gpu.py \
        tests/indexer/test_indexer_gpu.py tests/test_timeline.py  # 157 tests, 104 s on 2026-12-02
fi
if want verify; then  # issue 43: cpkv run's verification over GLM-5 and DeepSeek-V3.2 at 4 layers (models x weights x
    # precisions x seeds at each cp, ranks sharing the GPU), then the planted faults on the GPU
    # (cp 8 with bf16 weights does not fit one H200: eight 4-layer GLM-5 ranks hold 18.6 GB each, session 20)
    for cp in ${VERIFY_CP:-1 2 4 8}; do
        weights=bf16,fp8; [ "$cp" = 8 ] && weights=fp8
        step verify_cp$cp ${VERIFY_LIMIT:-150} python3 -m cpkv check verify --device cuda --models glm5,deepseek-v32 \
            --weights $weights --precision fp8,exact --seeds ${VERIFY_SEEDS:-0,1} --cp $cp --json
    done
    step verify_long 120 python3 -m cpkv check verify --device cuda --models glm5,deepseek-v32 --weights bf16,fp8 \
        --cp 2 --requests 2 --long 4096 --json  # sparse selection at the real top-k
    step verify_tests 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_verify_gpu.py ${VERIFY_TESTS:-}
fi
if want sampling; then  # issue 44: sampled generations on the GPU, same seed same tokens run to run (tiny and GLM-5 shapes)
    python3 -c 'import starlette, uvicorn, prometheus_client, httpx, pydantic, openai' 2>/dev/null || \
        python3 -m pip install -q --no-index --no-deps --target /tmp/site out/wheels/*.whl >"$OUT/wheels.txt" 2>&1
    PYTHONPATH=src:/tmp/site step sampling 400 python3 -m pytest -q -p no:cacheprovider tests/serve/test_serve_gpu.py
fi
if want graphs; then  # the CUDA graphs of small batches: their GPU tests, then a cached turn's 448 tokens with and without
    step graphs_tests 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_graphs_gpu.py
    step graphs_ab 150 python3 -m cpkv bench engine --long 0 --runs 5 --no-profile --graph-tokens 0 --json
    step graphs_on 150 python3 -m cpkv bench engine --long 0 --runs 5 --no-profile --marks --json
    # cp 2 (two ranks on the GPU, expert parallelism): the MoE layer's exchange runs eagerly between its R piece and
    # the next layer; its marks show whether the host keeps ahead of the GPU there
    step graphs_cp2 150 python3 -m cpkv bench engine --cp 2 --long 0 --runs 3 --no-profile --marks --json
fi
if want host; then  # a lone small batch at fp8 (the turn without the long prompt follows a batch that plans nothing
    # ahead: its plan and launches count): where its host time goes, bf16 beside fp8 (session 19: 22 ms for 8 of GPU)
    step host 200 python3 -m cpkv bench engine --weights bf16,fp8 --long 0 --runs 3 --no-profile --host-profile --marks --json
fi
if want engine; then  # issue 24's table: bf16 weights (its figures) and fp8 (as GLM-5 ships), host load after
    step engine 560 python3 -m cpkv bench engine --weights bf16,fp8 --json --host-load
fi
if want marks; then  # issue 24: where the host and the GPU are in each batch (timeline marks, SM clocks), sustained GEMM
    step marks 300 python3 -m cpkv bench engine --runs 2 --mark-clocks --json
fi
if want grouped_bf16; then  # the bf16 expert GEMM's switches against torch._grouped_mm, then its GPU tests
    step grouped_bf16 200 python3 benchmarks/grouped_bf16_sweep.py --json
    step grouped_bf16_tests 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_grouped_bf16_gpu.py
fi
if want engine_cp2; then
    step engine_cp2 150 python3 -m cpkv bench engine --cp 2 --long 0 --no-profile --json
fi
if want serve; then  # `cpkv serve` on the GPU at cp 2 (expert parallelism), closed loop on the seed-shaped trace: a first
    # server fills the kernel caches (on a fresh machine the first server compiles its kernels, which would weigh on
    # whichever option ran first), then graphs on (the default), off, on again. The GPU machine has no starlette / uvicorn: carry their wheels in out/wheels, made here by
    # `pip download starlette uvicorn prometheus-client httpx anyio h11 click sniffio idna certifi httpcore
    #  typing-extensions -d out/wheels --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 --no-deps`
    python3 -c 'import starlette, uvicorn, prometheus_client, httpx' 2>/dev/null || \
        python3 -m pip install -q --no-index --no-deps out/wheels/*.whl >"$OUT/serve_wheels.txt" 2>&1
    step serve 300 env CPKV="python3 -m cpkv" BOOT_S=150 WARMUP=2 TRACE="--requests 24 --scale 1" \
        GEOM="--model glm5 --cp 2 --chunk-size 16384 --page-size 64 --pages-per-rank 8192 --max-requests 16" \
        SERVE_EXTRA="--num-layers 4 --device cuda" bash benchmarks/serve_ab.sh "$OUT/serve" "prime=" "graphs=" "eager=--graph-tokens 0" "graphs2="
fi
peers=""; for d in .peers out/peers; do [ -f "$d/build_flashmla.sh" ] && peers=$d && break; done
flashmla() {  # builds FlashMLA once; true when it is importable
    [ -n "$peers" ] || return 1
    [ -d /tmp/peers/FlashMLA/flash_mla ] || bash "$peers/build_flashmla.sh" /tmp/peers >"$OUT/flashmla_build.txt" 2>&1
}
if want attention; then
    peer=()
    if flashmla; then export PYTHONPATH=src:/tmp/peers/FlashMLA; peer=(--peer flashmla); fi
    step attention 400 python3 -m cpkv bench attention --json "${peer[@]}"
fi
if want mla && flashmla; then  # the sparse MLA kernel's GPU tests, then the kernel against FlashMLA on its shapes
    step mla_tests 240 python3 -m pytest -q -p no:cacheprovider tests/attention/test_attention_gpu.py -k gluon
    PYTHONPATH=src:/tmp/peers/FlashMLA step flashmla_tests 200 python3 -m pytest -q -p no:cacheprovider \
        tests/attention/test_flashmla_gpu.py  # FlashMLA as the engine's sparse attention backend
    PYTHONPATH=src:/tmp/peers/FlashMLA step mla 330 python3 -m cpkv bench attention --peer flashmla \
        --tokens 4096 --rep-ms 40 --json
fi
if want mla_ncu && flashmla; then  # issue 24: Nsight Compute, cpkv's sparse MLA beside FlashMLA's (full set: stall reasons;
    # then each kernel's SASS with its warp-stall samples per instruction: read it with benchmarks/ncu_sass.py);
    # --clock-control none leaves the clocks alone
    PYTHONPATH=src:/tmp/peers/FlashMLA step mla_ncu 300 ncu --clock-control none --kernel-name regex:sparse \
        --launch-skip 2 --launch-count 2 --set full --import-source no --export /tmp/mla_ncu --force-overwrite \
        python3 benchmarks/ncu_mla.py --heads 128 --kv 32768
    step mla_ncu_details 60 ncu -i /tmp/mla_ncu.ncu-rep --page details --print-details all
    step mla_ncu_sass 120 bash -c "ncu -i /tmp/mla_ncu.ncu-rep --page source --print-source sass --csv | gzip >$OUT/mla_sass.csv.gz"
fi
if want gather; then  # issue 24: page gather configs in device time against copy_ (byte-checked first)
    step gather 150 python3 -m cpkv.bench.compose --json
fi
if want elem; then  # issue 24: index-row variants against a copy_ of the same bytes, the router kernel against F.linear
    step elem 180 python3 benchmarks/elem_kernels.py
fi
if want compose; then
    step compose 300 python3 -m cpkv bench compose --device cuda --cp 2 --json
    step check 250 python3 -m cpkv check compose --device cuda --cp 2 --modes all --batches 3 --json
fi
if want fp8; then  # issue 22 item 1: block-scaled fp8 linear / grouped expert GEMM tests, the grouped GEMM's rate
    step fp8_tests 390 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm_gpu.py
    step moe 180 python3 -m cpkv bench moe --json
fi
if want fp8_engine; then  # GLM-5 shapes, 4 layers: fp8 vs bf16 weights in one run, TTFT weighted by layer kind
    step engine_fp8 560 python3 -m cpkv bench engine --weights fp8,bf16 --json
fi
# issue 42: GLM-5 at its full 78 layers on one H200, one cp-8 rank's share of the experts (--experts 32), cp 1.
DEPTH="--model glm5 --experts 32 --weights fp8"
if want depth || want depth_run; then  # the run verified at depth (reference on rank 0's own model: --reference
    # auto at cp 1 on CUDA), its plan (JSON) and the plan against the run's measured peaks (plan_vs_peak in its JSON)
    # (--long 4096: a two-turn conversation past GLM-5's index top-k, so the 40 full indexer layers select sparsely;
    # its run and verification outran 150 s and 170 s limits on 2026-12-04: give it a call of its own)
    # (DEPTH_SITES=1: CPKV_MEMORY_SITES, the rank's live memory by allocation site at each set-up mark, for the
    # plan's residual; it records every allocation's stack: the run takes minutes longer)
    sites=(); [ -n "${DEPTH_SITES:-}" ] && sites=(CPKV_MEMORY_SITES="$OUT/memsites")
    # (DEPTH_RUN_ARGS: the trace; 2026-12-04 the 14-request one's verification at depth outran 400 s: 2 + the two
    # long turns verify in one call)
    step depth_run ${DEPTH_RUN_S:-420} env "${sites[@]}" python3 -m cpkv run $DEPTH --device cuda --cp 1 --chunk-size 4096 \
        --page-size 64 --pages-per-rank 2048 ${DEPTH_RUN_ARGS:---requests 2 --long 4096} --json
    step depth_plan 30 python3 -m cpkv plan $DEPTH --cp 1 --chunk-size 4096 --page-size 64 --pages-per-rank 2048 --json
    python3 benchmarks/plan_vs_peak.py "$OUT/depth_run.txt" >"$OUT/depth_plan_vs_peak.txt" 2>&1
fi
if want depth || want depth_bench; then  # TTFT measured at depth beside the 4-layer extrapolation in the same rank
    # processes (one timed run: time is short)
    # chunk 16384 (the model size preset's): a 32K chunk's workspace beside ~114 GB of weights outran the GPU
    step depth_bench ${DEPTH_BENCH_S:-330} python3 -m cpkv bench engine $DEPTH --layers 78 --extrapolate-from 4 \
        --chunk-size ${DEPTH_CHUNK:-16384} --runs 1 --no-profile --json
fi
if want decode; then  # issue 45: the paged decode step's GPU tests (its kernels, the step's forms, the sliced head
    # weights and router), then its time against its floor (GLM-5 shapes, 4 layers): cp 1 with both weights and the
    # forms auto (graphs) and gather in the same ranks, cp 2 (two ranks on the GPU; auto = static); each case's last
    # step profiled on rank 0 (tables under $OUT/decode_prof); then the paged kernels against their references / peers
    step decode_tests ${DECODE_TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine/test_decode.py \
        tests/kernels/test_paged_rows_gpu.py tests/kernels/test_paged_logits_kernel.py tests/indexer/test_paged_logits.py \
        tests/attention/test_sparse_decode_gpu.py
    [ -z "${DECODE_SKIP_KERN:-}" ] && step decode_kern_tests ${DECODE_KERN_S:-200} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_gpu.py \
        tests/kernels/test_elem_gpu.py -k "head_weights or router"
    step decode_cp1 ${DECODE_CP1_S:-300} python3 -m cpkv bench decode --model glm5 --num-layers 4 --cp 1 --device cuda \
        --weights fp8,bf16 --keys ${DECODE_KEYS:-1024,32768,131072} --batches ${DECODE_BATCHES:-1,8,32} --steps 5 \
        --profile "$OUT/decode_prof" --json
    [ -z "${DECODE_SKIP_AB:-}" ] && step decode_ab ${DECODE_AB_S:-300} python3 -m cpkv bench decode --model glm5 --num-layers 4 --cp 1 --device cuda \
        --weights fp8 --form gather,static,graphs --keys 32768 --batches 1,32 --steps 5 --json
    step decode_cp2 ${DECODE_CP2_S:-200} python3 -m cpkv bench decode --model glm5 --num-layers 4 --cp 2 --device cuda \
        --weights fp8 --form auto,gather --keys 1024,32768,131072 --batches 1,32 --steps 5 --json
fi
if want decode2; then  # issue 45, session 23: the pipelined loop (cp 1) and the few-row kernels (top-k split, fp8 GEMV,
    # sparse decode tiles, paged logits at B 32): GPU tests, the kernels old vs new, the step with both weights (new
    # defaults), the old kernels in the same ranks' run for A/B (DECODE2_OLD_ENV), TPOT through `cpkv serve` at cp 1
    step d2_tests ${D2_TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider -m cuda tests/engine/test_decode.py \
        ${D2_TEST_FILES:-}
    [ -n "${D2_KERN:-}" ] && step d2_kern ${D2_KERN_S:-150} bash -c "$D2_KERN"
    step d2_cp1 ${D2_CP1_S:-260} python3 -m cpkv bench decode --model glm5 --num-layers 4 --cp 1 --device cuda \
        --weights fp8,bf16 --keys ${DECODE_KEYS:-1024,32768,131072} --batches ${DECODE_BATCHES:-1,8,32} --steps 5 --json
    [ -n "${D2_OLD_ENV:-}" ] && step d2_old ${D2_OLD_S:-90} env $D2_OLD_ENV python3 -m cpkv bench decode --model glm5 \
        --num-layers 4 --cp 1 --device cuda --weights fp8 --keys 32768 --batches 1,32 --steps 5 --json
    if [ -z "${D2_SKIP_SERVE:-}" ]; then
        python3 -c 'import starlette, uvicorn, prometheus_client, httpx' 2>/dev/null || \
            python3 -m pip install -q --no-index --no-deps --target /tmp/site out/wheels/*.whl >"$OUT/serve_wheels.txt" 2>&1
        PYTHONPATH=src:/tmp/site step d2_serve ${D2_SERVE_S:-150} env CPKV="python3 -m cpkv" BOOT_S=100 WARMUP=2 \
            TRACE="--requests 8 --scale 0.25" LOAD_EXTRA="--max-tokens 64" \
            GEOM="--model glm5 --cp 1 --chunk-size 16384 --page-size 64 --pages-per-rank 4096 --max-requests 8" \
            SERVE_EXTRA="--num-layers 4 --device cuda" bash benchmarks/serve_ab.sh "$OUT/d2_serve" "paged=--decode paged"
    fi
fi
if want decode_kernels; then  # the paged kernels alone: sparse decode MLA (FlashMLA's sparse decode beside it where
    # it builds), the indexer's paged logits
    peer=()
    if flashmla; then export PYTHONPATH=src:/tmp/peers/FlashMLA; peer=(--peer flashmla); fi
    step attention_decode 200 python3 -m cpkv bench attention --decode "${peer[@]}" --json
    [ -n "${DECODE_SWEEP:-}" ] && step attention_decode_sweep 150 python3 -m cpkv bench attention --decode --sweep \
        --batches 1,32 --json
    step indexer_decode 150 python3 -m cpkv bench indexer --decode --json
fi
if want decode_serve; then  # issue 45: `cpkv serve` on the GPU (GLM-5 shapes, 4 layers, cp 2 as the issue measured),
    # 32 new tokens per request: TPOT with the paged decode step against the one-token-extend path
    python3 -c 'import starlette, uvicorn, prometheus_client, httpx' 2>/dev/null || \
        python3 -m pip install -q --no-index --no-deps --target /tmp/site out/wheels/*.whl >"$OUT/serve_wheels.txt" 2>&1
    PYTHONPATH=src:/tmp/site step decode_serve ${DECODE_SERVE_S:-300} env CPKV="python3 -m cpkv" BOOT_S=150 WARMUP=2 \
        TRACE="--requests 12 --scale 0.25" LOAD_EXTRA="--max-tokens 32" \
        GEOM="--model glm5 --cp 2 --chunk-size 16384 --page-size 64 --pages-per-rank 4096 --max-requests 16" \
        SERVE_EXTRA="--num-layers 4 --device cuda" bash benchmarks/serve_ab.sh "$OUT/decode_serve" \
        "paged=--decode paged" "extend=--decode extend"
fi
if want decode_tpot; then  # issue 45: TPOT through `cpkv serve` by context (GLM-5 shapes, 4 layers, cp 1, paged decode:
    # the graphs and the pipelined loop), one generation at a time, 64 tokens each, fresh 1K / 32K / 128K prompts
    # (TPOT_SAMPLING="--temperature 0.8 --top-p 0.95": sampled, drawn inside the step's graph since session 24)
    python3 -c 'import starlette, uvicorn, prometheus_client, httpx' 2>/dev/null || \
        python3 -m pip install -q --no-index --no-deps --target /tmp/site out/wheels/*.whl >"$OUT/serve_wheels.txt" 2>&1
    python3 benchmarks/tpot_by_context.py make "$OUT/tpot_trace.jsonl" --lengths ${TPOT_LENGTHS:-1024,32768,131072} \
        --each ${TPOT_EACH:-3}
    PYTHONPATH=src:/tmp/site step decode_tpot ${DECODE_TPOT_S:-240} env CPKV="python3 -m cpkv" BOOT_S=100 WARMUP=1 \
        TRACE_FILE="$OUT/tpot_trace.jsonl" LOAD_EXTRA="--max-tokens ${TPOT_TOKENS:-64} ${TPOT_SAMPLING:-}" \
        GEOM="--model glm5 --cp 1 --chunk-size 16384 --page-size 64 --pages-per-rank 8192 --max-requests 8" \
        SERVE_EXTRA="--num-layers 4 --device cuda ${TPOT_SERVE_EXTRA:-}" bash benchmarks/serve_ab.sh "$OUT/decode_tpot" \
        "paged=--decode paged"
    python3 benchmarks/tpot_by_context.py report "$OUT/decode_tpot/paged.jsonl" >"$OUT/decode_tpot_table.txt" 2>&1
fi
if want depth_serve; then  # `cpkv serve` at depth on one GPU (cp 1), closed loop on the seed-shaped trace scaled to its
    # KV (about 130K tokens at 2048 pages of 64 beside ~114 GB of weights: `cpkv plan` in group depth), solo then mix
    python3 -c 'import starlette, uvicorn, prometheus_client, httpx' 2>/dev/null || \
        python3 -m pip install -q --no-index --no-deps --target /tmp/site out/wheels/*.whl >"$OUT/serve_wheels.txt" 2>&1
    # (mix first since 2026-12-04: the second server runs over the first's on-disk Triton cache; solo's cached turns
    # were 1.6-2.2 s where mix's, second, were 0.1 s. DEPTH_LOAD_EXTRA="--max-tokens 16": TPOT at depth too)
    PYTHONPATH=src:/tmp/site step depth_serve ${DEPTH_SERVE_S:-560} env CPKV="python3 -m cpkv" BOOT_S=${DEPTH_BOOT_S:-240} WARMUP=2 \
        TRACE="${DEPTH_TRACE:---requests 16 --scale 0.25}" LOAD_EXTRA="${DEPTH_LOAD_EXTRA:-}" \
        GEOM="--model glm5 --cp 1 --chunk-size 8192 --page-size 64 --pages-per-rank 2048 --max-requests 8" \
        SERVE_EXTRA="--experts 32 --weights fp8 --device cuda" bash benchmarks/serve_ab.sh "$OUT/depth_serve" \
        "mix=--policy mix" "solo=--policy solo"
fi
