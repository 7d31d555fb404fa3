"""The Triton top-k (stream kernel and split path) under Triton's interpreter on CPU tensors, bit for bit against
``topk_ref``: random rows, ragged and empty ranges with and without ``base``, rows of n <= k, ties (one level,
few levels, -0.0 with +0.0), decode rows with -inf tails, skewed rows whose candidates share one segment, and
sample misses both ways (the merge's fallback), each at forced split counts (``tests/kernels/topk_cases.py``; a
subprocess per case: the interpreter is chosen at import). Also the split count chosen from the shapes. Skipped
without Triton."""
from __future__ import annotations

import pytest
from interpreted import KERNEL_CASES, run_interpreted

pytestmark = pytest.mark.triton  # skipped without Triton (tests/conftest.py)

CASES = ("random", "ragged", "short", "ties", "inf_tails", "skewed", "misses")


@pytest.mark.parametrize("case", CASES)
def test_topk_equals_the_reference_in_the_interpreter(case):
    res = run_interpreted([str(KERNEL_CASES / "topk_cases.py"), case])
    assert res.returncode == 0 and res.stdout.strip() == f"ok {case}", res.stderr[-3000:]


@pytest.mark.parametrize("T,N,want", [(1, 32768, 32), (1, 131072, 64), (8, 32768, 32), (8, 131072, 64),
                                      (32, 32768, 16), (32, 131072, 16), (132, 65536, 4), (264, 65536, 2),
                                      (265, 65536, 1), (4096, 65536, 1), (1, 4096, 1), (1, 6000, 4)])
def test_splits_from_the_shapes(monkeypatch, T, N, want):
    """132 SMs (an H200): few rows split up to the program slots (4 per SM), 64 ways at most, >= 1024 keys a
    program; many rows (prefill) and rows within the candidate slots keep the stream kernel."""
    from cpkv.kernels.topk import triton as tt

    monkeypatch.setattr(tt, "sm_count", lambda device: 132)
    assert tt.splits_for(T, N, 2048, tt.DEFAULT_CONFIG, None) == want
    assert tt.splits_for(T, N, 2048, tt.TopkConfig(splits=1), None) == 1  # the stream kernel, asked for
    assert tt.splits_for(4096, N, 2048, tt.TopkConfig(splits=8), None) == 8


@pytest.mark.parametrize("splits", [0, 3, 128, -2])
def test_bad_split_count_is_named(splits):
    from cpkv.errors import ConfigError
    from cpkv.kernels.topk.triton import TopkConfig

    with pytest.raises(ConfigError, match="TopkConfig.splits"):
        TopkConfig(splits=splits)
