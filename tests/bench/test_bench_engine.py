"""``cpkv bench engine`` on the CPU (tiny model): cases, timed runs, TTFT; the breakdown's name rules and sums."""
from __future__ import annotations

import json

import pytest

from cpkv.bench.breakdown import PARTS, busy_us, classify, parts


@pytest.mark.parametrize("name, part", [
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "gemm"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8", "gemm"),
    ("mqa_logits_gluon_kernel", "indexer_logits"), ("topk_stream_kernel", "topk"),
    ("_sparse_mla_ws", "attention"), ("_sparse_mla_fwd", "attention"),
    ("_page_gather_pair", "compose"), ("_barrier", "compose"), ("_dequant", "quant"), ("_quant", "quant"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<4u>>", "elementwise"),
])
def test_kernel_names_map_to_parts(name, part):
    assert classify(name) == part


def test_parts_add_kernel_time_and_the_host_gap():
    assert busy_us([(0, 10), (5, 15), (20, 30)]) == 25
    out = parts([([("x_gemm", 0, 1000), ("cat", 500, 2000)], 0.004), ([("_barrier", 0, 500)], 0.001)])
    p = out["parts"]
    assert list(p) == list(PARTS)
    assert (p["gemm"]["ms"], p["elementwise"]["ms"], p["compose"]["ms"]) == (1.0, 1.5, 0.5)
    assert out["gpu_busy_ms"] == 2.5 and out["wall_ms"] == 5.0
    assert p["host_gap"] == {"ms": 2.5, "share": 0.5}
    assert out["top"][0] == ("cat", 1.5, "elementwise")


@pytest.mark.slow
def test_bench_engine_runs_every_case_on_cpu(capsys):
    from cpkv.cli import main
    from cpkv.model.config import load_model_config

    rc = main(["bench", "engine", "--device", "cpu", "--model", "tiny", "--layers", "1", "--prompt", "256",
               "--long", "512", "--chunk-size", "256", "--page-size", "16", "--runs", "2", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    cases = {c["case"]: c for c in rep["cases"]}
    assert [c for c in cases] == ["cold", "cached", "long"]
    assert (cases["cold"]["batches"], cases["cached"]["batches"], cases["long"]["batches"]) == (1, 1, 2)
    assert cases["cached"]["cached"] == 224 and cases["long"]["prompt"] == 512
    assert all(len(c["batch_s_runs"]) == 2 and c["ratio_to_gemm"] > 0 for c in cases.values())
    assert "breakdown" not in cases["cold"]  # the profiled run records CUDA kernels only
    t = rep["ttft_s"]
    layers = load_model_config("tiny").num_layers  # every layer of the model, from the 1 measured
    assert layers > 1 and t["layers"] == layers and t["extrapolated"] and set(t) >= {"256", "512"}
    assert t["512"] == pytest.approx(sum(cases["long"]["chunk_s"]) * layers, abs=2e-3)
    assert rep["indexer_layers"] == [0]


def test_idle_gaps_from_the_batch_start():
    from cpkv.bench.breakdown import idle_gaps

    k = [("a", 2000, 3000), ("b", 2500, 4000), ("c", 4100, 5000), ("d", 9000, 9500)]
    assert idle_gaps(k) == [(5.0, 4.0), (0.0, 2.0), (4.0, 0.1)]
