"""The sparse decode MLA kernel (``cpkv.kernels.sparse_mla.decode``) under Triton's interpreter on CPU tensors,
against ``sparse_decode_mla_ref`` in float64: two pools at different addresses, row formats with 16-byte rows
(GLM-5's 656 B), 4-byte rows (the tiny model's 196 B) and no rope; one split (the direct write), several (the
combine, one program a head or several a head), a split with no key, a generation with no key, K = 0, K = 1 and
K not a multiple of the tile, masked keys whose owner is out of range (never used), head counts that fill no
block (20 heads in blocks of 16 and of 64, 72 in blocks of 64), V3.2's 128 heads, value blocks, the first
kernel's address chain and the one that picks the base among the pools' (nine pools: gathered again), every
launch shape of the table (``DEFAULTS``) and of the bench's sweep, B = 0, ``out`` given. A subprocess: the
interpreter is chosen at import. Skipped without Triton.

Tolerance (bf16 operands, fp32 accumulation, bf16 P and output, as ``tests/attention/test_attention_gpu.py``):
||out - ref|| / ||ref|| <= 1e-2 and max |out - ref| <= 1e-2 max |ref| per generation; |lse - ref| <= 1e-3 +
1e-5 |ref|; a generation with no key exactly out 0, lse +inf. Planted faults (one key's row moved, one key's group
scale doubled, the pools swapped) must fail that check.
"""
from __future__ import annotations

import textwrap

import pytest
from interpreted import run_interpreted

pytestmark = pytest.mark.triton  # skipped without Triton (tests/conftest.py)

