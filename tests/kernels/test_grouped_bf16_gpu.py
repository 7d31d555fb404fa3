"""GPU tests of the warp-specialised grouped GEMM with bf16 operands (``kernels/fp8_gemm/gluon_ws.py`` without
scales; skip without a Hopper GPU and Gluon): every switch against a float32 reference of the same bf16 operands
on ragged loads (empty experts, a single row, experts past one tile, padding rows that must stay untouched), the
TMA and register epilogues giving the same bytes, and the expert MLP it runs for bf16 weights
(``model.experts.grouped_swiglu``) against the float32 loop and against ``torch._grouped_mm`` (an independent
implementation), without a host sync.

Tolerances: a GEMM's output is bf16 (8 significant bits) of a float32 accumulation: 1e-2 of its largest
|reference| value; the whole SwiGLU (gate_up and the SwiGLU output rounded to bf16 on the way) 2e-2.
"""
from __future__ import annotations

import pytest
import torch
from sync_free import twice_sync_free

from cpkv.model.experts import ExpertWeights, grouped_swiglu, grouped_swiglu_loop

pytestmark = [pytest.mark.cuda, pytest.mark.triton]

GEMM_TOL, SWIGLU_TOL = 1e-2, 2e-2
BF = torch.bfloat16
# rows per expert: empty experts, one row, a 64-row half, experts over one and two 128-row tiles
COUNTS = [64, 0, 191, 128, 1, 63, 65, 0, 320, 127]


def _gluon():
    from cpkv.kernels import platform

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or not platform.gluon_importable():
        pytest.skip("needs a Hopper GPU and Gluon")
    from cpkv.kernels.fp8_gemm import gluon_ws

    return gluon_ws


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) / max(float(want.abs().max()), 1e-30)


def _randn(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(BF)


def _ref(a: torch.Tensor, offs: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 per-expert products of the bf16 operands; rows past offs[-1] zero."""
    out = torch.zeros(a.shape[0], b.shape[1], device="cuda")
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end].float() @ b[e].float().T
        start = end
    return out


@pytest.mark.parametrize("wide,inflight,stages,group_m", [
    (False, False, 4, 1), (False, True, 6, 8), (False, True, 2, 1), (True, False, 3, 8), (True, True, 2, 8),
    (True, True, 3, 1)])
@pytest.mark.parametrize("n,k", [(512, 512), (384, 1024), (768, 256)])
def test_bf16_grouped_gemm_equals_float32_reference(wide, inflight, stages, group_m, n, k):
    """c = the per-expert product within 1e-2; the padding rows and everything outside c's view untouched; a c
    whose rows are not 16-byte aligned (the register epilogue) gets the same bytes. N 384: WIDE falls back to
    128-column tiles."""
    gluon_ws = _gluon()
    from cpkv.kernels.fp8_gemm.triton import tile_ends

    pad = 13
    e, rows = len(COUNTS), sum(COUNTS) + pad
    a = _randn((rows, k), 1)
    b = _randn((e, n, k), 2, k ** -0.5)
    offs = torch.tensor(COUNTS, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    big = torch.full((rows + 5, n + 192), 3.0, dtype=BF, device="cuda")
    c = big[2:2 + rows, 64:64 + n]
    sw = {"stages": stages, "wide": wide, "inflight": inflight, "group_m": group_m, "epi_tma": True}
    gluon_ws.launch(a, None, offs, b, None, c, tile_ends(offs, 128), **sw)
    done = sum(COUNTS)
    assert _rel(c[:done], _ref(a, offs, b)[:done]) <= GEMM_TOL
    assert bool((c[done:] == 3.0).all())
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[2:2 + rows, 64:64 + n] = False
    assert bool((big[outside] == 3.0).all())
    odd = torch.full((rows, n + 1), 3.0, dtype=BF, device="cuda")[:, :n]
    assert not gluon_ws.tma_epilogue_applies(odd)
    gluon_ws.launch(a, None, offs, b, None, odd, tile_ends(offs, 128), **sw)
    assert torch.equal(odd, c)


def test_bf16_grouped_gemm_refuses_scales_and_takes_no_rows():
    gluon_ws = _gluon()
    from cpkv.kernels.fp8_gemm.triton import tile_ends

    a, b = _randn((8, 256), 3), _randn((2, 128, 256), 4)
    offs = torch.tensor([3, 8], dtype=torch.int32, device="cuda")
    c = torch.empty(8, 128, dtype=BF, device="cuda")
    with pytest.raises(ValueError, match="take no scales"):
        gluon_ws.launch(a, torch.ones(8, 2, device="cuda"), offs, b, None, c, tile_ends(offs, 128))
    with pytest.raises(ValueError, match="both alike"):
        gluon_ws.launch(a, None, offs, b.float(), None, c, tile_ends(offs, 128))
    none = torch.zeros(2, dtype=torch.int32, device="cuda")
    c.fill_(3.0)
    gluon_ws.launch(a, None, none, b, None, c, tile_ends(none, 128), **gluon_ws.BF16)
    assert bool((c == 3.0).all())


@pytest.mark.parametrize("counts", [[5, 0, 130, 1, 0, 64, 3, 0], [0, 0, 0, 257, 0, 0, 0, 0], [104] * 8])
def test_grouped_swiglu_bf16_equals_loop_and_grouped_mm_without_host_sync(counts):
    """GLM-5 expert shapes (D 6144, I 2048), 8 local bf16 experts: ``grouped_swiglu`` (the Gluon kernel) against
    the float32 loop over the same bf16 weights and against ``torch._grouped_mm`` with the same SwiGLU kernel
    between its GEMMs; the second call under torch's sync debug mode (no device->host synchronisation)."""
    _gluon()
    from cpkv.model import experts

    e, d, i = len(counts), 6144, 2048
    ew = ExpertWeights(_randn((e, 2 * i, d), 5, d ** -0.5), _randn((e, d, i), 6, i ** -0.5))
    rows = sum(counts) + 5
    xs = _randn((rows, d), 7)
    rw = torch.rand(rows, device="cuda")
    offs = torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    got = twice_sync_free(lambda: grouped_swiglu(xs, offs, rw, ew))
    done = sum(counts)
    f32 = ExpertWeights(ew.gate_up.float(), ew.down.float())
    want = grouped_swiglu_loop(xs.float(), offs, rw, f32)
    assert _rel(got[:done], want[:done]) <= SWIGLU_TOL
    peer = experts._grouped(xs, offs, rw, ew)  # torch._grouped_mm both ways
    assert _rel(got[:done], peer[:done]) <= SWIGLU_TOL
    out = torch.full((rows, d), 3.0, dtype=BF, device="cuda")
    assert grouped_swiglu(xs, offs, rw, ew, out=out) is out
    assert torch.equal(out[:done], got[:done]) and bool((out[done:] == 3.0).all())
