"""CPU tests of the lightning indexer: references, quantisation, plan, chunked loop, dispatch."""
from __future__ import annotations

import argparse

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.errors import IndexerError
from cpkv.indexer import (
    IndexerPlan,
    dequantize_index_keys,
    dequantize_index_rows,
    index_topk,
    mqa_logits,
    mqa_logits_ref,
    quantize_index_keys,
    quantize_queries,
    topk,
    topk_ref,
    topk_to_slots,
)
from cpkv.indexer.plan import split_chunks

FP8 = torch.float8_e4m3fn


def _inputs(T: int, H: int, D: int, S: int, seed: int = 0, dtype=FP8):
    g = torch.Generator().manual_seed(seed)
    q, w = quantize_queries(torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g))
    rows = quantize_index_keys(torch.randn(S, D, generator=g) * 3)
    k, k_scale = dequantize_index_rows(rows)
    if dtype == torch.bfloat16:
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    ks = torch.randint(0, S // 2, (T,), generator=g, dtype=torch.int32)
    ke = (ks + torch.randint(0, S, (T,), generator=g, dtype=torch.int32)).clamp(max=S).to(torch.int32)
    ks[0], ke[0] = 5, 5  # a row with no valid key
    return q, k, k_scale, w, ks, ke


def _brute_logits(q, k, k_scale, w, ks, ke) -> torch.Tensor:
    T, S = q.shape[0], k.shape[0]
    out = torch.full((T, S), float("-inf"), dtype=torch.float64)
    qd, kd = q.double(), k.double()
    for i in range(T):
        for j in range(int(ks[i]), int(ke[i])):
            out[i, j] = k_scale[j].double() * (w[i].double() * (qd[i] @ kd[j]).relu()).sum()
    return out


def _brute_topk(x: torch.Tensor, ks, ke, k: int) -> torch.Tensor:
    out = torch.full((x.shape[0], k), -1, dtype=torch.int32)
    for i in range(x.shape[0]):
        vals = [float(v) + 0.0 for v in x[i, int(ks[i]):int(ke[i])]]
        if len(vals) <= k:
            chosen = list(range(len(vals)))
        else:
            chosen = sorted(sorted(range(len(vals)), key=lambda j: (-vals[j], j))[:k])
        out[i, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


# ----------------------------------------------------------------------------- quantisation

@pytest.mark.parametrize("D", [64, 128])
def test_index_rows_layout_and_round_trip(D):
    k = torch.randn(37, D) * torch.rand(37, 1) * 10
    rows = quantize_index_keys(k)
    assert rows.dtype == torch.uint8 and rows.shape == (37, D + 4)
    k_fp8, k_scale = dequantize_index_rows(rows)
    assert k_fp8.dtype == FP8 and k_fp8.shape == (37, D) and k_scale.shape == (37,)
    assert k_fp8.data_ptr() == rows.data_ptr() and k_scale.data_ptr() == rows.data_ptr() + D  # views
    assert torch.equal(rows[:, D:].contiguous().view(torch.float32)[:, 0], k.abs().amax(1) / 448)
    err = (dequantize_index_keys(rows) - k).abs()
    assert bool((err <= k.abs() / 16 + k_scale[:, None] * 2.0 ** -9).all())  # e4m3: 3 mantissa bits


def test_index_rows_132_bytes_for_glm5():
    from cpkv.config import preset

    fmt = preset("glm5").index_format
    rows = quantize_index_keys(torch.randn(4, 128))
    assert rows.shape[1] == fmt.row_bytes == 132 and fmt.scale_offset == 128


def test_quantize_queries_folds_scale_into_weights():
    q, w = torch.randn(9, 4, 64), torch.randn(9, 4)
    q8, wf = quantize_queries(q, w)
    scale = q.abs().amax(-1) / 448
    assert q8.dtype == FP8 and torch.allclose(wf, w * scale)
    k, ksc = torch.randn(20, 64), torch.rand(20) + 0.5
    ks, ke = torch.zeros(9, dtype=torch.int32), torch.full((9,), 20, dtype=torch.int32)
    exact = mqa_logits_ref(q, k, ksc, w, ks, ke, dtype=torch.float64)
    folded = mqa_logits_ref(q8, k, ksc, wf, ks, ke, dtype=torch.float64)
    assert (folded - exact).norm() / exact.norm() < 0.05  # fp8 query error only


def test_quant_rejects_bad_shapes():
    with pytest.raises(IndexerError, match="D % 4"):
        quantize_index_keys(torch.randn(3, 6))
    with pytest.raises(IndexerError, match="uint8"):
        dequantize_index_rows(torch.zeros(3, 132))
    with pytest.raises(IndexerError, match="weights"):
        quantize_queries(torch.randn(3, 4, 64), torch.randn(3, 5))


# ----------------------------------------------------------------------------- logits reference

@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16])
def test_logits_ref_matches_brute_force(dtype):
    q, k, k_scale, w, ks, ke = _inputs(7, 4, 64, 40, seed=1, dtype=dtype)
    ref = _brute_logits(q, k, k_scale, w, ks, ke)
    out = mqa_logits(q, k, k_scale, w, ks, ke)
    assert out.dtype == torch.float32 and out.shape == (7, 40)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))  # -inf exactly outside [ks, ke)
    assert bool((out[0] == float("-inf")).all())  # the row with no valid key
    fin = torch.isfinite(ref)
    assert torch.allclose(out[fin].double(), ref[fin], rtol=1e-5, atol=1e-5 * ref[fin].abs().max())


