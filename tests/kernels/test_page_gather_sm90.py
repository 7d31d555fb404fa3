"""The page gather kernel compiled OFFLINE for sm_90a (Triton's bundled ptxas / cuobjdump, no GPU): the default
config and the smallest swept block move their data in 16-byte vectors (LDG/STG .128, as many as designed),
spill nothing and carry no cache hints. Skipped without Triton or its NVIDIA tools."""
from __future__ import annotations

import re

import pytest
import torch
from offline_sm90 import compile_sm90, ptxas_and_sass

pytest.importorskip("triton")

from cpkv.bench.compose import GATHER_CONFIGS  # noqa: E402
from cpkv.kernels.page_gather import triton as pg  # noqa: E402

TOKEN_PAGE = 64 * 656  # GLM-5's token pages: 10,496 int32 elements, one 16,384-element unit at most
# the default and the smallest swept block (a page in several units; the other swept configs are the same kernel
# at another block or warp count)
KEPT = [GATHER_CONFIGS[0], min(GATHER_CONFIGS, key=lambda c: c["block"])]


def _compile_sm90(config: dict, page_bytes: int):
    """The single-segment kernel for ``config`` as a launch at ``page_bytes`` would specialise it."""
    idx = torch.zeros(4096, dtype=torch.int32)
    launch = pg._Launch(torch.empty(2, page_bytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64), idx, idx,
                        idx, True, config)
    fn, a = pg.load(), launch.args
    args = (*a[:5], 1 << 20, 4095, 3 * 4095, *a[8:])  # any address, entry and unit counts (none == 1 or % 16)
    consts = {name: a[i] for i, name in enumerate(fn.arg_names) if i >= 8}
    return launch, compile_sm90(fn, args, consts, num_warps=launch.warps)


@pytest.mark.triton
@pytest.mark.parametrize("config", KEPT, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_gather_compiles_for_sm90_with_16_byte_vectors(config, tmp_path):
    launch, ck = _compile_sm90(config, TOKEN_PAGE)
    report, sass = ptxas_and_sass(ck, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    loads, stores = re.findall(r"\bLDG\.E\S*\.128\b", sass), re.findall(r"\bSTG\.E\S*\.128\b", sass)
    threads = launch.warps * 32
    vecs = min(launch.args[11], 16384) // (threads * 4)  # 16-byte vectors per thread per unit
    # one unit, straight line; the zero fill has its own stores
    assert (len(loads), len(stores)) == (vecs, 2 * vecs), sass
    assert all(x.endswith(".128") for x in re.findall(r"\bSTG\.E\S*", sass))  # no narrower stores
    assert not re.search(r"\b(STL|LDL)\b", sass)
    assert not any(".EF." in x for x in loads + stores)  # plain 128-bit loads and stores: no cache hints


@pytest.mark.triton
def test_pair_kernel_keeps_the_small_pages_occupancy(tmp_path):
    """The two-segment kernel (compose's per-layer launch, GLM-5's token and index pages) at PAIR_CONFIG: its
    registers are its larger segment's; at PAIR_CONFIG's 4096-element units they stay at the index pages' level
    (8 programs of 8 warps an SM), where the single-kind default's 16384 needed 80 (3 programs an SM: the pair ran
    at 0.82 of copy_, BENCHMARKS.md session 14)."""
    idx = torch.zeros(4096, dtype=torch.int32)
    segs = [(torch.empty(2, pb, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64), idx, idx, idx, True)
            for pb in (TOKEN_PAGE, 64 * 132)]
    _, args, _, kw = pg._pair(*segs, None)
    fn = pg.load_pair()
    args = list(args)
    for at in (5, 13):  # out_addr of each segment: any address
        args[at] = 1 << 20
    consts = {k: v for k, v in kw.items() if k != "num_warps"}
    assert len(args) == len(fn.arg_names)  # the signature's order, constexprs included
    ck = compile_sm90(fn, tuple(args), consts, num_warps=kw["num_warps"])
    report, sass = ptxas_and_sass(ck, tmp_path)
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    assert kw["BLOCK0"] == kw["BLOCK1"] == pg.PAIR_CONFIG["block"] == 4096 and kw["num_warps"] == 8
    assert regs * 32 * kw["num_warps"] * 8 <= 65536, report  # 8 programs of 8 warps fit an SM's register file
    assert "0 bytes spill stores" in report and not re.search(r"\b(STL|LDL)\b", sass)
