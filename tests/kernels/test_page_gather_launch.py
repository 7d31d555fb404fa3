"""The prepared gather launchers' host logic (argument order, grid, caching, fallbacks), with the compiled
kernel replaced by a recorder: runs wherever Triton imports, no GPU needed (CI without Triton skips it)."""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from cpkv.kernels.page_gather import triton as pg  # noqa: E402

REAL_LOAD_PAIR = pg.load_pair  # the fixture replaces it


class _Compiled:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.function, self.packed_metadata = "fn", "meta"

    def run(self, *args) -> None:
        self.calls.append(args)


@pytest.fixture
def fake(monkeypatch):
    compiled, compiles = _Compiled(), []

    def compile_single(self, warmup=False):
        compiles.append(("single", warmup))
        return compiled

    class _Pair:
        def warmup(self, *args, grid, **kw):
            compiles.append(("pair", args, grid, kw))
            return compiled

    monkeypatch.setattr(pg._Launch, "jit", compile_single)
    monkeypatch.setattr(pg, "load_pair", lambda: _Pair())
    monkeypatch.setattr(pg, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1000 + i, raising=False)
    return compiled, compiles


def _seg(page_bytes: int, n: int):
    out = torch.zeros((n, page_bytes), dtype=torch.uint8)
    bases = torch.zeros(3, dtype=torch.int64)
    dest, src, page = (torch.arange(n, dtype=torch.int32) for _ in range(3))
    return out, bases, dest, src, page


