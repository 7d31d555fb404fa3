"""ComposePlan, gather reference, staging and arena in one process: the modes' arithmetic, no ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpkv.compose.modes import MODES, get_mode, parse_modes
from cpkv.compose.plan import ComposePlan
from cpkv.compose.reference import current_pages, reference_dense
from cpkv.compose.staging import DenseArena, Staging
from cpkv.config import KINDS, AdmissionCaps, preset
from cpkv.errors import ComposeError, StagingOverflow
from cpkv.kernels.page_gather.ref import page_gather_ref
from cpkv.layout import build_layout

TINY = preset("tiny")
LAYOUTS = [  # (requests, page_size, cp, strategy)
    ([(0, 1)], 4, 2, "zigzag"),
    ([(8, 13), (0, 4), (16, 31)], 4, 3, "zigzag"),
    ([(7, 9)], 4, 2, "contiguous"),  # solo, unaligned prefix
    ([(32, 50), (8, 3)], 8, 4, "round-robin"),
    ([(3, 2)], 1, 3, "zigzag"),
]


def _layout(reqs, P, cp, strategy, seed=0):
    rng = np.random.default_rng(seed)
    pages = [[(int(rng.integers(0, cp)), int(rng.integers(1, 20))) for _ in range(-(-p // P))] for p, _ in reqs]
    return build_layout(reqs, page_size=P, cp=cp, strategy=strategy, prefix_pages=pages)


def _world(layout, kind, seed=1):
    """Per-rank pools [20, PB] and the batch's current pages [num_current, PB], random bytes."""
    g = torch.Generator().manual_seed(seed)
    pb = layout.page_size * TINY.row_bytes(kind)
    pools = [torch.randint(0, 256, (20, pb), dtype=torch.uint8, generator=g) for _ in range(layout.cp)]
    rows = torch.randint(0, 256, (layout.extend_tokens, TINY.row_bytes(kind)), dtype=torch.uint8, generator=g)
    return pools, current_pages(layout, rows)


def _plans(layout, ids=None):
    pb = {k: layout.page_size * TINY.row_bytes(k) for k in KINDS}
    return [ComposePlan(layout, r, 64, pb, torch.device("cpu"), ids) for r in range(layout.cp)]


def _stagings(layout, plans, cur):
    """Every writer's staging half: its j-th own current page at page j + 1 (page 0 reserved, poisoned)."""
    out = []
    for p in plans:
        st = torch.full((1 + 64, cur.shape[1]), 0x5A, dtype=torch.uint8)
        st[1: 1 + p.num_own] = cur[torch.from_numpy(p.own_compact)]
        out.append(st)
    return out


def _gather(n, pb, sources, e):
    out = torch.full((n, pb), 0xEE, dtype=torch.uint8)  # poisoned: every page must be written
    page_gather_ref(out, sources, e.dest, e.src, e.page)
    return out


