"""``cpkv bench gemv`` off the GPU: the linears it times, its copies and byte counts, its sweep configs, its row
option, its one-line refusal without CUDA, and its assembly of a report run on the CPU (Triton's interpreter for
the GEMV, CUDA graphs and timings replaced by plain calls and fixed times)."""
from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
from interpreted import run_interpreted

from cpkv.bench import gemv as bench
from cpkv.config import PRESETS
from cpkv.errors import ConfigError


def test_glm5_decode_shapes():
    got = {(s.name, s.n, s.k) for s in bench.decode_shapes(PRESETS["glm5"])}
    assert got == {("q_a", 2048, 6144), ("kv_a", 576, 6144), ("wk", 128, 6144), ("qkv_a", 2752, 6144),
                   ("q_b", 16384, 2048), ("wq_b", 4096, 2048), ("o_proj", 6144, 16384), ("gate_up", 24576, 6144),
                   ("down", 6144, 12288), ("shared_gate_up", 4096, 6144), ("shared_down", 6144, 2048)}


def test_copies_read_past_the_cache_and_bytes_count_every_operand():
    l2 = 50 << 20
    assert bench.weight_copies(128 * 6144, l2) * 128 * 6144 >= bench.L2_READS * l2
    assert bench.weight_copies(24576 * 6144, l2) == 2  # a weight past the cache still alternates two copies
    # weight + its scales + activation + its scales + bf16 output
    assert bench.gemm_bytes(4, 256, 512) == 256 * 512 + 4 * 2 * 4 + 4 * 512 + 4 * 4 * 4 + 2 * 4 * 256


def test_sweep_changes_one_field_each():
    configs = bench.sweep_configs()
    default = configs.pop("default")
    fields = [f.name for f in dataclasses.fields(default)]
    for name, cfg in configs.items():
        assert sum(getattr(cfg, f) != getattr(default, f) for f in fields) == 1, name


@pytest.mark.parametrize("text", ["0", "65", "1,x", ""])
def test_rows_outside_the_kernel_are_refused(text):
    with pytest.raises(ConfigError, match="--rows: expected comma-separated row counts in 1..64"):
        bench._rows(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_gemv_without_cuda_is_one_line(capsys):
    from cpkv.cli import main

    assert main(["bench", "gemv", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cpkv bench gemv: error:")
    assert main(["bench", "gemv", "--rows", "128"]) == 2


_ASSEMBLY = r'''
import json, types
import torch
from fused_cases import patch_interpreter_index, patch_interpreter_rounding

patch_interpreter_rounding()
patch_interpreter_index()
from cpkv.bench import gemv as bench
from cpkv.kernels import platform
from cpkv.kernels.fp8_gemm.ref import fp8_linear_quant_ref
from cpkv.model import linear as lin

bench.DEVICE = "cpu"
torch.cuda.get_device_properties = lambda d: types.SimpleNamespace(L2_cache_size=1)
torch.cuda.synchronize = lambda: None
platform.sm_count = lambda x: 4
lin._scaled_mm = lambda x, w, ws: fp8_linear_quant_ref(x.q, x.s, w, ws).to(x.dtype)
bench._graph = lambda fn: (types.SimpleNamespace(replay=fn), fn())
bench.alternate = lambda fns, rounds: {name: 2e-6 * (i + 1) for i, name in enumerate(fns)}
cases = [bench.case_row(bench.Shape("t", 200, 512), m, 1000.0, 1, m == 3) for m in (1, 3)]
rep = {"model": "t", "device": "cpu", "copy_gbs": 1000.0, "cases": cases, "totals": bench.totals(cases, [1, 3])}
bench._print(rep, False)
bench._print(rep, True)
c = cases[1]
assert c["copies"] == 2 and c["cublas_us"] == 1.0 and c["gemv_gemm_us"] == 4.0 and c["gemv_vs_cublas"] == 0.5
assert c["max_err"] <= 1e-2, c["max_err"]
assert set(c["sweep_us"]) == set(bench.sweep_configs()) and c["sweep_best"] == "default"
assert rep["totals"][1] == {"m": 3, "cublas_us": 1.0, "gemv_us": 2.0, "cublas_gemm_us": 3.0, "gemv_gemm_us": 4.0,
                         "gemv_vs_cublas": 0.5, "gemm_gemv_vs_cublas": 0.75}
assert "sweep_us" not in cases[0]
print("ok")
'''


@pytest.mark.triton
def test_bench_assembly_runs_on_the_cpu():
    """The bench's functions over two weight copies, the GEMV's output within 1e-2 of the block-scaled reference
    (standing in for cuBLAS), rows, totals, the sweep's table and JSON built (fixed times: 2 µs per function in
    turn, over 2 copies)."""
    run = run_interpreted(["-c", textwrap.dedent(_ASSEMBLY)], timeout=900)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-3000:] + run.stderr[-3000:]
