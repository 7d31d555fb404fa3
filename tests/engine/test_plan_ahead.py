"""Host work a batch needs is built with its plan, before the first kernel, and equals what the forward
would have built on first use: the indexer logits work items, and the compose gather / persist launches
(prepared once per batch, re-pointed per layer). Runs on the CPU: the launches' compiled kernel is a
recorder of the raw arguments each launch would pass."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpkv.indexer.plan import IndexerPlan
from cpkv.kernels.mqa_logits.work import WorkShape
from cpkv.kernels.page_gather import triton as pg

SHAPES = [WorkShape(rows=4, tile=64, span=64, slots=528, split=4), WorkShape(rows=2, tile=16, span=4, slots=3, split=2)]


def _cached_batch_bounds(prefix: int, extend: int, base: int = 0) -> tuple[np.ndarray, np.ndarray]:
    pos = np.arange(prefix, prefix + extend, dtype=np.int64)
    return np.full(extend, base, np.int64), base + pos + 1


@pytest.mark.parametrize("shape", SHAPES)
def test_prepared_work_items_equal_the_lazily_built_ones(shape):
    a, b = _cached_batch_bounds(2944, 333)
    a2, b2 = _cached_batch_bounds(0, 700, base=3300)  # a second request: two chunks under a small budget
    ks, ke = np.concatenate([a, a2]), np.concatenate([b, b2])
    budget = 400 * 4 * 3300
    ahead = IndexerPlan.from_bounds(ks, ke, "cpu", budget)
    lazy = IndexerPlan.from_bounds(ks, ke, "cpu", budget)
    assert len(ahead.chunks) >= 2
    ahead.prepare_items(shape, topk=64)
    built = dict(ahead._items)
    assert len(built) == sum(c.max_len > 64 for c in ahead.chunks) >= 2  # every chunk that computes logits
    for c in ahead.chunks:
        if c.max_len > 64:
            got = ahead.work_items(c, shape)
            assert got is built[(c, shape)]  # the layer finds it built: no host work in the forward
            want = lazy.work_items(c, shape)
            assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want)
    assert len(ahead._items) == len(built)
    none = IndexerPlan.from_bounds(ks, ke, "cpu", budget)
    first = IndexerPlan.from_bounds(ks, ke, "cpu", chunk_max_bytes=budget)
    first.prepare_items(shape, topk=64, chunks=1)  # the batch plan's share: the first logits chunk only
    assert list(first._items) == [next(k for k in built if k[0].max_len > 64)]
    none.prepare_items(None, topk=64)  # no Gluon work items on this device: nothing built
    assert not none._items
    short = IndexerPlan.from_bounds(ks, ke, "cpu", budget)
    short.prepare_items(shape, topk=10_000)  # every row sees <= top-k keys: no logits, no items
    assert not short._items


def test_the_engine_plans_no_work_items_off_cuda():
    from types import SimpleNamespace

    from cpkv.config import preset
    from cpkv.engine.forward import _logits_work_shape
    assert _logits_work_shape(SimpleNamespace(cfg=preset("glm5"), device=torch.device("cpu"))) is None


# -- compose launches ---------------------------------------------------------------------------------


def _recorder(log: list):
    def run(*args) -> None:
        log.append(args[9:])  # the raw kernel arguments (after grid, stream, function, metadata, hooks)
    return run


def _fake_launcher(log: list, builds: list):
    """gather_launcher whose launches record their raw arguments (same layout as the real one: OUT, BASES, DEST,
    SRC, PAGE, out_addr, n)."""
    def one(out, bases, dest, src, page, *, aligned16=True, config=None):
        builds.append("one")
        raw = (out.data_ptr(), bases.data_ptr(), dest.data_ptr(), src.data_ptr(), page.data_ptr(), out.data_ptr(),
               dest.numel())
        return pg._fast((_recorder(log), (dest.numel(), 1, 1), "fn", "meta", 0), raw, (out, bases, dest, src, page),
                        out.shape[-1])
    return one


def _launch_logs(ctx, split: bool = False):
    """Per batch: the raw launches of every layer's symm compose_layer with the launches prepared by
    ``prepare`` (and re-pointed per layer), then the same layers with every launch built in full on first use.
    ``split``: ``plan_batch`` makes the first layer's launches alone, ``build_launches`` the others once the first
    layer has composed (as the engine's forward does)."""
    import cpkv.compose.launches as R
    from cpkv.compose.runtime import ComposeRuntime
    from cpkv.config import AdmissionCaps, preset
    from cpkv.layout import build_layout

    torch._C._cuda_getCurrentRawStream = lambda index: 7  # the recorder never touches a device
    log, builds = [], []
    R.gather_launcher = _fake_launcher(log, builds)
    real_relaunch = R.relaunch_with
    model = preset("tiny")
    caps = AdmissionCaps(chunk_size=64, cached_tokens=128, max_requests=2)
    rt = ComposeRuntime.create(ctx, model, num_pages=64, page_size=4, caps=caps, num_layers=3, mode="symm")
    rt.use_triton = True
    rt.buffers.build_tables(use_triton=True)  # the Triton source tables (addresses of the shared pools, stagings)
    out = []
    for reqs in ([(8, 12), (4, 5)], [(0, 9)], [(16, 30)]):
        layout = build_layout(reqs, page_size=4, cp=ctx.world_size)
        ids = list(range(1, layout.num_current + 1))
        R.relaunch_with = real_relaunch
        uses = dict(rt.uses)
        before = len(builds)
        plan = rt.plan_batch(layout, ids, launch_layers=1 if split else None)
        prepared = sum(len(e.launchers) for e in (plan.all, plan.persist_entries))
        at_prepare = len(builds) - before
        del log[:]
        for n in range(3):
            rt.compose_layer(plan, n)
            if split and n == 0:
                mark = len(builds)
                rt.build_launches(plan)
                at_prepare += len(builds) - mark
                prepared = sum(len(e.launchers) for e in (plan.all, plan.persist_entries))
        ahead = list(log)
        in_forward = len(builds) - before - at_prepare
        for e in (plan.all, plan.persist_entries):  # now the reference: every launch built in full, lazily
            e.launchers.clear()
        R.relaunch_with = lambda launch, out, bases: None
        rt.uses = dict(uses)
        del log[:]
        for n in range(3):
            rt.compose_layer(plan, n)
        out.append({"ahead": ahead, "full": list(log), "in_forward": in_forward, "at_prepare": at_prepare,
                    "prepared": prepared, "own": plan.num_own,
                    "kinds": sum(len(rt.pool.kinds_at(n)) for n in range(3))})
    rt.close()
    return out


def test_prepared_compose_launches_equal_full_builds_and_none_is_built_in_the_forward():
    from cpkv.dist import launch

    for rank_out in launch(_launch_logs, 2, timeout_s=120):
        for b in rank_out:
            assert b["in_forward"] == 0  # every launch of the forward was built by prepare
            assert b["ahead"] == b["full"]  # re-pointed launches pass exactly the arguments a full build passes
            persists = b["own"] > 0
            assert len(b["ahead"]) == b["kinds"] * (1 + persists)  # per layer and kind: a gather, a persist
            assert b["at_prepare"] <= 2 * (1 + persists) < len(b["ahead"])  # templates, the rest re-pointed
            assert b["prepared"] >= 3


def test_relaunch_with_repoints_outputs_and_tables_only():
    log: list = []
    torch_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    torch._C._cuda_getCurrentRawStream = lambda index: 7
    try:
        out, out2 = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 64, dtype=torch.uint8)
        bases, bases2 = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
        idx = torch.arange(3)
        raw = (out.data_ptr(), bases.data_ptr(), idx.data_ptr(), idx.data_ptr(), idx.data_ptr(), out.data_ptr(), 3,
               3, 16, 4, 4, 16, True, False)
        launch = pg._fast((_recorder(log), (3, 1, 1), "fn", "meta", 0), raw, (out, bases, idx, idx, idx), 64)
        moved = pg.relaunch_with(launch, out2, bases2)
        moved()
        launch()
        assert log[0] == (out2.data_ptr(), bases2.data_ptr(), *raw[2:5], out2.data_ptr(), *raw[6:])
        assert log[1] == raw
        assert any(t is out2 for t in moved.tensors) and any(t is bases2 for t in moved.tensors)  # kept alive
        assert pg.relaunch_with(launch, torch.zeros(4, 32, dtype=torch.uint8), bases2) is None  # other page size
        odd = torch.zeros(4 * 64 + 1, dtype=torch.uint8)[1:].view(4, 64)
        assert pg.relaunch_with(launch, odd, bases2) is None  # loses 16-byte alignment
        assert pg.relaunch_with(pg._noop, out2, bases2) is None  # not a direct launch
    finally:
        if torch_stream is None:
            del torch._C._cuda_getCurrentRawStream
        else:
            torch._C._cuda_getCurrentRawStream = torch_stream


def test_compose_launches_prepared_after_the_first_layer_equal_full_builds():
    """The engine's split: ``plan_batch`` builds the first layer's launches, ``build_launches`` the others after the
    first layer composed (the staging use counters continued from its simulation): the same raw launches as
    launches built in full, none built inside a layer's compose."""
    from cpkv.dist import launch

    for rank_out in launch(_launch_logs, 2, args=(True,), timeout_s=120):
        for b in rank_out:
            assert b["in_forward"] == 0 and b["ahead"] == b["full"] and b["prepared"] > 0
