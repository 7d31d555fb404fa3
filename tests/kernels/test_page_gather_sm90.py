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