@pytest.mark.parametrize("reqs,P,cp,strategy", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_entry_set_rebuilds_the_reference(reqs, P, cp, strategy, kind):
    layout = _layout(reqs, P, cp, strategy)
    pools, cur = _world(layout, kind)
    ref = reference_dense(layout, pools, cur).view(layout.num_slots, -1)
    plans = _plans(layout)
    stagings = _stagings(layout, plans, cur)
    S, pb = layout.num_slots, cur.shape[1]
    batch_reduce = torch.zeros((S, pb), dtype=torch.int64)
    compact = torch.zeros((layout.num_current, pb), dtype=torch.int64)
    for p, pool, st in zip(plans, pools, stagings):
        assert torch.equal(_gather(S, pb, pools + stagings, p.all), ref)  # symm
        pre = _gather(S, pb, pools + stagings, p.prefix)
        assert torch.equal(pre[torch.from_numpy(~p.is_current)], ref[torch.from_numpy(~p.is_current)])
        assert not pre[torch.from_numpy(p.is_current)].any()  # -1 zero-fills current slots
        page_gather_ref(pre, pools + stagings, p.current.dest, p.current.src, p.current.page)
        assert torch.equal(pre, ref)  # prefetch: prefix ahead, current after the barrier
        batch_reduce += _gather(S, pb, [pool, st], p.own).long()
        compact += _gather(layout.num_current, pb, [pool, st], p.compact).long()
    assert torch.equal(batch_reduce, ref.long())  # sum all-reduce of own pages (others zero) is exact
    assert torch.equal(compact, cur.long())  # prefix-gather's compact current pages
    span_reduce = torch.zeros((S, pb), dtype=torch.int64)
    for p, pool, st in zip(plans, pools, stagings):  # span-reduce: own pages per request span, summed
        for span in p.spans:
            part = _gather(S, pb, [pool, st], span.own)[span.start: span.end]
            span_reduce[span.start: span.end] += part.long()
    assert torch.equal(span_reduce, ref.long())


@pytest.mark.parametrize("reqs,P,cp,strategy", LAYOUTS)
def test_query_and_tail_rows_tile_the_rank_block(reqs, P, cp, strategy):
    layout = _layout(reqs, P, cp, strategy)
    for r, p in enumerate(_plans(layout)):
        q, t = p.query_rows.tolist(), p.tail_rows.tolist()
        assert sorted(q + t) == list(range(p.num_own * P))
        assert q == sorted(q) and len(q) == layout.query_tokens(r) == p.num_query_tokens
        assert p.staging_page[p.own_compact].tolist() == list(range(1, p.num_own + 1))


def _slot_reference(layout, rank):
    """Per-slot (all, own, prefix) (src, page) lists straight from ``layout.logical_pages`` (the plan's spec)."""
    stage, seen = {}, [0] * layout.cp
    for c in layout.current_pages:
        seen[c.writer] += 1
        stage[c.compact] = seen[c.writer]
    ref = {"all": ([], []), "own": ([], []), "prefix": ([], [])}
    for lp in layout.logical_pages:
        cur = lp.page_id < 0
        page = stage[lp.compact] if cur else lp.page_id
        mine = lp.rank == rank
        for name, (src, pg) in (("all", (layout.cp + lp.rank if cur else lp.rank, page)),
                                ("own", ((1 if cur else 0) if mine else -1, page if mine else 0)),
                                ("prefix", (-1 if cur else lp.rank, 0 if cur else page))):
            ref[name][0].append(src)
            ref[name][1].append(pg)
    return ref, stage


@pytest.mark.parametrize("reqs,P,cp,strategy", LAYOUTS + [([(64, 9), (0, 70), (8, 1), (128, 64)], 8, 8, "zigzag")])
def test_plan_arrays_match_a_per_slot_reference(reqs, P, cp, strategy):
    layout = _layout(reqs, P, cp, strategy, seed=3)
    slots = list(range(layout.num_slots))
    current = [lp.slot for lp in layout.logical_pages if lp.page_id < 0]
    for rank, plan in enumerate(_plans(layout)):
        ref, stage = _slot_reference(layout, rank)
        for name, (src, page) in ref.items():
            e = getattr(plan, name)
            assert (e.dest.tolist(), e.src.tolist(), e.page.tolist()) == (slots, src, page), name
        own = set(layout.rank_current[rank])
        C = layout.num_current
        assert (plan.current.dest.tolist(), plan.current.src.tolist(), plan.current.page.tolist()) == (
            current, [layout.cp + c.writer for c in layout.current_pages], [stage[i] for i in range(C)])
        assert (plan.compact.dest.tolist(), plan.compact.src.tolist(), plan.compact.page.tolist()) == (
            list(range(C)), [1 if i in own else -1 for i in range(C)], [stage[i] if i in own else 0 for i in range(C)])
        assert plan.current_slots_t.tolist() == current and plan.is_current.tolist() == [
            lp.page_id < 0 for lp in layout.logical_pages]
        assert plan.own_compact.tolist() == list(layout.rank_current[rank])
        rows = [j * P + t for j, c in enumerate(layout.rank_current[rank]) for t in range(P)]
        n = [layout.current_pages[c].num_tokens for c in layout.rank_current[rank]]
        assert plan.query_rows.tolist() == [r for r in rows if r % P < n[r // P]]
        assert plan.tail_rows.tolist() == [r for r in rows if r % P >= n[r // P]]


def test_current_page_ids_are_validated():
    layout = _layout([(8, 13), (0, 4)], 4, 2, "zigzag")
    n = layout.num_current
    plan = ComposePlan(layout, 0, 64, {k: 4 for k in KINDS}, torch.device("cpu"), list(range(1, n + 1)))
    assert plan.persists and plan.own_pool_pages.tolist() == (np.arange(1, n + 1)[plan.own_compact]).tolist()
    with pytest.raises(ComposeError, match="one writer-side page id per current page"):
        ComposePlan(layout, 0, 64, {k: 4 for k in KINDS}, torch.device("cpu"), [1, 2])
    with pytest.raises(ComposeError, match="distinct pool pages >= 1"):
        ComposePlan(layout, 0, 64, {k: 4 for k in KINDS}, torch.device("cpu"), [0] * n)
    with pytest.raises(ComposeError, match="one writer-side page id per current page"):
        ComposePlan(layout, 0, 64, {k: 4 for k in KINDS}, torch.device("cpu"), np.ones((n, 1), np.int64))
    arr = ComposePlan(layout, 0, 64, {k: 4 for k in KINDS}, torch.device("cpu"), np.arange(1, n + 1))
    assert arr.own_pool_pages.tolist() == plan.own_pool_pages.tolist()
    assert arr.current_page_ids.tolist() == list(range(1, n + 1)) and arr.max_own_pool_page == plan.max_own_pool_page


def test_plan_refuses_another_rank_or_setup():
    a = _layout([(8, 13)], 4, 2, "zigzag")
    plan = _plans(a)[0]
    plan.check(0, plan.signature)
    with pytest.raises(ComposeError, match="rank 0"):
        plan.check(1, plan.signature)
    with pytest.raises(ComposeError, match="rank 0"):
        plan.check(0, (2, 8) + plan.signature[2:])


def test_gather_ref_zero_fills_and_repeats_pages():
    src = torch.arange(5 * 8, dtype=torch.uint8).view(5, 8)
    out = torch.full((4, 8), 9, dtype=torch.uint8)
    page_gather_ref(out, [src], torch.tensor([3, 0, 1, 2]), torch.tensor([0, -1, 0, 0]), torch.tensor([4, 0, 4, 1]))
    assert torch.equal(out, torch.stack([torch.zeros(8, dtype=torch.uint8), src[4], src[1], src[4]]))


def test_staging_identity_and_overflow():
    caps = AdmissionCaps(chunk_size=64, cached_tokens=64, max_requests=3)
    st = Staging(TINY, 16, caps, lambda shape, name: torch.zeros(shape, dtype=torch.uint8))
    assert st.capacity == 64 // 16 + 3 == caps.staging_pages(16)
    assert tuple(st.buffers["token"].shape) == (2, 1 + st.capacity, 16 * TINY.row_bytes("token"))
    st.check(st.capacity, 3)
    with pytest.raises(StagingOverflow, match=f"staging holds {st.capacity}"):
        st.check(st.capacity + 1, 3)


def test_arena_grows_only_before_registration():
    arena = DenseArena(1000, "cpu")
    arena.reserve(5000)
    assert arena.half_bytes >= 5000
    arena.register()
    arena.reserve(arena.half_bytes)
    with pytest.raises(ComposeError, match="registered arena"):
        arena.reserve(arena.half_bytes + 1)
    a, b = arena.view(0, 256, 4, 8), arena.view(1, 256, 4, 8)
    assert a.data_ptr() != b.data_ptr() and a.shape == (4, 8)


def test_mode_registry_lists_names():
    assert list(MODES) == ["span-reduce", "batch-reduce", "prefix-gather", "symm", "prefetch"]
    assert parse_modes("all") == list(MODES) and parse_modes("prefix-gather, symm") == ["prefix-gather", "symm"]
    with pytest.raises(ComposeError, match="supported: span-reduce, batch-reduce, prefix-gather, symm, prefetch"):
        get_mode("ring")
    with pytest.raises(ComposeError, match="unknown compose mode 'nope'"):
        parse_modes("batch-reduce,nope")


def test_earlier_mode_spellings_name_the_same_modes():
    assert parse_modes("legacy,fused,v2") == ["span-reduce", "batch-reduce", "prefix-gather"]
    assert get_mode("v2") is MODES["prefix-gather"] and get_mode("legacy") is MODES["span-reduce"]
    assert get_mode("fused") is MODES["batch-reduce"]


def test_check_cli_exits_1_on_a_mismatch(monkeypatch, capsys):
    import argparse
    import json

    from cpkv.bench import check, check_cmd as cli_check
    fake = {"ok": False, "cp": 2, "device": "cpu", "batches": 1, "page_size": 16, "layers": 1, "peer_memory": "shm",
            "backend": "gloo", "shared_device": False, "solo_batches": 1, "prefetch_hits": [0, 0],
            "modes": {"batch-reduce": {"digest": "ab" * 32, "mismatches": 3, "bytes": 10, "batches": 1, "effective": "batch-reduce"}}}
    monkeypatch.setattr(check, "run_check", lambda cfg, on_progress=None: fake)
    parser = argparse.ArgumentParser()
    cli_check.add_arguments(parser)
    assert cli_check.run(parser.parse_args(["--modes", "batch-reduce", "--json"])) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["modes"]["batch-reduce"]["mismatches"] == 3
    assert set(out["modes"]["batch-reduce"]) >= {"digest", "mismatches", "bytes"}
    fake["ok"] = True
    fake["modes"]["batch-reduce"]["mismatches"] = 0
    assert cli_check.run(parser.parse_args(["--modes", "batch-reduce"])) == 0
    assert "batch-reduce" in capsys.readouterr().out


def test_earlier_mode_spellings_pass_every_front_door(monkeypatch):
    import argparse

    from cpkv import envs
    from cpkv.cli import run_cmd
    from cpkv.engine.config import EngineConfig

    monkeypatch.setenv("CPKV_COMPOSE_MODE", "v2")
    assert envs.get("CPKV_COMPOSE_MODE") == "prefix-gather"
    assert EngineConfig(mode="legacy").mode == "legacy"  # accepted; the runtime resolves it
    parser = argparse.ArgumentParser()  # --mode of cpkv run (and serve, bench engine); --modes: parse_modes
    run_cmd.add_arguments(parser)
    assert parser.parse_args(["--mode", "fused"]).mode == "batch-reduce"
