"""GPU: the Triton page gather against its torch reference, and the compose check on CUDA ranks."""
from __future__ import annotations

import pytest
import torch

from cpkv.kernels.page_gather.ref import page_gather_ref

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)

PAGE_BYTES = [64 * 656, 64 * 132, 16 * 196, 196, 132, 3]
SHAPES = [{"block": 16384, "num_warps": 16}, {"block": 512, "num_warps": 4}]  # besides the default


def _case(page_bytes, n, seed, offset=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sizes = [37, 5, 64]
    raw = [torch.randint(0, 256, (s * page_bytes + offset,), dtype=torch.uint8, device="cuda", generator=g)
           for s in sizes]
    sources = [r[offset:].view(s, page_bytes) for r, s in zip(raw, sizes)]
    src = torch.randint(-2, len(sizes), (n,), device="cuda", generator=g, dtype=torch.int32)  # -1 zeros, -2 skip
    page = torch.stack([torch.randint(0, sizes[max(int(s), 0)], (), device="cuda", generator=g) for s in src]).long()
    dest = torch.randperm(n, device="cuda", generator=g).to(torch.int32)
    bases = torch.tensor([s.data_ptr() for s in sources], dtype=torch.int64, device="cuda")
    return sources, bases, dest, src, page


@pytest.mark.parametrize("page_bytes", PAGE_BYTES)
@pytest.mark.parametrize("config", [None, {"block": 2048, "num_warps": 8}, *SHAPES])
def test_triton_gather_matches_reference(page_bytes, config):
    from cpkv.kernels.page_gather.triton import page_gather_triton
    sources, bases, dest, src, page = _case(page_bytes, 300, seed=page_bytes)
    want = torch.full((300, page_bytes), 0xEE, dtype=torch.uint8, device="cuda")
    got = want.clone()
    page_gather_ref(want, sources, dest, src, page)
    page_gather_triton(got, bases, dest, src, page, config=config)
    assert torch.equal(got, want)
    for seed in (1, 2):  # later launches take the direct (already compiled) path: fresh data each time
        for s in sources:
            s.random_(0, 256)
        page_gather_ref(want, sources, dest, src, page)
        got.fill_(0xEE)
        page_gather_triton(got, bases, dest, src, page, config=config)
        assert torch.equal(got, want)


@pytest.mark.parametrize("page_bytes", [64 * 656, 16 * 196, 132])
@pytest.mark.parametrize("config", [None, SHAPES[1]])
def test_prepared_launcher_matches_reference(page_bytes, config):
    """gather_launcher: resolved once, then each call gathers the sources' current bytes, on the current stream."""
    from cpkv.kernels.page_gather.triton import gather_launcher
    sources, bases, dest, src, page = _case(page_bytes, 200, seed=page_bytes + 1)
    want = torch.full((200, page_bytes), 0xEE, dtype=torch.uint8, device="cuda")
    got = want.clone()
    launch = gather_launcher(got, bases, dest, src, page, config=config)
    side = torch.cuda.Stream()
    for it in range(3):
        for s in sources:
            s.random_(0, 256)
        page_gather_ref(want, sources, dest, src, page)
        got.fill_(0xEE)
        if it == 2:  # on another stream: the launch follows the current stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                launch()
            torch.cuda.current_stream().wait_stream(side)
        else:
            launch()
        assert torch.equal(got, want)


@pytest.mark.parametrize("page_bytes", [64 * 132, 16 * 196])
@pytest.mark.parametrize("config", [None, SHAPES[0]])
def test_triton_gather_unaligned_sources(page_bytes, config):
    from cpkv.kernels.page_gather.triton import page_gather_triton
    sources, bases, dest, src, page = _case(page_bytes, 100, seed=7, offset=4)
    want = torch.full((100, page_bytes), 0xEE, dtype=torch.uint8, device="cuda")
    got = want.clone()
    page_gather_ref(want, sources, dest, src, page)
    page_gather_triton(got, bases, dest, src, page, aligned16=False, config=config)
    assert torch.equal(got, want)


def test_compose_check_on_cuda_ranks():
    from cpkv.bench.check import CheckConfig, run_check
    out = run_check(CheckConfig(cp=2, device="cuda", batches=3, page_size=16, layers=2))
    assert out["ok"], out["modes"]
