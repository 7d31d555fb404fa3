"""CPU tests of the index-row kernel and the MoE router kernel: each case of ``elem_cases.py`` under
Triton's interpreter (a subprocess with TRITON_INTERPRET=1; tolerances stated there), and both kernels
compiled offline for sm_90a (Triton ships ptxas: no GPU needed) without local-memory spills. Skipped without
Triton. The GPU runs are in test_elem_gpu.py; the timings in ``benchmarks/elem_kernels.py``.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from interpreted import run_interpreted
from offline_sm90 import compile_sm90, ptxas_and_sass
import torch

pytestmark = pytest.mark.triton  # skipped without Triton (tests/conftest.py)

HERE = Path(__file__).resolve().parent
CASES = re.findall(r"^def case_(\w+)\(", (HERE / "elem_cases.py").read_text(), re.M)


def test_every_case_is_found():
    assert {"index_rows_shapes", "router_scores", "route_dispatch"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_kernel_under_the_interpreter(case):
    run = run_interpreted([str(HERE / "elem_cases.py"), case])
    if run.returncode == 77:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, f"{case}: {run.stdout[-2000:]}{run.stderr[-4000:]}"
    assert f"{case}: ok" in run.stdout


def compile_index_rows(queries: bool = True):
    """The index-row kernel as ``index_rows`` launches it at GLM-5's query (keys: key) shapes: 32,768 tokens x 32
    heads of 128, RoPE 64 interleaved."""
    from cpkv.kernels.index_rows import triton as kern

    t, h, d = 32768, (32 if queries else 1), 128
    x = torch.empty(t * h, d, dtype=torch.bfloat16)
    cos = torch.empty(t, 32)
    fp8, out = torch.empty(t * h, d, dtype=torch.float8_e4m3fn), torch.empty(t * h)
    lw = torch.empty(d, dtype=torch.bfloat16)
    consts = {"D": d, "ROPE": 64, "INTERLEAVED": True, "NORM": not queries, "FOLD": queries, "BLOCK": kern.BLOCK_ROWS,
              "LOG_K": 4}
    args = (x, lw, lw, cos, cos, out, fp8, out, t * h, h, 1e-6, d ** -0.5, d, 32, 32, d, 1)
    return compile_sm90(kern._index_rows, args, consts, num_warps=kern.NUM_WARPS, num_stages=1,
                         enable_fp_fusion=False)


def compile_router(float32_gate: bool = False):
    """The router kernel at GLM-5's shapes: x [32768, 6144] bf16, gate [256, 6144]."""
    from cpkv.kernels.router import triton as kern

    bm, bn, bk, warps, stages = kern.launch_config(float32_gate)
    t, k, n = 32768, 6144, 256
    x = torch.empty(t, k, dtype=torch.bfloat16)
    gate = torch.empty(n, k, dtype=torch.float32 if float32_gate else torch.bfloat16)
    out = torch.empty(t, n)
    args = (x, gate, out, t, n, k, k, k, n)
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": float32_gate, "KS": k, "PARTIAL": False}
    return compile_sm90(kern._router_gemm, args, consts, num_warps=warps, num_stages=stages)


@pytest.mark.parametrize("queries", [True, False])
def test_index_rows_compiles_for_sm90_without_spills(queries, tmp_path):
    """Keys and queries (interleaved RoPE, D 128): no local-memory spills, no tensor-core instructions (the FWHT in
    registers); for queries (one row per thread) no shuffle and no shared memory either."""
    ck = compile_index_rows(queries)
    report, sass = ptxas_and_sass(ck, tmp_path)
    assert not re.search(r"\b(STL|LDL)\b", sass), report
    if queries:
        assert not re.search(r"\b(SHFL|LDS|STS)\b", sass) and ck.metadata.shared == 0
    assert not re.search(r"\b[HQ]?G?MMA\.\d", sass)  # (HFMA2.MMA: a register move, not a product)


@pytest.mark.parametrize("float32_gate", [False, True])
def test_router_compiles_for_sm90_without_spills(float32_gate, tmp_path):
    """The router kernel's config with a bf16 gate (one wgmma per K step) and a float32 gate (three):
    no local-memory spills; bf16 tensor-core products (no tf32)."""
    from cpkv.kernels.router import triton as kern

    ck = compile_router(float32_gate)
    assert ck.metadata.shared <= kern.SHARED_LIMIT  # (a float32 gate at 4 stages asked 278,528 B on the H200)
    report, sass = ptxas_and_sass(ck, tmp_path)
    assert not re.search(r"\b(STL|LDL)\b", sass), report
    assert re.search(r"HGMMA\.\w+\.F32\.BF16", sass) and "TF32" not in sass


def test_benchmark_script_runs_under_the_interpreter():
    """benchmarks/elem_kernels.py end to end on CPU tensors (8 tokens, hidden 256, Triton's interpreter): both
    kernels checked and timed once, all checks holding."""
    code = ("import sys; sys.path[:0] = [sys.argv[1]]; import elem_cases as c; "
            "c.patch_interpreter_rounding(); c.patch_interpreter_index(); c.patch_interpreter_bf16_dot(); "
            "import elem_kernels; sys.exit(elem_kernels.main(sys.argv[2:]))")
    run = run_interpreted(["-c", code, str(HERE.parents[1] / "benchmarks"), "--tokens", "8", "--hidden", "256",
                           "--device", "cpu", "--json"])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    import json

    report = json.loads(run.stdout)
    assert report["ok"] and report["index_rows"]["ok"] and report["index_rows"]["queries_ms"] > 0
    assert all(r["ok"] for r in report["router"])  # per gate dtype: the scores, then GLM-5's and DeepSeek's routes
    assert [r["gate"] for r in report["router"] if "ms" in r] == ["bfloat16", "float32"]
