"""`cpkv bench attention` host side: the --peer options' checks and the output comparison (no GPU needed)."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from cpkv.bench.attention import PEER_SHAPES, _compare_outputs, _shape_list
from cpkv.cli import main


def _call(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    return code, capsys.readouterr().err


def test_shape_list_parses_and_refuses() -> None:
    assert _shape_list("4096:8192:128, 16384:65536:64") == [(4096, 8192, 128), (16384, 65536, 64)]
    for bad in ("4096:8192", "a:b:c", "0:10:64", ""):
        with pytest.raises(Exception, match="S_Q:S_KV:H"):
            _shape_list(bad)


def test_default_peer_shapes_are_flashmlas_and_glm5s() -> None:
    assert {h for _, _, h in PEER_SHAPES} == {128, 64}
    assert all(s_kv >= 2048 for _, s_kv, _ in PEER_SHAPES)


@pytest.mark.parametrize("argv,needle", [
    (["--peer-shapes", "4096:8192"], "--peer-shapes: expected S_Q:S_KV:H"),
    (["--peer", "nope"], "--peer: invalid choice"),
    (["--peer", "flashmla", "--peer-shapes", "64:100:64"], "expected S_KV >= --topk (2048)"),
])
def test_peer_usage_errors(argv, needle, capsys) -> None:
    code, err = _call(["bench", "attention", *argv], capsys)
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("flash_mla") is not None, reason="flash_mla is installed here")
def test_missing_flashmla_is_a_one_line_error(capsys) -> None:
    code, err = _call(["bench", "attention", "--peer", "flashmla", "--json"], capsys)
    assert code == 2 and "expected the flash_mla package" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_compare_outputs_measures_differences() -> None:
    g = torch.Generator().manual_seed(0)
    out = torch.randn(8, 4, 16, generator=g).to(torch.bfloat16)
    lse = torch.randn(8, 4, generator=g)
    lse[3, 1] = math.inf
    same = _compare_outputs((out, None, lse), (out.clone(), lse.clone()))
    assert same == {"out_cos_diff": 0.0, "out_max_diff_rel": 0.0, "lse_max_diff": 0.0, "lse_inf_equal": True}
    lse2 = lse.clone()
    lse2[0, 0] += 0.25
    lse2[5, 2] = math.inf
    off = _compare_outputs((out, None, lse), ((out.float() * 1.01).to(torch.bfloat16), lse2))
    assert off["out_cos_diff"] > 0 and 0.005 < off["out_max_diff_rel"] < 0.02
    assert off["lse_max_diff"] == pytest.approx(0.25) and off["lse_inf_equal"] is False


def test_rel_err_sampled_reads_start_middle_and_end_rows() -> None:
    from cpkv.attention import sparse_mla_ref
    from cpkv.bench.attention import _rel_err_sampled

    g = torch.Generator().manual_seed(1)
    q = torch.randn(20, 4, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(50, 576, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(50, generator=g)[:16] for _ in range(20)]).to(torch.int32)
    inp = {"q": q, "kv": kv, "idx": idx, "scale": 0.05}
    out, _ = sparse_mla_ref(q, kv, idx, 0.05, 512, dtype=torch.float64)
    assert _rel_err_sampled(inp, out) < 1e-12
    for row, hit in ((2, True), (10, True), (19, True), (6, False), (15, False)):
        bad = out.clone()
        bad[row] *= 2
        assert (_rel_err_sampled(inp, bad) > 0.1) is hit, row


@pytest.mark.parametrize("argv,needle", [
    (["--pool-rows", "100"], "--pool-rows 100: expected a multiple of 64"),
    (["--pool-rows", "64", "--topk", "200"], "expected at most --pools x --pool-rows (128)"),
    (["--batches", "0"], "--batches: expected comma-separated integers"),
    (["--pools", "0"], "--pools: expected an integer in 1..64"),
])
def test_decode_usage_errors(argv, needle, capsys) -> None:
    code, err = _call(["bench", "attention", "--decode", *argv], capsys)
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on CPU machines")
def test_decode_on_a_cpu_machine_is_one_line(capsys) -> None:
    code, err = _call(["bench", "attention", "--decode", "--peer", "flashmla", "--json"], capsys)
    assert code == 2 and "--decode needs a CUDA device" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_decode_inputs_select_distinct_rows_across_the_pools() -> None:
    from cpkv.attention.ref import GLM5_TOKEN
    from cpkv.bench.attention_decode import _inputs

    inp = _inputs(3, 4, 40, 2, 64, device="cpu")
    owner, row, flat = inp["owner"].long(), inp["row"].long(), inp["flat"].long()
    valid = row >= 0
    assert torch.equal(flat, torch.where(valid, owner * 64 + row, -1)) and 0 < int(valid.sum()) < 120
    assert all(len(set(f[f >= 0].tolist())) == int((f >= 0).sum()) for f in flat)
    assert [p.data_ptr() for p in inp["pools"]] == inp["bases"].tolist() == [
        inp["buf"].data_ptr(), inp["buf"].data_ptr() + 64 * GLM5_TOKEN.row_bytes]


def test_decode_compare_reshapes_the_peers_output() -> None:
    from cpkv.bench.attention_decode import _compare

    g = torch.Generator().manual_seed(2)
    out, lse = torch.randn(2, 4, 512, generator=g).to(torch.bfloat16), torch.randn(2, 4, generator=g)
    same = _compare((out[:, None], lse[:, :, None]), (out, lse))
    assert same["out_cos_diff"] == 0.0 and same["lse_max_diff"] == 0.0


@pytest.mark.parametrize("b,splits", [(1, 32), (8, 16), (32, 5)])
def test_decode_sweep_starts_with_the_first_kernel_and_the_default(b, splits) -> None:
    from cpkv.bench.attention_decode import first_kernel, sweep_configs
    from cpkv.kernels.sparse_mla import decode as kernel

    first = first_kernel(b, 64, 2048, 132)
    assert first.tag() == f"h64 k64 w8 s2 {splits} chained c512"  # its launch and its plan's splits
    configs = sweep_configs(b, 64, 2048, 132)
    assert configs[:2] == [first, kernel.default_config(64, b)]
    assert len({c.tag() for c in configs}) == len(configs) >= 12
    assert all(kernel.check_config(c, 512) for c in configs)
    assert all(c.block_h <= 16 for c in sweep_configs(b, 16, 2048, 132)[1:])  # no block above the default's


_SWEEP = r'''
import sys

from elem_cases import patch_interpreter_bf16_dot
from fused_cases import patch_interpreter_index, patch_interpreter_rounding

patch_interpreter_index()
patch_interpreter_bf16_dot()
patch_interpreter_rounding()

from cpkv.bench import attention_decode as ad

ad.do_bench_ms = lambda fn, *a, **k: (fn(), 0.5)[1]  # no CUDA timer here: each call runs once
inp = ad._inputs(2, 16, 40, 2, 64, device="cpu")
rows = ad._sweep(inp, 1000.0, 1)
bad = [r for r in rows if "error" in r or r["rel_err"] > 1e-2 or r["first_over"] != 1.0]
assert len(rows) >= 10 and rows[0]["config"].endswith("chained c512") and not bad, (rows, bad)
assert [r["role"] for r in rows[:3]] == ["first", "default", ""]
ad.report({"device": "cpu", "copy_gbs": 1000.0, "heads": 16, "topk": 40, "pools": 2, "pool_rows": 64,
           "peer": None, "sweep": rows, "cases": []}, as_json=False)
print("ok", len(rows))
'''


@pytest.mark.triton
def test_decode_sweep_runs_every_shape_in_the_interpreter() -> None:
    import textwrap

    from interpreted import run_interpreted

    res = run_interpreted(["-c", textwrap.dedent(_SWEEP)])
    assert res.returncode == 0 and "ok" in res.stdout and "first_over" in res.stdout, res.stdout[-3000:] + \
        res.stderr[-3000:]