_INTERPRET = r'''
import dataclasses
import math
import sys

import torch
from elem_cases import patch_interpreter_bf16_dot
from fused_cases import patch_interpreter_index, patch_interpreter_rounding

patch_interpreter_index()  # loop bounds from kernel arguments
patch_interpreter_bf16_dot()  # bf16 dot operands widened to float32 (the interpreter multiplies their raw bits)
patch_interpreter_rounding()  # float32 -> bf16 rounds to nearest even, as the GPU does

from cpkv.bench.attention_decode import sweep_configs
from cpkv.config import RowFormat
from cpkv.kernels.sparse_mla import decode as dk
from cpkv.kernels.sparse_mla.ref import sparse_decode_mla_ref
from cpkv.kernels.token_kv.ref import quant_token_kv_ref, row_views

g = torch.Generator().manual_seed(0)


def close(out, lse, ref_out, ref_lse):
    """None when out / lse are within the tolerance of the module docstring, else what is wrong."""
    empty = torch.isinf(ref_lse)
    if not torch.equal(torch.isinf(lse), empty) or not bool((lse[empty] == math.inf).all()):
        return "rows with no key differ"
    if not bool((out[empty] == 0).all()) or bool(out.isnan().any()) or bool(lse.isnan().any()):
        return "an empty row is not 0, or a NaN"
    for b in range(out.shape[0]):
        o, r = out[b].double(), ref_out[b]
        if bool(torch.isinf(ref_lse[b]).all()):
            continue
        err, worst = float((o - r).norm() / r.norm()), float((o - r).abs().max() / r.abs().max())
        lerr = float(((lse[b].double() - ref_lse[b].double()).abs() - 1e-5 * ref_lse[b].double().abs()).max())
        if err > 1e-2 or worst > 1e-2 or lerr > 1e-3:
            return f"generation {b}: rel err {err:.3g}, max err {worst:.3g}, lse err {lerr:.3g}"
    return None


def case(fmt, h, b, k, pool_rows=(37, 53)):
    d = fmt.fp8_bytes + fmt.rope_dims
    pools = [quant_token_kv_ref(torch.randn(n, d, generator=g) * (1 + r), fmt) for r, n in enumerate(pool_rows)]
    owner = torch.randint(0, len(pools), (b, k), generator=g)
    row = torch.randint(0, min(pool_rows), (b, k), generator=g)
    if b > 1 and k > 1:
        row[0, ::3] = -1  # masked keys, their owner out of range: never read
        owner[0, ::3] = 7
        row[1, : k // 2] = -1  # the first split(s) with no key
        row[1, k // 2 + 3:] = -1  # generation 1: three keys (where the planted faults are seen)
    if b > 2:
        row[2] = -1  # no key at all
    q = torch.randn(b, h, d, generator=g).to(torch.bfloat16)
    return pools, owner, row.to(torch.int32), q, 1 / math.sqrt(d)


def run(pools, owner, row, q, scale, fmt, cfg, out=None):
    bases = torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64)
    return dk.sparse_decode_mla(q, bases, owner, row, scale, fmt.fp8_bytes, fmt, out, config=cfg)


FORMATS = {"glm5": (RowFormat(512, 4, 64), 16), "tiny": (RowFormat(128, 1, 32), 4),
           "norope": (RowFormat(128, 1, 0), 20)}  # 20 heads: two blocks of 16, one of 64
CONFIGS = [dk.DecodeConfig(16, 16, 4, 1), dk.DecodeConfig(16, 16, 4, 1, splits=1),
           dk.DecodeConfig(16, 32, 4, 1, splits=3), dk.DecodeConfig(16, 16, 4, 1, splits=64, scale_gather=True),
           dk.DecodeConfig(16, 16, 4, 1, splits=5, block_v=128, combine_d=128),
           dk.DecodeConfig(16, 16, 4, 1, chained=True), dk.DecodeConfig(16, 32, 4, 1, per_sm=2),
           None]  # None: the table's


def formats():
    """Every row format and config over small cases; ``out`` given; B = 0; planted faults."""
    checked = 0
    for name, (fmt, h) in FORMATS.items():
        for b, k in ((3, 100), (2, 1), (1, 33), (2, 0), (2, 300)):  # 300: 19 splits, two combine loads
            pools, owner, row, q, scale = case(fmt, h, b, k)
            want = sparse_decode_mla_ref(q, pools, owner, row, scale, fmt.fp8_bytes, fmt, dtype=torch.float64)
            for cfg in CONFIGS:
                out, lse = run(pools, owner, row, q, scale, fmt, cfg)
                bad = close(out, lse, *want)
                assert bad is None, (name, b, k, cfg and cfg.tag(), bad)
                checked += 1

    # out given: written in place; B = 0: nothing launched
    fmt, h = FORMATS["tiny"]
    pools, owner, row, q, scale = case(fmt, h, 3, 100)
    want = sparse_decode_mla_ref(q, pools, owner, row, scale, fmt.fp8_bytes, fmt, dtype=torch.float64)
    buf = torch.full((3, h, fmt.fp8_bytes), 7.0, dtype=torch.bfloat16)
    out, lse = run(pools, owner, row, q, scale, fmt, None, out=buf)
    assert out.data_ptr() == buf.data_ptr() and close(buf, lse, *want) is None
    out, lse = run(pools, owner[:0], row[:0], q[:0], scale, fmt, None)
    assert out.shape == (0, h, fmt.fp8_bytes) and lse.shape == (0, h)

    # planted faults, each in the kernel's inputs, checked against the true reference: all must be caught
    fmt, h = FORMATS["glm5"]
    pools, owner, row, q, scale = case(fmt, h, 3, 100)
    want = sparse_decode_mla_ref(q, pools, owner, row, scale, fmt.fp8_bytes, fmt, dtype=torch.float64)
    assert close(*run(pools, owner, row, q, scale, fmt, CONFIGS[0]), *want) is None
    moved = row.clone()
    j = 100 // 2 + 1
    moved[1, j] = (moved[1, j] + 1) % 37  # a wrong row
    scaled = [p.clone() for p in pools]
    o, r = int(owner[1, j]), int(row[1, j])
    row_views(scaled[o][r : r + 1], fmt)[1][0, 2] *= 2  # a wrong scale (group 2 of one selected row)
    faults = {"row": (pools, owner, moved), "scale": (scaled, owner, row), "owner": (pools, 1 - owner, row)}
    for fault, (fp, fo, fr) in faults.items():
        for cfg in CONFIGS[:2] + CONFIGS[4:]:
            assert close(*run(fp, fo, fr, q, scale, fmt, cfg), *want) is not None, f"planted fault not caught: {fault}"
    return checked


def launch_shapes():
    """GLM-5's and V3.2's head counts over every swept launch shape; nine pools."""
    checked = 0
    # GLM-5's rows at 64 heads (one block), 72 (a second block of 8) and V3.2's 128 (two blocks), odd B, K not a
    # multiple of the tile: every launch shape the bench sweeps at B 1 / 8 / 32 and 64 heads (their split counts
    # planned for 8 "SMs" here; warps and stages mean nothing to the interpreter), value blocks of 128 and 256
    fmt = FORMATS["glm5"][0]
    swept = {dataclasses.replace(c, num_warps=4, num_stages=1): c for bb in (1, 8, 32)
             for c in sweep_configs(bb, 64, 200, dk.INTERPRETER_SMS)}
    cases = [(64, 3, 200, list(swept.values())), (72, 3, 100, [None, dk.DecodeConfig(64, 32, 8, 5, block_v=128)]),
             (128, 3, 300, [None, dk.DecodeConfig(64, 32, 8, 5, block_v=256, splits=7)])]
    for h, b, k, configs in cases:
        pools, owner, row, q, scale = case(fmt, h, b, k)
        want = sparse_decode_mla_ref(q, pools, owner, row, scale, 512, fmt, dtype=torch.float64)
        for cfg in configs:
            bad = close(*run(pools, owner, row, q, scale, fmt, cfg), *want)
            assert bad is None, (h, b, k, cfg and cfg.tag(), bad)
            checked += 1

    # nine pools: more than MAX_SELECT, the base gathered by the owner
    pools, owner, row, q, scale = case(fmt, 16, 3, 100, pool_rows=tuple(range(37, 46)))
    assert len(pools) > dk.MAX_SELECT
    want = sparse_decode_mla_ref(q, pools, owner, row, scale, 512, fmt, dtype=torch.float64)
    for cfg in (None, CONFIGS[2]):
        assert close(*run(pools, owner, row, q, scale, fmt, cfg), *want) is None, ("nine pools", cfg and cfg.tag())
        checked += 1
    return checked


print("ok", globals()[sys.argv[1]]())
'''


@pytest.mark.parametrize("part", ["formats", "launch_shapes"])
def test_sparse_decode_equals_the_reference_in_the_interpreter(part):
    res = run_interpreted(["-c", textwrap.dedent(_INTERPRET), part])
    assert res.returncode == 0 and res.stdout.strip().startswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
