"""``cpkv bench moe`` off the GPU: the expert loads it times, and its one-line refusal without CUDA."""
from __future__ import annotations

import pytest
import torch

from cpkv.bench.moe import expert_counts


@pytest.mark.parametrize("experts,tokens", [(32, 1024), (8, 3), (2, 100)])
def test_expert_loads(experts, tokens):
    even, ragged = expert_counts("even", experts, tokens), expert_counts("ragged", experts, tokens)
    assert even == [tokens] * experts
    assert len(ragged) == experts and sum(ragged) == experts * tokens and min(ragged) == 0
    assert ragged == expert_counts("ragged", experts, tokens)  # seeded


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_moe_without_cuda_is_one_line(capsys):
    from cpkv.cli import main

    assert main(["bench", "moe", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cpkv bench moe: error:")
    assert main(["bench", "moe", "--loads", "skewed"]) == 2
