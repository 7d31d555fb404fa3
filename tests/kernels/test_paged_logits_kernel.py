"""The paged indexer logits kernel (cpkv.kernels.mqa_logits.paged) against paged_mqa_logits_ref.

Interpreter (CPU, skipped without Triton): the cases of ``paged_logits_cases.py``, each in a TRITON_INTERPRET=1
subprocess, at small shapes (H 4 / 8, D 32 / 64 / 128, B 2-3, two pools, P 16 / 32 / 64, contexts 0 / 5 / 37, L
50 / 64), held to the float32 bound derived there; planted faults (a wrong page, a wrong owner, a short context,
swapped bases) must fail it. GPU (skipped without CUDA and Triton): GLM-5 shapes (H 32, D 128, P 64, two pools,
B 1 and 32, contexts up to 32768), within 2e-3 of each row's largest |logit| (the existing logits tests' bound),
-inf positions exact; one CUDA graph capture replayed with other contexts and slots.
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
                  0, 32769, (26,), generator=torch.Generator().manual_seed(1))], 32768)}


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("name", sorted(GPU_SHAPES))
@pytest.mark.parametrize("cfg", [None, dict(block_s=128, span=2, num_warps=8), dict(block_s=64, span=1)])
def test_paged_logits_gpu_glm5(name, cfg):
    from cpkv.kernels.mqa_logits.config import PagedLogitsConfig

    B, ctx, L = GPU_SHAPES[name]
    t, pools, bases = _glm5(B, ctx, L)
    got = _run(t, pools, bases, L, PagedLogitsConfig(**cfg) if cfg else None)
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


@pytest.mark.cuda
@pytest.mark.triton
def test_paged_logits_gpu_graph_replay():
    """Captured once at B = 8, L = 8192; replayed after ctx and slot are rewritten in place."""
    from cpkv.indexer.paged import paged_logits

    B, L = 8, 8192
    t, pools, bases = _glm5(B, [8192] * B, L)
    out = torch.empty(B, L, device="cuda")
    args = (t["q"], t["weights"], pools, bases, t["owner_tab"], t["page_tab"], t["slot"], t["ctx"], 64, out)
    paged_logits(*args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_logits(*args)
    for ctx in ([8192] * B, [0, 1, 64, 65, 4000, 8191, 100, 7]):
        t["ctx"].copy_(torch.tensor(ctx))
        t["slot"].copy_(t["slot"].roll(1))
        out.fill_(7.0)
        graph.replay()
        err = mismatch(out, reference(t, pools, 64, L), row_eps=GPU_EPS)
        assert err is None, f"ctx {ctx}: {err}"
