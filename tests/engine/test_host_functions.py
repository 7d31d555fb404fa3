"""``host_functions``: a cProfile'd batch's functions by cumulative time, then the heaviest by own time that the
cumulative cut left out (leaf work such as launchers)."""
from __future__ import annotations

import cProfile

from cpkv.engine.instruments import host_functions


def _leaf(n: int) -> int:
    return sum(i * i for i in range(n))


def _wrapper(k: int) -> int:
    return sum(_leaf(2000) for _ in range(k))


def test_cumulative_first_then_own_time_leaves():
    prof = cProfile.Profile()
    prof.enable()
    _wrapper(20)
    prof.disable()
    rows = host_functions(prof, top=2)
    names = [r[0] for r in rows]
    cum = [r[1] for r in rows[:2]]
    assert cum == sorted(cum, reverse=True)  # the cut by cumulative time, descending
    assert any("_wrapper" in n for n in names[:2])
    own_top = max(rows, key=lambda r: r[2])
    assert all(len(r) == 4 and r[3] >= 1 for r in rows) and own_top[2] > 0
    assert len(rows) == len(set(names)) <= 3  # at most top // 2 = 1 own-time row added, no repeats
