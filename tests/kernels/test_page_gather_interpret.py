"""The page gather kernel (single and two-segment, at every swept block and a sub-page one) equals the reference
byte for byte in Triton's interpreter (CPU): zero fill, SKIP rows left as they were, odd page sizes (16-byte, 4-byte
and byte paths), pages split into several units, empty input. A subprocess: the interpreter is chosen at import.
Skipped without Triton."""
from __future__ import annotations

import textwrap

import pytest
from interpreted import run_interpreted

pytest.importorskip("triton")

_INTERPRET = r'''
import torch
from fused_cases import patch_interpreter_index  # (tests/kernels, on the subprocess's path)

patch_interpreter_index()  # numpy >= 2.3 refuses int() of a 1-element array: loop bounds need the element

from cpkv.bench.compose import GATHER_CONFIGS
from cpkv.kernels.page_gather import triton as pg
from cpkv.kernels.page_gather.ref import SKIP, page_gather_ref

# every swept block once (warps do not change the interpreter's result), and a block small enough that a page is
# several units (sub-page blocks, masked tails)
shapes = {}
for c in GATHER_CONFIGS:
    shapes.setdefault(c["block"], dict(c))
CONFIGS = list(shapes.values()) + [{"block": 64, "num_warps": 4}]
g = torch.Generator().manual_seed(0)


def case(page_bytes, n, n_out=12, n_src=2, pool=9):
    srcs = [torch.randint(0, 256, (pool, page_bytes), dtype=torch.uint8, generator=g) for _ in range(n_src)]
    bases = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.int64)
    dest = torch.randperm(n_out, generator=g)[:n].to(torch.int32)
    src = torch.tensor([0, 1, -1, SKIP, 1, 0, SKIP, -1, 1][:n], dtype=torch.int32)
    page = torch.randint(0, pool, (n,), generator=g).to(torch.int64)
    init = torch.randint(0, 256, (n_out, page_bytes), dtype=torch.uint8, generator=g)
    want = init.clone()
    page_gather_ref(want, srcs, dest, src, page)
    return srcs, bases, dest, src, page, init, want


checked = 0
for page_bytes in (41984 // 16, 132, 8448 // 64, 6, 20, 48):  # 16-byte, 4-byte and byte paths
    for n in (9, 1):
        srcs, bases, dest, src, page, init, want = case(page_bytes, n)
        for cfg in CONFIGS:
            out = init.clone()
            pg.page_gather_triton(out, bases, dest, src, page, config=cfg)
            assert torch.equal(out, want), (page_bytes, n, cfg, (out != want).nonzero()[:4].tolist())
            checked += 1
# empty input: nothing launched, nothing written
srcs, bases, dest, src, page, init, want = case(48, 3)
out = init.clone()
for cfg in CONFIGS:
    pg.page_gather_triton(out, bases, dest[:0], src[:0], page[:0], config=cfg)
assert torch.equal(out, init)
print("ok", checked)
'''


@pytest.mark.triton
def test_gather_equals_the_reference_in_the_interpreter():
    res = run_interpreted(["-c", textwrap.dedent(_INTERPRET)])
    assert res.returncode == 0 and res.stdout.strip().startswith("ok"), res.stderr[-3000:]
