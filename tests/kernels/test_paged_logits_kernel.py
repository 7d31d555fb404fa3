"""The paged indexer logits kernels (cpkv.kernels.mqa_logits.paged: runs, the default, and keys) against
paged_mqa_logits_ref.

Interpreter (CPU, skipped without Triton): the cases of ``paged_logits_cases.py``, each in a TRITON_INTERPRET=1
subprocess, at small shapes (H 4 / 8 / 32, D 32 / 64 / 128, B 2-5, two or three pools, P 4 / 16 / 32 / 64 / 256,
contexts from 0 to L ending inside and at the edge of runs and tiles, L 50 / 64 / 200 / 300), both kernels, held
to the float32 bound derived there; planted faults (a wrong page, a wrong owner, a short context, swapped bases)
must fail both. GPU (skipped without CUDA and Triton): GLM-5 shapes (H 32, D 128, P 64, two pools; B 1, 8 and 32,
contexts up to 131072), within 2e-3 of each row's largest |logit| (the existing logits tests' bound), -inf
positions exact, each kernel and a few runs tile shapes; sync-free; CUDA graph captures (B 8 at 8K, B 32 at 32K)
replayed with other contexts and slots.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from interpreted import run_interpreted
from paged_logits_cases import make_inputs, mismatch, reference

HERE = Path(__file__).resolve().parent
CASES = re.findall(r"^def case_(\w+)\(", (HERE / "paged_logits_cases.py").read_text(), re.M)
GPU_EPS = 2e-3


def test_every_case_is_found():
    assert len(CASES) >= 3 and "planted_faults_fail" in CASES


@pytest.mark.triton
@pytest.mark.parametrize("case", CASES)
def test_paged_logits_under_the_interpreter(case):
    run = run_interpreted([str(HERE / "paged_logits_cases.py"), case])
    if run.returncode == 77:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, f"{case}: {run.stdout[-2000:]}{run.stderr[-4000:]}"
    assert f"{case}: ok" in run.stdout


def _glm5(B, ctx, L, seed=0):
    return make_inputs(B, 32, 128, 64, ctx, L, cp=2, seed=seed, device="cuda")


def _run(t, pools, bases, L, config=None):
    from cpkv.indexer.paged import paged_logits

    out = torch.full((t["q"].shape[0], L), 7.0, device="cuda")
    return paged_logits(t["q"], t["weights"], pools, bases, t["owner_tab"], t["page_tab"], t["slot"], t["ctx"], 64,
                        out, config=config)


GPU_SHAPES = {"b1_32k": (1, [32768], 32768), "b1_1000": (1, [1000], 1024),
              "b32_mixed": (32, [0, 1, 63, 64, 65, 32768] + [int(x) for x in torch.randint(
                  0, 32769, (26,), generator=torch.Generator().manual_seed(1))], 32768),
              "b8_128k": (8, [131072, 131071, 100000, 70001, 129, 64, 1, 0], 131072)}
GPU_CONFIGS = {"default": None, "keys": "KEYS_CONFIG", "runs_s256_w8": dict(block_s=256, num_warps=8),
               "runs_s64_x4_st3": dict(block_s=64, span=4, num_stages=3, maxnreg=None),
               "runs_s128_x2_w8": dict(block_s=128, span=2, num_warps=8)}


def _config(name):
    from cpkv.kernels.mqa_logits import paged
    from cpkv.kernels.mqa_logits.config import PagedLogitsConfig

    cfg = GPU_CONFIGS[name]
    return getattr(paged, cfg) if isinstance(cfg, str) else PagedLogitsConfig(**cfg) if cfg else None


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("name", sorted(GPU_SHAPES))
@pytest.mark.parametrize("cfg", sorted(GPU_CONFIGS))
def test_paged_logits_gpu_glm5(name, cfg):
    from sync_free import twice_sync_free

    B, ctx, L = GPU_SHAPES[name]
    t, pools, bases = _glm5(B, ctx, L)
    got = twice_sync_free(lambda: _run(t, pools, bases, L, _config(cfg)))
    err = mismatch(got, reference(t, pools, 64, L), row_eps=GPU_EPS)
    assert err is None, err


@pytest.mark.cuda
@pytest.mark.triton
def test_paged_logits_gpu_planted_fault_fails():
    t, pools, bases = _glm5(2, [4000, 9000], 9216)
    ref = reference(t, pools, 64, 9216)
    at = (int(t["slot"][1]), 100)
    t["page_tab"][at] = (t["page_tab"][at] + 1) % (pools[0].shape[0] // 64)  # another page of the same pool
    assert mismatch(_run(t, pools, bases, 9216), ref, row_eps=GPU_EPS) is not None


GRAPH_CASES = {"b8_8k": (8, 8192, [[8192] * 8, [0, 1, 64, 65, 4000, 8191, 100, 7]]),
               "b32_32k": (32, 32768, [[32768] * 32, [0, 1, 63, 64, 65, 127, 128, 129] + [32768 - 97 * i for i in
                                                                                            range(24)]])}


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
@pytest.mark.parametrize("cfg", ["default", "keys"])
def test_paged_logits_gpu_graph_replay(case, cfg):
    """Captured once with every context full; replayed after ctx and slot are rewritten in place."""
    from cpkv.indexer.paged import paged_logits

    B, L, contexts = GRAPH_CASES[case]
    t, pools, bases = _glm5(B, [L] * B, L)
    out = torch.empty(B, L, device="cuda")
    args = (t["q"], t["weights"], pools, bases, t["owner_tab"], t["page_tab"], t["slot"], t["ctx"], 64, out)
    paged_logits(*args, config=_config(cfg))  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_logits(*args, config=_config(cfg))
    for ctx in contexts:
        t["ctx"].copy_(torch.tensor(ctx))
        t["slot"].copy_(t["slot"].roll(1))
        out.fill_(7.0)
        graph.replay()
        err = mismatch(out, reference(t, pools, 64, L), row_eps=GPU_EPS)
        assert err is None, f"ctx {ctx}: {err}"
