"""The prepared gather launchers' host logic (argument order, grid, caching, fallbacks), with the compiled
kernel replaced by a recorder: runs wherever Triton imports, no GPU needed (CI without Triton skips it)."""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from cpkv.kernels.page_gather import triton as pg  # noqa: E402



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

    monkeypatch.setattr(pg._Launch, "jit", compile_single)
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


def test_small_pages_get_a_program_each_at_the_default_block(fake):
    """An index page (8,448 bytes: 2,112 int32 elements) takes one program at DEFAULT_CONFIG: the block shrinks to
    the page's power of two, so compose's launch for each kind has a program per page."""
    compiled, _ = fake
    out, bases, dest, src, page = _seg(64 * 132, 7)
    pg.gather_launcher(out, bases, dest, src, page)()
    named = dict(zip(pg.load().arg_names, compiled.calls[0][9:]))
    assert compiled.calls[0][:3] == (7, 1, 1) and (named["n"], named["n_units"]) == (7, 7)
    assert [named[x] for x in ("PAGE_ELEMS", "BLOCK")] == [64 * 132 // 4, 4096]
    pg.gather_launcher(*_seg(64 * 656, 4), config={"block": 4096})()  # a token page in 4096-element units: 3 each
    assert compiled.calls[-1][:3] == (12, 1, 1)


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
    pg.gather_launcher(*a)()  # a direct launch
    monkeypatch.setattr(pg, "FAST_LAUNCH", [False])
    for _ in range(3):
        pg.gather_launcher(*a)()  # through page_gather_triton
    assert compiles == [("single", True)] and len(compiled.calls) == 1
    assert calls == [("slow", 3)] * 3


def test_relaunch_with_equals_a_full_build_for_other_outputs_and_tables(fake):
    compiled, compiles = fake
    a, b = _seg(64 * 656, 4), _seg(64 * 132, 7)
    a2, b2 = _seg(64 * 656, 4)[:2], _seg(64 * 132, 7)[:2]  # another layer's pages and source table
    single = pg.gather_launcher(*a)
    pg.relaunch_with(single, *a2)()
    pg.gather_launcher(*a2, *a[2:])()
    index = pg.gather_launcher(*b)  # the other kind: its own page size and grid
    pg.relaunch_with(index, *b2)()
    pg.gather_launcher(*b2, *b[2:])()
    assert compiled.calls[0] == compiled.calls[1] and compiled.calls[2] == compiled.calls[3]
    assert compiled.calls[0][9] == a2[0].data_ptr() and compiled.calls[2][9 + 1] == b2[1].data_ptr()
    assert compiled.calls[2][:3] == (7, 1, 1)
    assert pg.relaunch_with(single, *b2) is None  # another page size
    assert pg.relaunch_with(pg._noop, *a2) is None  # not a direct launch


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