def test_logits_unclean_keeps_valid_entries():
    q, k, k_scale, w, ks, ke = _inputs(6, 8, 64, 50, seed=2)
    clean, raw = mqa_logits(q, k, k_scale, w, ks, ke), mqa_logits(q, k, k_scale, w, ks, ke, clean=False)
    fin = torch.isfinite(clean)
    assert torch.equal(clean[fin], raw[fin])


def test_logits_input_errors():
    q, k, k_scale, w, ks, ke = _inputs(4, 4, 64, 16)
    with pytest.raises(IndexerError, match="q must be"):
        mqa_logits(q.float(), k, k_scale, w, ks, ke)
    with pytest.raises(IndexerError, match="k must be"):
        mqa_logits(q, k[:, :32], k_scale, w, ks, ke)
    with pytest.raises(IndexerError, match="weights"):
        mqa_logits(q, k, k_scale, w[:, :2], ks, ke)
    with pytest.raises(IndexerError, match="ks must be"):
        mqa_logits(q, k, k_scale, w, ks.long(), ke)


# ----------------------------------------------------------------------------- top-k reference

@pytest.mark.parametrize("levels", [None, 3])
def test_topk_ref_matches_brute_force(levels):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 90, generator=g)
    if levels:  # many ties
        x = torch.randint(0, levels, (12, 90), generator=g).float()
    ks = torch.randint(0, 30, (12,), generator=g, dtype=torch.int32)
    ke = (ks + torch.randint(0, 60, (12,), generator=g, dtype=torch.int32)).to(torch.int32)
    ks[1], ke[1] = 10, 10
    got = topk(x, ks, ke, 8)
    assert got.dtype == torch.int32 and got.shape == (12, 8)
    assert torch.equal(got, _brute_topk(x, ks, ke, 8))
    assert bool((got[1] == -1).all())


def test_topk_ref_negative_zero_ties_with_zero():
    x = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0]])
    one = torch.ones(1, dtype=torch.int32)
    got = topk(x, one * 0, one * 5, 3)
    assert got.tolist() == [[0, 1, 2]]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), k=st.integers(1, 12), seed=st.integers(0, 2**16), tie=st.booleans())
def test_topk_ref_properties(n, k, seed, tie):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (1, n + 3), generator=g).float() if tie else torch.randn(1, n + 3, generator=g)
    ks, ke = torch.tensor([2], dtype=torch.int32), torch.tensor([2 + n], dtype=torch.int32)
    got = topk(x, ks, ke, k)[0].tolist()
    chosen = [j for j in got if j >= 0]
    assert got[len(chosen):] == [-1] * (k - len(chosen)) and len(chosen) == min(n, k)
    assert chosen == sorted(chosen)
    vals = x[0, 2:2 + n]
    rest = [j for j in range(n) if j not in chosen]
    if chosen and rest:
        lo = min(vals[j] for j in chosen)
        assert all(vals[j] <= lo for j in rest)
        assert all(j > max(c for c in chosen if vals[c] == lo) for j in rest if vals[j] == lo)