def test_single_launcher_passes_raw_addresses_and_compiles_once(fake):
    compiled, compiles = fake
    out, bases, dest, src, page = _seg(64 * 656, 5)
    launch = pg.gather_launcher(out, bases, dest, src, page)
    launch()
    launch()
    again = pg.gather_launcher(out, bases, dest, src, page)
    again()
    assert compiles == [("single", True)]  # compiled without a launch, once for the same specialisation
    grid, stream, fn, meta, hooks, raw = (compiled.calls[0][:3], compiled.calls[0][3], compiled.calls[0][4],
                                          compiled.calls[0][5], compiled.calls[0][6:9], compiled.calls[0][9:])
    assert grid == (5, 1, 1) and stream == 1000 and (fn, meta) == ("fn", "meta") and hooks == (None,) * 3
    named = dict(zip(pg.load().arg_names, raw))  # the real kernel's parameter names
    assert len(named) == len(raw) == 12
    assert [named[x] for x in ("OUT", "BASES", "DEST", "SRC", "PAGE", "out_addr")] == [
        t.data_ptr() for t in (out, bases, dest, src, page, out)]
    assert (named["n"], named["n_units"]) == (5, 5)  # one unit per page
    assert [named[x] for x in ("PAGE_ELEMS", "ELEM_BYTES", "VEC", "BLOCK")] == [
        64 * 656 // 4, 4, 4, 16384]  # int32 elements, 16-byte vectors, one program per page
    assert len(compiled.calls) == 3 and all(c == compiled.calls[0] for c in compiled.calls)
    assert launch.tensors[2] is dest


def test_pair_launcher_orders_both_segments_for_one_launch(fake):
    compiled, compiles = fake
    a, b = _seg(64 * 656, 4), _seg(64 * 132, 7)
    launch = pg.gather_pair_launcher((*a, True), (*b, True))
    launch()
    [(kind, args, grid, kw)] = compiles
    # PAIR_CONFIG's 4096-element blocks: a 41,984-byte token page is 3 units, an 8,448-byte index page 1
    assert kind == "pair" and grid == (4 * 3 + 7, 1, 1) and len(args) == 16
    call = compiled.calls[0]
    assert call[:3] == (19, 1, 1) and kw["num_warps"] == pg.PAIR_CONFIG["num_warps"]
    # every raw value lands on the parameter of that name in the real kernel's signature
    named = dict(zip(REAL_LOAD_PAIR().arg_names, call[9:]))
    assert len(named) == len(call[9:]) == 24
    for j, (out, bases, dest, src, page) in enumerate((a, b)):
        assert [named[f"{x}{j}"] for x in ("OUT", "BASES", "DEST", "SRC", "PAGE", "out_addr")] == [
            t.data_ptr() for t in (out, bases, dest, src, page, out)]
    assert (named["n0"], named["units0"], named["n1"], named["units1"]) == (4, 12, 7, 7)
    assert set(kw) == {f"{x}{j}" for x in ("PAGE_ELEMS", "ELEM_BYTES", "VEC", "BLOCK") for j in (0, 1)} | {"num_warps"}
    assert [named[f"{x}0"] for x in ("PAGE_ELEMS", "ELEM_BYTES", "VEC", "BLOCK")] == [64 * 656 // 4, 4, 4, 4096]
    assert [named[f"{x}1"] for x in ("PAGE_ELEMS", "ELEM_BYTES", "VEC", "BLOCK")] == [64 * 132 // 4, 4, 4, 4096]
    assert kw["BLOCK1"] == 4096 and kw["PAGE_ELEMS0"] == 64 * 656 // 4
    # a config given overrides PAIR_CONFIG (missing keys still PAIR_CONFIG's): one 16384-element unit a token page
    pg.gather_pair_launcher((*a, True), (*b, True), config={"block": 16384})()
    assert compiles[-1][2] == (4 + 7, 1, 1) and compiles[-1][3]["BLOCK0"] == 16384
    assert compiles[-1][3]["num_warps"] == pg.PAIR_CONFIG["num_warps"]


def test_triton_s_empty_hook_chain_allows_direct_launches(fake, monkeypatch):
    from triton import knobs
    assert pg._direct_launch_ok()  # Triton >= 3.5 installs empty HookChains: no hook, so direct launches
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):
        seen = []
        hook.add(seen.append)
        try:
            assert not pg._direct_launch_ok()
        finally:
            hook.remove(seen.append)
    assert pg._no_hook(None) and not pg._no_hook(print)


def test_launchers_fall_back_without_direct_launches(fake, monkeypatch):
    compiled, compiles = fake
    a, b = _seg(132, 3), _seg(132, 0)
    assert pg.gather_launcher(*b[:2], *b[2:]) is pg._noop  # nothing to gather
    calls = []
    monkeypatch.setattr(pg, "page_gather_triton", lambda *x, **k: calls.append(("slow", x[2].numel())))
    pair = pg.gather_pair_launcher((*a, True), (*b, True))  # one side empty: two launchers, the empty one a no-op
    pair()
    monkeypatch.setattr(pg, "FAST_LAUNCH", [False])
    pg.gather_launcher(*a)()
    pg.gather_pair_launcher((*a, True), (*a, True))()
    assert compiles == [("single", True)] and len(compiled.calls) == 1
    assert calls == [("slow", 3)] * 3


def test_relaunch_with_equals_a_full_build_for_other_outputs_and_tables(fake):
    compiled, compiles = fake
    a, b = _seg(64 * 656, 4), _seg(64 * 132, 7)
    a2, b2 = _seg(64 * 656, 4)[:2], _seg(64 * 132, 7)[:2]  # another layer's pages and source table
    single = pg.gather_launcher(*a)
    pg.relaunch_with(single, [a2])()
    pg.gather_launcher(*a2, *a[2:])()
    pair = pg.gather_pair_launcher((*a, True), (*b, True))
    pg.relaunch_with(pair, [a2, b2])()
    pg.gather_pair_launcher((*a2, *a[2:], True), (*b2, *b[2:], True))()
    assert compiled.calls[0] == compiled.calls[1] and compiled.calls[2] == compiled.calls[3]
    assert compiled.calls[0][9] == a2[0].data_ptr() and compiled.calls[2][9 + 9] == b2[1].data_ptr()
    assert pg.relaunch_with(single, [a2, b2]) is None  # one segment, two targets


def test_block_config_splits_pages_into_units_and_keeps_its_own_compile(fake):
    """block: a page of 10,496 int32 elements in 3 units of 4,096 (one program each), compiled apart from the
    default; keys other than block / num_warps are refused (the measured and deleted variants' waves, load, store)."""
    compiled, compiles = fake
    out, bases, dest, src, page = _seg(64 * 656, 20)
    pg.gather_launcher(out, bases, dest, src, page, config={"block": 4096})()
    pg.gather_launcher(out, bases, dest, src, page)()
    pg.gather_launcher(out, bases, dest, src, page, config={"block": 4096, "num_warps": 8})()
    assert [c[:3] for c in compiled.calls] == [(60, 1, 1), (20, 1, 1), (60, 1, 1)]
    named = [dict(zip(pg.load().arg_names, c[9:])) for c in compiled.calls]
    assert [(x["n_units"], x["BLOCK"]) for x in named] == [(60, 4096), (20, 16384), (60, 4096)]
    assert len(compiles) == 2  # the third launch reuses the first one's kernel (8 warps is the default's)
    for bad in ({"waves": 2}, {"load": ".cg"}, {"store": ".cs"}):
        with pytest.raises(ValueError, match="expected keys among"):
            pg.gather_launcher(out, bases, dest, src, page, config=bad)
