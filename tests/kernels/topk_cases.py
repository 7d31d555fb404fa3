"""Cases of the Triton top-k (the stream kernel and the split path, ``cpkv.kernels.topk``), run by Triton's
interpreter on CPU tensors (not collected by pytest: ``test_topk_interpret.py`` runs each case in a subprocess with
TRITON_INTERPRET=1, set before Triton loads).

    python tests/kernels/topk_cases.py <case>      exit 0 when every check holds

Every case compares ``topk_triton`` at forced splits (1: the stream kernel; 2..64: the split path) with
``topk_ref`` exactly, and says through the split path's compact launch which rows took the union select (k <= m <= C
candidates) and which the fallback, so that a case meant for one path cannot silently test the other.
"""
from __future__ import annotations

import sys

import torch
from fused_cases import patch_interpreter_index

patch_interpreter_index()  # loop bounds from kernel arguments

from cpkv.indexer.topk import _kernel_ready  # noqa: E402
from cpkv.kernels.topk import triton as tt  # noqa: E402
from cpkv.kernels.topk.ref import topk_ref  # noqa: E402

SPLITS = (1, 2, 8, 64)
INF = float("inf")
g = torch.Generator().manual_seed(0)


def check(x, lo, hi, k, splits=SPLITS, base=None) -> None:
    """topk_triton at each forced split count == topk_ref (+ base, -1 kept) exactly, a poisoned out overwritten."""
    want = topk_ref(x, lo, hi, k)
    x = _kernel_ready(x)  # rows 16-byte aligned and readable to a multiple of 4 columns, as topk_into passes them
    if base is not None:
        want = torch.where(want >= 0, want + base[:, None], -1).to(torch.int32)
    for s in splits:
        out = torch.full((x.shape[0], k), -7, dtype=torch.int32)
        tt.topk_triton(x, lo, hi, k, out, config=tt.TopkConfig(splits=s), base=base)
        bad = (out != want).any(1).nonzero().flatten().tolist()
        assert not bad, f"splits={s} k={k}: rows {bad} differ, first: {out[bad[0]][:8]} vs {want[bad[0]][:8]}"


def union_rows(x, lo, hi, k, splits) -> list[bool]:
    """Per row with more than k keys: True where the split path's candidates fit the union select (k <= m <= C)."""
    meta, _ = tt.split_compact(_kernel_ready(x), lo, hi, k, splits, tt.TopkConfig(splits=splits))
    m = meta[:, :splits].sum(1)
    n = (hi - lo).clamp(min=0)
    c = tt.candidate_slots(k)
    return [bool(k <= int(m[i]) <= c) for i in range(x.shape[0]) if int(n[i]) > k]


def bounds(*pairs) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = zip(*pairs)
    return torch.tensor(lo, dtype=torch.int32), torch.tensor(hi, dtype=torch.int32)


def case_random() -> None:
    """Random rows longer than the sample (n > C) and within the slots (k < n <= C), k small and GLM-5's 2048."""
    for k in (16, 100, 2048):
        x = torch.randn(3, 20000, generator=g)
        lo, hi = bounds((0, 20000), (7, 19001), (3, 3 + tt.candidate_slots(k) - 5))
        check(x, lo, hi, k)
        assert all(union_rows(x, lo, hi, k, 8)), "random rows should take the union select"


def case_ragged() -> None:
    """Ragged lo / hi: empty and inverted ranges, n = 1, k, k + 1, unaligned starts, a row ending at N."""
    k, N = 64, 9001
    x = torch.randn(9, N, generator=g)
    lo, hi = bounds((5, 5), (9, 3), (1, 2), (10, 10 + k), (11, 12 + k), (1, 4099), (2, 4101), (3, N), (0, N))
    check(x, lo, hi, k, base=None)
    check(x, lo, hi, k, splits=(1, 4, 64), base=torch.arange(9, dtype=torch.int32) * 1000 + 5)


def case_short() -> None:
    """Every row n <= k: 0..n-1 then -1, whatever the logits (NaN and inf included)."""
    x = torch.randn(4, 300, generator=g)
    x[0, :5] = float("nan")
    x[1, :] = INF
    lo, hi = bounds((0, 0), (3, 259), (0, 300), (10, 20))
    check(x, lo, hi, 300)


def case_ties() -> None:
    """Few levels (every row a sea of equal keys: the samples miss, the fallback decides), -0.0 with +0.0."""
    for levels in (1, 3, 50):
        x = torch.randint(0, levels, (3, 12000), generator=g).float()
        lo, hi = bounds((0, 12000), (5, 11000), (100, 4000))
        check(x, lo, hi, 256, splits=(1, 8))
    x = torch.randn(2, 9000, generator=g)
    x[:, ::3] = 0.0
    x[:, 1::3] = -0.0
    check(x, *bounds((0, 9000), (1, 8999)), 2048, splits=(1, 8))


def case_inf_tails() -> None:
    """Decode rows: -inf past each context. hi = ctx (the decode step's bounds) and hi = N (the -inf tail inside the
    range: a context shorter than k picks the tail's first -inf keys, toward the lower index)."""
    N, k = 16384, 2048
    ctx = torch.tensor([16384, 9000, 4500, 2000, 1000, 5000])
    x = torch.randn(len(ctx), N, generator=g)
    x[torch.arange(N)[None, :] >= ctx[:, None]] = -INF
    lo = torch.zeros(len(ctx), dtype=torch.int32)
    check(x, lo, ctx.int(), k)
    assert all(union_rows(x, lo, ctx.int(), k, 64)), "decode rows up to their context should take the union select"
    check(x[:4], lo[:4], torch.full((4,), N, dtype=torch.int32), k, splits=(1, 16))


def case_skewed() -> None:
    """Every candidate in one segment (increasing / decreasing rows, a recency bias): the union select still."""
    n, k = 30000, 2048
    x = torch.arange(n, dtype=torch.float32).repeat(3, 1)
    x[1] = x[1].flip(0)
    x[2] = torch.randn(n, generator=g) + torch.linspace(0, 6, n)
    lo, hi = bounds((0, n), (0, n), (0, n))
    check(x, lo, hi, k, splits=(1, 8, 64))
    assert all(union_rows(x, lo, hi, k, 64)), "a skewed row should take the union select"


def case_misses() -> None:
    """The sample misses (m > C: big keys off the sampled runs; m < k: big keys only on them): the merge's fallback
    (the stream kernel's retries) keeps the result exact."""
    n, k = 40000, 2048
    x = torch.randn(2, n, generator=g)
    s = torch.arange(tt.SAMPLE)
    sampled = torch.zeros(n, dtype=torch.bool)
    sampled[(s // 64) * n // (tt.SAMPLE // 64) + s % 64] = True
    off = (~sampled).nonzero().flatten()
    x[0, off[torch.randperm(len(off), generator=g)[:6000]]] += 50.0  # 6000 > C keys above every sampled key
    x[1, sampled] += 50.0  # the sample's rank-r key has only the sampled keys above it: m about r < k
    lo, hi = bounds((0, n), (0, n))
    check(x, lo, hi, k, splits=(1, 8, 64))
    assert not any(union_rows(x, lo, hi, k, 8)), "both rows should miss"


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    tt.sm_count = lambda device: 4  # a CPU tensor has no SM count; the forced splits do not read it
    CASES[sys.argv[1]]()
    print("ok", sys.argv[1])