def test_topk_to_slots():
    idx = torch.tensor([[0, 3, -1], [2, -1, -1]], dtype=torch.int32)
    ks = torch.tensor([10, 100], dtype=torch.int32)
    assert topk_to_slots(idx, ks).tolist() == [[10, 13, -1], [102, -1, -1]]


def test_topk_input_errors():
    x = torch.randn(3, 10)
    with pytest.raises(IndexerError, match="float32"):
        topk(x.double(), torch.zeros(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32), 2)
    with pytest.raises(IndexerError, match="ke must be"):
        topk(x, torch.zeros(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 2)
    with pytest.raises(IndexerError, match="positive"):
        topk(x, torch.zeros(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32), 0)


# ----------------------------------------------------------------------------- plan and chunks

def test_plan_build_zigzag_runs():
    # rank holds two runs of request 0 (positions 0-3 and 12-15) and one run of request 1
    plan = IndexerPlan.build([(0, [0, 1, 2, 3, 12, 13, 14, 15]), (16, [4, 5])], "cpu")
    assert plan.ks.tolist() == [0] * 8 + [16, 16]
    assert plan.ke.tolist() == [1, 2, 3, 4, 13, 14, 15, 16, 21, 22]
    assert plan.ks.dtype == torch.int32 and plan.max_len == 16 and len(plan.chunks) == 1
    c = plan.chunks[0]
    assert (c.key_start, c.key_end, c.rows) == (0, 22, 10)


def test_split_chunks_respects_budget_and_covers_rows():
    ks = [0] * 50 + [100] * 30 + [7, 7]
    ke = [10 + i for i in range(50)] + [140 + i for i in range(30)] + [7, 7]
    for budget in (72 * 4, 500, 4000, 10**9):
        chunks = split_chunks(ks, ke, budget)
        assert chunks[0].row_start == 0 and chunks[-1].row_end == len(ks)
        assert all(a.row_end == b.row_start for a, b in zip(chunks, chunks[1:]))
        assert all(c.nbytes <= budget for c in chunks)
        for c in chunks:
            live = [i for i in range(c.row_start, c.row_end) if ke[i] > ks[i]]
            assert all(c.key_start <= ks[i] and ke[i] <= c.key_end for i in live)


def test_plan_errors():
    with pytest.raises(IndexerError, match="exceed the chunk budget"):
        IndexerPlan.from_bounds([0], [1000], "cpu", chunk_max_bytes=1024)
    with pytest.raises(IndexerError, match="ke"):
        IndexerPlan.from_bounds([5], [4], "cpu")
    with pytest.raises(IndexerError, match=">= 0"):
        IndexerPlan.build([(0, [-1])], "cpu")


def test_plan_default_budget_from_env(monkeypatch):
    monkeypatch.setenv("CPKV_MQA_LOGITS_CHUNK_MAX_GB", "0.5")
    assert IndexerPlan.from_bounds([0], [4], "cpu").chunk_max_bytes == 1 << 29


# ----------------------------------------------------------------------------- logits work items

def _check_items(ks, ke, key_start, n_cols, shape, items):
    """Exact coverage: every row's visible columns lie in its group's items; no tile of a group twice;
    items non-empty, inside one span of the column grid, no longer than a span; span-major order
    outside the split tail; the tiles listed are exactly each group's [min lo, max hi) rounded to tiles."""
    from cpkv.kernels.mqa_logits.work import WorkShape  # noqa: F401

    r, tile, span = shape.rows, shape.tile, shape.span
    rows = items.tolist()
    assert items.dtype == torch.int32 and items.shape[1] == 4
    covered: dict[int, set] = {}
    for t0, c0, n, zero in rows:
        assert zero == 0 and n >= 1 and t0 % r == 0 and c0 % tile == 0
        assert c0 // tile // span == (c0 // tile + n - 1) // span, "an item crosses a span boundary"
        tiles = set(range(c0 // tile, c0 // tile + n))
        assert not covered.setdefault(t0 // r, set()) & tiles, "a tile listed twice"
        covered[t0 // r] |= tiles
    for g in range(-(-len(ks) // r)):
        spans = [(max(a - key_start, 0), min(b - key_start, n_cols)) for a, b in zip(ks[g * r:(g + 1) * r], ke[g * r:(g + 1) * r])]
        spans = [(a, b) for a, b in spans if b > a]
        want = set(range(min(a for a, _ in spans) // tile, -(-max(b for _, b in spans) // tile))) if spans else set()
        assert covered.get(g, set()) == want, f"group {g}"
    piece = max(span // shape.split, 1)
    full = [x for x in rows if x[2] > piece]
    assert [c0 // tile // span for _, c0, _, _ in full] == sorted(c0 // tile // span for _, c0, _, _ in full)


@settings(max_examples=60, deadline=None)
@given(n_rows=st.integers(1, 90), seed=st.integers(0, 10**6), rows=st.sampled_from([1, 2, 4, 8]),
       span=st.integers(1, 9), slots=st.integers(1, 40), split=st.integers(1, 5), tile=st.sampled_from([4, 16]))
def test_logits_work_items_cover_exactly(n_rows, seed, rows, span, slots, split, tile):
    from cpkv.kernels.mqa_logits.work import WorkShape, logits_work_items

    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, 300, (n_rows,), generator=g)
    ke = ks + torch.randint(-20, 400, (n_rows,), generator=g).clamp(min=0)
    ks, ke = ks.tolist(), ke.tolist()
    key_start, n_cols = 50, 500
    shape = WorkShape(rows=rows, tile=tile, span=span, slots=slots, split=split)
    _check_items(ks, ke, key_start, n_cols, shape, logits_work_items(ks, ke, key_start, n_cols, shape))


def _work_items_ref(ks, ke, key_start, n_cols, shape):
    """The work items written out item by item (an independent form of the numpy build): per token group, one
    item per span of tiles it touches; span-major order, groups ascending; the items that lie within the last
    slots x span tiles cut into pieces of span // split tiles."""
    r, tile, span = shape.rows, shape.tile, shape.span
    items = []
    for g in range(-(-len(ks) // r)):
        rows = [(max(ks[i] - key_start, 0), min(ke[i] - key_start, n_cols)) for i in range(g * r, min(len(ks), g * r + r))]
        rows = [(lo, hi) for lo, hi in rows if hi > lo]
        if rows:
            t_lo, t_hi = min(lo for lo, _ in rows) // tile, -(-max(hi for _, hi in rows) // tile)
            for s in range(t_lo // span, (t_hi - 1) // span + 1):
                a = max(s * span, t_lo)
                items.append((s, g, a, min((s + 1) * span, t_hi) - a))
    out = [(g, a, n) for _, g, a, n in sorted(items, key=lambda x: (x[0], x[1]))]
    piece = max(span // shape.split, 1)
    if piece < span:
        start, total = len(out), 0
        for i in range(len(out) - 1, -1, -1):
            total += out[i][2]
            if total > shape.slots * span:
                break
            start = i
        out = out[:start] + [(g, a + k, min(piece, n - k)) for g, a, n in out[start:] for k in range(0, n, piece)]
    return [[g * r, a * tile, n, 0] for g, a, n in out]


@settings(max_examples=150, deadline=None)
@given(n_rows=st.integers(1, 120), seed=st.integers(0, 10**6), rows=st.sampled_from([1, 2, 4, 8, 16]),
       span=st.integers(1, 12), slots=st.integers(1, 60), split=st.integers(1, 6), tile=st.sampled_from([4, 16, 64]),
       reach=st.sampled_from([50, 400, 5000]))
def test_logits_work_items_equal_the_item_by_item_form(n_rows, seed, rows, span, slots, split, tile, reach):
    from cpkv.kernels.mqa_logits.work import WorkShape, logits_work_items

    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, reach, (n_rows,), generator=g)
    ke = (ks + torch.randint(-reach // 10, reach, (n_rows,), generator=g)).clamp(min=0)
    ks, ke = ks.tolist(), ke.tolist()
    key_start, n_cols = reach // 8, reach
    shape = WorkShape(rows=rows, tile=tile, span=span, slots=slots, split=split)
    import cpkv.kernels.mqa_logits.work as work

    want = _work_items_ref(ks, ke, key_start, n_cols, shape)
    threshold = work._ITEMS_PER_SPAN_LOOP
    try:  # both ways of ordering the items: span by span over the groups, and a sort of the items
        for work._ITEMS_PER_SPAN_LOOP in (0, 10**9, threshold):
            got = logits_work_items(ks, ke, key_start, n_cols, shape)
            assert got.dtype == torch.int32 and got.tolist() == want
    finally:
        work._ITEMS_PER_SPAN_LOOP = threshold


def test_logits_work_items_skip_empty_programs_and_cut_the_last_wave():
    from cpkv.kernels.mqa_logits.work import WorkShape, logits_work_items

    # four requests of a warm batch: each token group sees only its own request's keys
    plan = IndexerPlan.build([(0, list(range(1000, 1016))), (1016, list(range(3000, 3016))),
                              (4016, list(range(500, 516)))], "cpu")
    c = plan.chunks[0]
    shape = WorkShape(rows=4, tile=16, span=8, slots=3, split=4)
    items = plan.work_items(c, shape)
    assert plan.work_items(c, shape) is items  # built once, reused by every layer
    _check_items(plan.host_ks, plan.host_ke, c.key_start, c.width, shape, items)
    whole = WorkShape(rows=4, tile=16, span=8, slots=3, split=1)
    unsplit = logits_work_items(plan.host_ks, plan.host_ke, c.key_start, c.width, whole)
    _check_items(plan.host_ks, plan.host_ke, c.key_start, c.width, whole, unsplit)
    grid = -(-c.width // (16 * 8)) * (48 // 4)
    assert unsplit.shape[0] < grid / 2  # most grid programs would have been empty
    # the same items up to the last slots x span = 24 tiles, which are cut into pieces of 8 // 4 = 2 tiles
    same = next(i for i in range(unsplit.shape[0]) if not torch.equal(items[i], unsplit[i]))
    assert torch.equal(items[:same], unsplit[:same])
    assert 0 < int(unsplit[same:, 2].sum()) <= 24 and int(items[same:, 2].max()) <= 2
    assert int(items[same:, 2].sum()) == int(unsplit[same:, 2].sum())
    with pytest.raises(ValueError, match="span"):
        WorkShape(rows=4, tile=16, span=0, slots=3)
    with pytest.raises(ValueError, match="same length"):
        logits_work_items([0, 1], [5], 0, 10, shape)

# ----------------------------------------------------------------------------- index_topk

@pytest.mark.parametrize("budget", [None, 20_000, 2_000, 500])
def test_index_topk_equals_topk_of_logits(budget):
    q, k, k_scale, w, ks, ke = _inputs(40, 4, 64, 120, seed=4)
    want = topk(mqa_logits(q, k, k_scale, w, ks, ke), ks, ke, 16)
    got = index_topk(q, k, k_scale, w, ks, ke, topk=16, chunk_max_bytes=budget)
    assert torch.equal(got, want)


def test_index_topk_with_plan_ragged_requests():
    g = torch.Generator().manual_seed(5)
    requests = [(0, list(range(0, 8)) + list(range(40, 48))), (60, list(range(20, 30))), (100, [0, 1])]
    plan = IndexerPlan.build(requests, "cpu", chunk_max_bytes=3000)
    S, T = 140, plan.num_tokens
    q, w = quantize_queries(torch.randn(T, 8, 64, generator=g), torch.randn(T, 8, generator=g))
    k, k_scale = dequantize_index_rows(quantize_index_keys(torch.randn(S, 64, generator=g)))
    want = topk(mqa_logits(q, k, k_scale, w, plan.ks, plan.ke), plan.ks, plan.ke, 12)
    got = index_topk(q, k, k_scale, w, plan.ks, plan.ke, topk=12, plan=plan)
    assert len(plan.chunks) > 1 and torch.equal(got, want)
    slots = topk_to_slots(got, plan.ks)
    assert bool(((slots == -1) | ((slots >= plan.ks[:, None]) & (slots < plan.ke[:, None]))).all())


@pytest.mark.parametrize("budget", [None, 3000])
def test_index_topk_absolute_is_topk_to_slots(budget):
    """``absolute=True``: the key rows themselves (index + ks, -1 kept), chunked or not, short rows included."""
    g = torch.Generator().manual_seed(9)
    requests = [(0, list(range(0, 8)) + list(range(40, 48))), (60, list(range(20, 30))), (100, [0, 1])]
    plan = IndexerPlan.build(requests, "cpu", chunk_max_bytes=budget)
    T = plan.num_tokens
    q, w = quantize_queries(torch.randn(T, 8, 64, generator=g), torch.randn(T, 8, generator=g))
    k, k_scale = dequantize_index_rows(quantize_index_keys(torch.randn(140, 64, generator=g)))
    for kk in (12, 64):  # 64: every row short (no logits)
        rel = index_topk(q, k, k_scale, w, plan.ks, plan.ke, topk=kk, plan=plan)
        got = index_topk(q, k, k_scale, w, plan.ks, plan.ke, topk=kk, plan=plan, absolute=True)
        assert torch.equal(got, topk_to_slots(rel, plan.ks)) and bool((rel == -1).any())


def test_index_topk_skips_logits_when_all_rows_short(monkeypatch):
    import sys

    mod = sys.modules["cpkv.indexer.topk"]  # the package attribute `topk` is the function

    def boom(*a, **kw):
        raise AssertionError("logits computed")

    monkeypatch.setattr(mod, "logits_into", boom)
    q, k, k_scale, w, ks, ke = _inputs(10, 4, 64, 30, seed=6)
    got = index_topk(q, k, k_scale, w, ks, ke, topk=32)
    assert torch.equal(got, topk(mqa_logits(q, k, k_scale, w, ks, ke), ks, ke, 32))


def test_index_topk_plan_mismatch():
    q, k, k_scale, w, ks, ke = _inputs(10, 4, 64, 30)
    plan = IndexerPlan.from_bounds([0] * 3, [4] * 3, "cpu")
    with pytest.raises(IndexerError, match="plan has 3"):
        index_topk(q, k, k_scale, w, ks, ke, topk=4, plan=plan)


# ----------------------------------------------------------------------------- CLI

def test_bench_command_module_shape():
    from cpkv.bench import indexer as cli_bench

    p = argparse.ArgumentParser()
    cli_bench.add_arguments(p)
    args = p.parse_args(["--json", "--scenarios", "cold"])
    assert isinstance(cli_bench.HELP, str) and args.json
    if not torch.cuda.is_available():
        with pytest.raises(IndexerError, match="CUDA"):
            cli_bench.run(args)


def _split_chunks_loop(ks, ke, budget):
    """The greedy split row by row (the definition split_chunks vectorises)."""
    from cpkv.indexer.plan import IndexerChunk, padded

    chunks, start, lo, hi, longest = [], 0, None, None, 0
    for i, (a, b) in enumerate(zip(ks, ke)):
        nlo, nhi = (lo, hi) if a == b else ((a, b) if lo is None else (min(lo, a), max(hi, b)))
        if nlo is not None and (i - start + 1) * padded(nhi - nlo) * 4 > budget:
            chunks.append(IndexerChunk(start, i, lo or 0, hi or 0, longest))
            start, longest = i, 0
            nlo, nhi = (None, None) if a == b else (a, b)
        lo, hi, longest = nlo, nhi, max(longest, b - a)
    if start < len(ks):
        chunks.append(IndexerChunk(start, len(ks), lo or 0, hi or 0, longest))
    return chunks


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 120), st.booleans()), min_size=1, max_size=60),
       st.sampled_from([16 * 4, 100 * 4, 64 * 4 * 8, 10**6]))
def test_split_chunks_equals_the_row_by_row_greedy(rows, budget):
    import cpkv.indexer.plan as plan_mod

    ks = [a for a, _, _ in rows]
    ke = [a + (0 if empty else min(w, budget // 4 - 4)) for a, w, empty in rows]
    want = _split_chunks_loop(ks, ke, budget)
    block = plan_mod._BLOCK
    try:  # the block walk: chunks that start and end inside blocks, and blocks walked whole
        for plan_mod._BLOCK in (1, 3, 8, block):
            assert split_chunks(ks, ke, budget) == want
    finally:
        plan_mod._BLOCK = block
