"""Launch geometry (cpkv.kernels.grid): flat grids stay within CUDA's limits for any prompt length, and the
in-kernel split ``pid % inner, pid // inner`` visits every (inner, outer) pair once, inner fastest."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.kernels.grid import MAX_GRID_X, MAX_GRID_YZ, cdiv, check_grid, flat_grid, logits_grid, sparse_mla_grid


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(0, 1 << 21), heads=st.sampled_from([1, 16, 32, 64, 96, 128]),
       block_h=st.sampled_from([16, 32, 64]))
def test_sparse_mla_grid_is_one_dimensional_for_any_token_count(tokens: int, heads: int, block_h: int) -> None:
    grid = sparse_mla_grid(tokens, heads, block_h)
    assert len(grid) == 1 and grid[0] == tokens * cdiv(heads, block_h) <= MAX_GRID_X


@settings(max_examples=200, deadline=None)
@given(n_cols=st.integers(0, 1 << 21), tokens=st.integers(0, 1 << 20), span=st.sampled_from([1024, 4096, 192, 64]),
       rows=st.sampled_from([1, 2, 4, 8, 16]))
def test_logits_grid_covers_spans_and_token_groups(n_cols: int, tokens: int, span: int, rows: int) -> None:
    programs = cdiv(n_cols, span) * cdiv(tokens, rows)
    if programs > MAX_GRID_X:  # more programs than grid x holds (a logits block of >= 2^31 x span x rows floats)
        with pytest.raises(ValueError, match="grid x"):
            logits_grid(n_cols, tokens, span, rows)
        return
    assert logits_grid(n_cols, tokens, span, rows) == (programs,)


@pytest.mark.parametrize("inner,outer", [(1, 7), (3, 5), (2, 65_537), (33, 1)])
def test_flat_grid_split_visits_each_pair_once_inner_fastest(inner: int, outer: int) -> None:
    (n,) = flat_grid(inner, outer)
    pairs = [(pid % inner, pid // inner) for pid in range(n)]  # what the kernels compute from program_id(0)
    assert pairs == [(i, o) for o in range(outer) for i in range(inner)]


def test_million_token_prompts_fit_grid_x() -> None:
    assert sparse_mla_grid(1 << 20, 128, 64) == (1 << 21,)
    assert logits_grid(1 << 20, 1 << 20, 4096, 4) == (256 * (1 << 18),)
    assert logits_grid(4096, 1 << 20, 4096, 4) == (1 << 18,)


def test_limits_are_refused_with_the_counts() -> None:
    with pytest.raises(ValueError, match="grid x"):
        flat_grid(MAX_GRID_X, 2)
    with pytest.raises(ValueError, match=">= 0"):
        flat_grid(-1, 3)
    assert check_grid((5, MAX_GRID_YZ, MAX_GRID_YZ)) == (5, MAX_GRID_YZ, MAX_GRID_YZ)
    for bad in [(1, MAX_GRID_YZ + 1), (1, 1, MAX_GRID_YZ + 1), (MAX_GRID_X + 1,), (), (1, 1, 1, 1), (-1,)]:
        with pytest.raises(ValueError, match="CUDA allows"):
            check_grid(bad)
