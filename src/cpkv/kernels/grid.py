"""Launch geometry shared by the kernels: CUDA grid limits and flat (1-D) grids for any token count.

CUDA caps grid dimensions y and z at 65,535 programs and x at 2^31 - 1. A kernel whose program count
grows with the prompt (one program per query token, per token group, per key span) therefore puts all
of it in grid x: the launch is ``(outer * inner,)`` and the kernel recovers its coordinates as

    pid = program_id(0);   inner_id = pid % inner;   outer_id = pid // inner

so consecutive programs walk the inner coordinate first, the order a 2-D grid ``(inner, outer)`` would
give. Pure Python (no torch, no Triton): the launchers call it and the CPU tests check it for any size.
"""
from __future__ import annotations

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65_535


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for a >= 0, b > 0."""
    return -(-a // b)


def flat_grid(inner: int, outer: int) -> tuple[int]:
    """(inner * outer,): a 1-D grid of ``outer`` rows of ``inner`` programs (module docstring).

    ValueError when either count is negative or the product exceeds grid x's 2^31 - 1 programs."""
    if inner < 0 or outer < 0:
        raise ValueError(f"grid counts must be >= 0, got inner={inner}, outer={outer}")
    n = inner * outer
    if n > MAX_GRID_X:
        raise ValueError(f"{inner} x {outer} = {n} programs: more than CUDA's {MAX_GRID_X} in grid x")
    return (n,)


def check_grid(grid: tuple[int, ...]) -> tuple[int, ...]:
    """``grid`` itself when CUDA accepts it (x <= 2^31 - 1, y and z <= 65,535, all >= 0), else ValueError."""
    limits = (MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ)
    if not 1 <= len(grid) <= 3 or any(g < 0 or g > lim for g, lim in zip(grid, limits)):
        raise ValueError(f"grid {grid}: CUDA allows x <= {MAX_GRID_X}, y and z <= {MAX_GRID_YZ}")
    return grid


def sparse_mla_grid(tokens: int, heads: int, block_h: int) -> tuple[int]:
    """Sparse MLA: one program per (query token, block of ``block_h`` heads), head blocks fastest."""
    return check_grid(flat_grid(cdiv(heads, block_h), tokens))


def logits_grid(n_cols: int, tokens: int, span_cols: int, rows: int) -> tuple[int]:
    """MQA logits: one program per (key span of ``span_cols`` columns, group of ``rows`` tokens), spans
    fastest."""
    return check_grid(flat_grid(cdiv(n_cols, span_cols), cdiv(tokens, rows)))
