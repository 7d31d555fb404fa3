"""``cpkv bench engine`` on the CPU (tiny model): cases, timed runs, TTFT; the breakdown's name rules and sums."""
from __future__ import annotations

import json

import pytest

from cpkv.bench.breakdown import PARTS, busy_us, classify, parts
from cpkv.engine.instruments import HOST_FUNCS_TOP


@pytest.mark.parametrize("name, part", [
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "gemm"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8", "gemm"),
    ("mqa_logits_gluon_kernel", "indexer_logits"), ("topk_stream_kernel", "topk"),
    ("_sparse_mla_ws", "attention"), ("_sparse_mla_fwd", "attention"),
    # FlashMLA's sparse prefill (its name as ncu printed it, 2026-12-02, abridged): attention, not a CUTLASS GEMM
    ("void sm90::sparse_attn_fwd_kernel<sm90::KernelTemplate<576, 0>, sm90::KernelTemplate<576, 0>::TmaParams<"
     "cute::tuple<int, int, int>, cute::TiledCopy<cute::Copy_Atom<cute::Copy_Traits<cute::SM90_TMA_LOAD, "
     "cute::C<65536>>>, cutlass::bfloat16_t>>>(SparseAttnFwdParams, T2)", "attention"),
    ("_page_gather_pair", "compose"), ("_barrier", "compose"), ("_dequant", "quant"), ("_quant", "quant"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm"), ("_grouped_gemm", "gemm"),
    ("_grouped_v", "gemm"), ("_grouped_ws", "gemm"),
    ("_act_quant", "quant"), ("_swiglu_quant", "quant"), ("_head_weights", "gemm"),
    ("_add_rms_norm", "elementwise"), ("_token_rows", "elementwise"), ("_index_rows", "elementwise"),
    ("void at::native::unrolled_elementwise_kernel<c10::Float8_e4m3fn>", "quant"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<4u>>", "elementwise"),
])
def test_kernel_names_map_to_parts(name, part):
    assert classify(name) == part


def test_parts_add_kernel_time_and_the_host_gap():
    """The host gap is the profiled batches' own idle (from each batch's start to its last kernel's end, minus the
    busy time), shares are of that profiled wall; the timed walls are reported beside it, not mixed in."""
    assert busy_us([(0, 10), (5, 15), (20, 30)]) == 25
    out = parts([([("x_gemm", 0, 1000), ("cat", 500, 2000)], 0.004), ([("_barrier", 0, 500)], 0.001)])
    p = out["parts"]
    assert list(p) == list(PARTS)
    assert (p["gemm"]["ms"], p["elementwise"]["ms"], p["compose"]["ms"]) == (1.0, 1.5, 0.5)
    assert out["gpu_busy_ms"] == 2.5 and out["wall_ms"] == 2.5 and out["timed_wall_ms"] == 5.0
    assert out["idle_ms"] == 0.0 and p["host_gap"] == {"ms": 0.0, "share": 0.0}  # kernels cover both batches
    assert p["elementwise"]["share"] == 0.6  # of the profiled 2.5 ms, not of the timed 5
    late = parts([([("a", 300, 1000), ("b", 1500, 2000)], 0.003)])  # idle 0.3 ms before a, 0.5 between a and b
    assert late["idle_ms"] == 0.8 and late["parts"]["host_gap"] == {"ms": 0.8, "share": 0.4}
    assert late["wall_ms"] == 2.0 and late["timed_wall_ms"] == 3.0
    assert out["top"][0] == ("cat", 1.5, "elementwise")


def test_split_spans_gives_each_batch_its_kernels_from_its_start():
    """Batch 0 unchained (from its host start), batch 1 chained on it: launched at 4 while batch 0 ran until 9;
    its kernels from 9, where its GPU time begins (idle 1 before its first kernel: the GPU waiting for its host
    work); batch 2 after a synchronisation: from its host start 30. Kernels before the first batch, and the
    barrier check's copy after batch 1's GPU range (at 20), are left out. Without GPU ranges, host starts split
    them: batch 1's kernels then fall into batch 0 (what a run-spanning profiler must avoid: hence the GPU-side
    annotation)."""
    from cpkv.engine.instruments import split_spans

    k = [("setup", 0, 1), ("a", 3, 5), ("b", 5, 9), ("c", 10, 12), ("d", 12, 14), ("check", 20, 21), ("e", 31, 33)]
    spans = split_spans(k, [2, 4, 30], [(3, 9), (10, 14), (31, 33)])
    assert spans == [[("a", 1, 3), ("b", 3, 7)], [("c", 1, 3), ("d", 3, 5)], [("e", 1, 3)]]
    by_host = split_spans(k, [2, 4, 30], None)
    assert [[n for n, _, _ in s] for s in by_host] == [["a"], ["b", "c", "d", "check"], ["e"]]
    assert split_spans([], [1.0], [(2.0, 3.0)]) == [[]]
    # through the breakdown: batch 1's host gap is the 1 us before c
    assert parts([(spans[1], 1e-5)])["idle_ms"] == 0.001


@pytest.mark.slow
def test_bench_engine_runs_every_case_on_cpu(capsys):
    from cpkv.cli import main
    from cpkv.model.config import load_model_config

    rc = main(["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "1", "--prompt", "256",
               "--long", "512", "--chunk-size", "256", "--page-size", "16", "--runs", "2", "--host-profile",
               "--turn", "40", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    cases = {c["case"]: c for c in rep["cases"]}
    assert [c for c in cases] == ["cold", "cached", "long", "turn"]
    assert [cases[k]["batches"] for k in ("cold", "cached", "long", "turn")] == [1, 1, 2, 1]
    assert cases["cached"]["cached"] == 224 and cases["long"]["prompt"] == 512
    assert (cases["turn"]["prompt"], cases["turn"]["cached"]) == (296, 256)  # the cold case's whole prompt
    assert all(len(c["batch_s_runs"]) == 2 and c["ratio_to_gemm"] > 0 for c in cases.values())
    assert all(0 < c["host_s"] <= 1.01 * max(c["batch_s_runs"]) for c in cases.values())  # launched before the end
    assert "breakdown" not in cases["cold"]  # the profiled run records CUDA kernels only
    for c in cases.values():  # the host-profiled run: each case's first batch under cProfile
        rows = c["host_profile"]
        cum = [r[1] for r in rows[:HOST_FUNCS_TOP]]  # by cumulative time, then the own-time leaves it left out
        assert rows and cum == sorted(cum, reverse=True) and all(r[1] >= r[2] >= 0 and r[3] >= 1 for r in rows)
        assert len(rows) <= HOST_FUNCS_TOP * 3 // 2
        assert "run_batch" in {r[0].split(" ")[-1] for r in rows}  # the forward, inclusive of the plan's rest
    t = rep["ttft_s"]
    layers = load_model_config("tiny").num_layers  # every layer of the model, from the 1 measured
    assert layers > 1 and t["layers"] == layers and t["extrapolated"] and set(t) >= {"256", "512"}
    assert t["512"] == pytest.approx(sum(cases["long"]["chunk_s"]) * layers, abs=2e-3)
    assert rep["indexer_layers"] == [0]
    assert rep["copy_gbs"] > 0
    for c in cases.values():  # the floor: per chunk the longer of FLOPs at the GEMM rate and weights at the copy rate
        # (both ratios are of batch_s, which is rounded to 0.1 ms: 2 % of these CPU batches)
        assert c["floor_s"] > 0 and c["ratio_to_floor"] >= 0.98 * c["ratio_to_gemm"], c
        assert len(c["chunks"]) == c["batches"] and c["chunks"][0][0] == c["cached"]


def test_weight_floor_bytes_against_the_checkpoints_tensors():
    """The bytes a cp-1 batch reads at least once, against a count made here tensor by tensor from the checkpoint's
    shapes: every tensor but the embedding table and kv_b_proj, plus the W_UK / W_UV copies the layers read instead
    of kv_b_proj; of each MoE layer's experts, all with many tokens, exactly k with one token, the expected count
    under uniform routing between; no LM head for a batch that ends no request."""
    import math

    from cpkv.bench.engine import weight_floor_bytes
    from cpkv.memplan import tensor_bytes
    from cpkv.model.checkpoint import expected_shapes
    from cpkv.model.config import load_model_config

    for model, layers in (("tiny", None), ("glm5", 4)):
        cfg = load_model_config(model, layers)
        e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        copies = cfg.num_layers * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * 2
        for weights in ("bf16", "fp8"):
            size = {n: tensor_bytes(n, sh, weights, "bfloat16") for n, sh in expected_shapes(cfg).items()}
            experts = sum(b for n, b in size.items() if ".mlp.experts." in n)  # every expert of every MoE layer
            base = sum(b for n, b in size.items() if ".mlp.experts." not in n and n != "model.embed_tokens.weight"
                       and not n.endswith("kv_b_proj.weight")) + copies
            assert experts > 0
            assert weight_floor_bytes(cfg, weights, 10 ** 6) == pytest.approx(base + experts)
            assert weight_floor_bytes(cfg, weights, 1) == pytest.approx(base + experts * k / e)
            assert weight_floor_bytes(cfg, weights, 1, head=False) == pytest.approx(
                base - size["lm_head.weight"] + experts * k / e)
            t = 7  # between: the expected count of experts hit under uniform routing
            want = base + experts * (1 - (1 - k / e) ** t)
            assert math.isclose(weight_floor_bytes(cfg, weights, t), want, rel_tol=1e-12)


def test_no_chain_waits_for_every_batch(capsys):
    """Batches planned ahead are chained on the one before (the report counts them); ``--no-chain`` waits for
    each batch instead: none chained, the same cases."""
    from cpkv.cli import main

    base = ["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "1", "--prompt", "256", "--long",
            "512", "--chunk-size", "256", "--page-size", "16", "--runs", "1", "--turn", "40", "--no-profile", "--json"]
    reps = []
    for extra in ([], ["--no-chain"], ["--turn=0"]):
        assert main(base + extra) == 0
        reps.append(json.loads(capsys.readouterr().out))
    chained, plain, no_turn = reps
    assert chained["chained_batches"] >= 1 and plain["chained_batches"] == 0
    # the turn case waits only on the cold prompt: it keeps no other batch from being planned ahead and chained
    assert chained["chained_batches"] >= no_turn["chained_batches"] >= 1
    assert [c["case"] for c in chained["cases"]] == [c["case"] for c in plain["cases"]] == ["cold", "cached", "long",
                                                                                            "turn"]


def test_each_case_says_whether_its_batches_were_planned_ahead(capsys):
    """The turn (its prefix the cold prompt) is planned during the batch before it in the standard trace (after the
    long prompt's last chunk), so its time is from that batch's end; with no long prompt it runs right after the
    base batch, which plans nothing ahead (the cached request waits on base), so its time is from its own start, its
    plan included. The report says which: the two turns are different measurements. A long prompt's chunks after
    its first are planned ahead."""
    from cpkv.cli import main

    base = ["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "1", "--prompt", "256", "--chunk-size",
            "256", "--page-size", "16", "--runs", "1", "--turn", "40", "--no-profile", "--json"]
    got = {}
    for long in ("512", "0"):
        assert main(base + ["--long", long]) == 0
        got[long] = {c["case"]: c for c in json.loads(capsys.readouterr().out)["cases"]}
    assert got["512"]["turn"]["planned_ahead"] == [True] and got["0"]["turn"]["planned_ahead"] == [False]
    assert got["512"]["long"]["planned_ahead"] == [False, True]
    assert got["0"]["cold"]["planned_ahead"] == got["512"]["cold"]["planned_ahead"] == [False]


def test_idle_stretches_name_the_kernels_around_them():
    from cpkv.bench.breakdown import idle_between

    k = [("b", 2000, 4000), ("a", 0, 1000), ("c", 4100, 5000), ("d", 4200, 4500), ("e", 5600, 6000)]
    out = idle_between(k, top=2)
    assert out["top"] == [(1.0, 1.0, "a", "b"), (5.0, 0.6, "c", "e")]
    assert out["over_0.5_ms"] == 2 and out["over_0.5_ms_total"] == 1.6


def test_idle_gaps_from_the_batch_start():
    from cpkv.bench.breakdown import idle_gaps

    k = [("a", 2000, 3000), ("b", 2500, 4000), ("c", 4100, 5000), ("d", 9000, 9500)]
    assert idle_gaps(k) == [(5.0, 4.0), (0.0, 2.0), (4.0, 0.1)]


def test_ttft_weights_dense_and_moe_layers_by_their_own_times():
    """4 layers measured (3 dense + 1 MoE) = 1.0 s, the 3 dense layers alone = 0.6 s: per dense layer 0.2 s,
    per MoE layer 0.4 s; a 78-layer model with 3 dense layers -> 3 x 0.2 + 75 x 0.4 = 30.6 s (scaling the
    4 layers by 78 / 4 would say 19.5 s)."""
    from cpkv.bench.engine import ttft

    rows = {"cold": {"prompt": 32768, "batch_s": 1.0},
            "long": {"prompt": 65536, "chunk_s": [1.0, 2.0]}}
    dense = {"cold": {"prompt": 32768, "batch_s": 0.6}, "long": {"prompt": 65536, "chunk_s": [0.6, 1.0]}}
    t = ttft(rows, 4, 78, dense, (3, 3))
    assert t["32768"] == pytest.approx(30.6) and t["per_layer_s"] == {"dense": 0.2, "moe": 0.4, "dense_layers": 3,
                                                                       "moe_layers": 75}
    assert t["65536"] == pytest.approx(30.6 + (1.0 / 3 * 3 + 1.0 * 75))
    assert ttft(rows, 4, 78)["32768"] == pytest.approx(19.5)


def test_weights_modes_and_dense_split():
    from cpkv.bench.engine import dense_split, weights_modes
    from cpkv.errors import ConfigError
    from cpkv.model.config import load_model_config

    assert weights_modes("fp8,bf16") == ["fp8", "bf16"] and weights_modes("auto") == ["auto"]
    for bad in ("fp4", "fp8,fp8", ""):
        with pytest.raises(ConfigError, match="--weights"):
            weights_modes(bad)
    assert dense_split(load_model_config("glm5", 4)) == 3
    assert dense_split(load_model_config("glm5", 3)) is None and dense_split(load_model_config("tiny", 1)) is None


@pytest.mark.slow
def test_bench_engine_trace_dir_writes_each_batch_timeline(tmp_path, capsys):
    """``--trace-dir``: one more profiled run whose batches land as gzipped Chrome traces with the Python
    frames of the plan and the forward (on the CPU: host ops alone)."""
    import gzip

    from cpkv.cli import main

    rc = main(["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "1", "--prompt", "128",
               "--long", "0", "--turn", "0", "--chunk-size", "128", "--page-size", "16", "--runs", "1",
               "--no-profile", "--trace-dir", str(tmp_path), "--json"])
    assert rc == 0
    json.loads(capsys.readouterr().out)
    files = sorted((tmp_path / "auto").glob("rank0_batch*.json.gz"))
    assert len(files) >= 2  # the cold and the cached batch at least
    events = json.load(gzip.open(files[-1]))["traceEvents"]
    names = {e.get("name", "") for e in events if e.get("cat") == "python_function"}
    assert any(n.endswith(": run_batch") for n in names) and any("rank_plan" in n for n in names)


def test_trace_flags_are_checked_before_any_rank_starts(tmp_path, capsys):
    """``--trace-plain`` without ``--trace-dir``, and a ``--trace-dir`` that cannot be made: one error line naming
    the flag, exit 2, nothing started (a file where the folder should be)."""
    from cpkv.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    base = ["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "1", "--prompt", "128", "--long", "0",
            "--chunk-size", "128", "--page-size", "16", "--runs", "1", "--no-profile"]
    for extra, flag in ((["--trace-plain"], "--trace-plain"), (["--trace-dir", str(blocker / "sub")], "--trace-dir")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("cpkv bench engine: error:") and flag in err[0], err
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("flag", ["--marks", "--mark-clocks"])
def test_marks_off_cuda_are_one_error_before_any_rank_starts(flag, capsys):
    from cpkv.cli import main

    rc = main(["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "1", "--prompt", "128",
               "--long", "0", "--page-size", "16", "--runs", "1", "--no-profile", flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"cpkv bench engine: error: {flag}: expected --device cuda")


def test_the_text_report_names_the_host_bound_start(capsys):
    """The text report prints a case's marks summary when it has one."""
    from cpkv.bench.engine import _print_mode

    row = {"case": "long", "prompt": 512, "cached": 0, "batches": 2, "batch_s": 0.5, "batch_s_runs": [0.5],
           "prompt_tokens_per_s": 1.0, "tflops": 1.0, "ratio_to_gemm": 0.5, "spread": 0.0,
           "marks": {"gpu_waits_for_host_until_ms": 2.5, "sm_mhz_median": 1400, "chunk_start_idle_ms": [0.004]}}
    _print_mode({"cases": [row], "ttft_s": {"layers": 4, "layers_measured": 4, "extrapolated": False,
                                             "weighting": "measured"}})
    out = capsys.readouterr().out
    assert "waits for the host until 2.5 ms" in out and "1400 MHz" in out and "[0.004]" in out


def test_the_text_report_prints_the_breakdown_with_both_walls(capsys):
    """A case's breakdown prints each part with its share of the profiled wall, and the profiled and timed walls
    on their own rows."""
    from cpkv.bench.engine import _print_mode

    bd = parts([([("x_gemm", 0, 3000), ("_sparse_mla_ws", 3000, 3500), ("cat", 4000, 5000)], 0.0052)])
    row = {"case": "cached", "prompt": 512, "cached": 448, "batches": 1, "batch_s": 0.0052, "batch_s_runs": [0.0052],
           "prompt_tokens_per_s": 1.0, "tflops": 1.0, "ratio_to_gemm": 0.5, "spread": 0.0, "breakdown": bd}
    _print_mode({"cases": [row], "ttft_s": {"layers": 4, "layers_measured": 4, "extrapolated": False,
                                             "weighting": "measured"}})
    out = capsys.readouterr().out
    assert "3.00 (60.0%)" in out and "0.50 (10.0%)" in out  # GEMM, then the host gap: 0.5 ms idle of 5 profiled
    assert "4.50 / 5.00" in out and "5.20" in out  # busy / profiled wall, then the timed wall


@pytest.mark.slow
def test_bench_engine_at_depth_beside_its_extrapolation(capsys):
    """``--extrapolate-from K``: the same cases measured at ``--layers`` and, in the same rank processes, at K layers
    extrapolated to that depth; each TTFT beside the other with the difference; load time reported."""
    from cpkv.cli import main

    rc = main(["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "3", "--experts", "8",
               "--extrapolate-from", "2", "--prompt", "256", "--long", "512", "--chunk-size", "256", "--page-size",
               "16", "--runs", "1", "--no-profile", "--turn", "40", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    ex = rep["extrapolation"]
    assert ex["from_layers"] == 2 and set(ex) >= {"256", "512"}
    cases = {c["case"]: c for c in rep["cases"]}
    assert ex["256"]["measured_s"] == pytest.approx(cases["cold"]["batch_s"], abs=2e-3)
    for k in ("256", "512"):
        v = ex[k]
        assert v["extrapolated_s"] > 0 and v["difference"] == pytest.approx(v["measured_s"] / v["extrapolated_s"] - 1,
                                                                            abs=0.02)
    assert rep["skipped"] == [] and rep["load_s"] > 0


def test_extrapolating_from_as_many_layers_is_refused(capsys):
    from cpkv.cli import main

    assert main(["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "2", "--extrapolate-from", "2"]) == 2
    assert "--extrapolate-from: expected fewer layers than --layers 2, got 2" in capsys.readouterr().err


def test_cases_that_do_not_fit_are_skipped_with_a_reason(monkeypatch):
    from cpkv.bench import engine as bench
    from cpkv.cli import plan_cmd
    from cpkv.engine.config import EngineConfig

    trace = bench.bench_trace(256, 224, 4096, 40)
    cfg = EngineConfig(model="tiny", cp=1, page_size=16, chunk_size=256, max_requests=1,
                       pages_per_rank=(2 * 256 + 4096 + 40) // 16 + 32)
    from cpkv.memplan import plan_memory
    full = plan_memory(plan_cmd.run_setup(cfg, cfg.model_config(), 0)).total
    monkeypatch.setattr(plan_cmd, "rank_budget", lambda c, torchrun=False: (full - 1, 1, "one GPU"))
    got_cfg, got, skipped = bench.fit_cases(cfg, cfg.model_config(), trace)
    assert [r.id for r in got] == ["cold", "base", "hit", "turn"]
    assert [s["case"] for s in skipped] == ["long"] and "per rank" in skipped[0]["reason"]
    assert got_cfg.pages_per_rank < cfg.pages_per_rank
