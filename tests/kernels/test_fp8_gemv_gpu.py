"""GPU tests of the fp8 GEMV (``cpkv.kernels.fp8_gemm.gemv``; skip without CUDA or Triton) at GLM-5's decode shapes:
against ``torch._scaled_mm`` on the same quantised operands and against their float64 product; the same bytes run
to run, from both reductions and for a row alone or in a batch; replayed inside a CUDA graph with no host sync;
the fp8 linears' dispatch under ``CPKV_FP8_GEMV``.

Tolerances: outputs are bfloat16 (8 significant bits) of float32 accumulations whose per-group dots run on fp8
tensor cores (their accumulator keeps fewer bits than float32): the largest error is held to 1e-2 of the largest
|reference| (the suite's GEMM tolerance, test_fp8_gemm_gpu.py) against both references, and the root mean square
error to 2^-8 of the reference's (bfloat16 rounding alone gives about 2^-10.8).
"""
from __future__ import annotations

import pytest
import torch
from sync_free import twice_sync_free

from cpkv.kernels import platform
from cpkv.kernels.fp8_gemm import gemv as gv
from cpkv.kernels.fp8_gemm.ref import act_dequant_ref, dequant_blocks
from cpkv.kernels.platform import Backends
from cpkv.model import linear as lin
from cpkv.model.weights import quant_fp8_blocks

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)

GEMM_TOL, RMS_TOL = 1e-2, 2.0 ** -8
# (name, N, K) of GLM-5's fp8 linears in a decode step (cpkv.model.layer: LINEARS and the MLPs); qkv_a: q_a, kv_a and
# the indexer's wk stacked (one read of the normed input)
GLM5 = [("q_a", 2048, 6144), ("kv_a", 576, 6144), ("wk", 128, 6144), ("qkv_a", 2752, 6144), ("q_b", 16384, 2048),
        ("wq_b", 4096, 2048), ("o_proj", 6144, 16384), ("gate_up", 24576, 6144), ("down", 6144, 12288),
        ("shared_gate_up", 4096, 6144), ("shared_down", 6144, 2048)]
ROWS = (1, 4, 8, 16, 32, 64)
GEMV = Backends(triton=True, fp8_gemv_rows=gv.MAX_ROWS)
CUBLAS = Backends(triton=True, fp8_gemv_rows=0)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return quant_fp8_blocks(torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5)


def _act(m: int, k: int, seed: int) -> lin.QuantAct:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    x[0, :128] = 0  # a zero group: scale 0
    return lin.quant_act(x, GEMV)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest |got - want| / largest |want|, rms(got - want) / rms(want))."""
    d, w = got.double() - want.double(), want.double()
    return float(d.abs().max() / w.abs().max()), float(d.pow(2).mean().sqrt() / w.pow(2).mean().sqrt())


@pytest.mark.parametrize("name,n,k", GLM5)
def test_gemv_matches_scaled_mm_and_the_float64_product(name, n, k):
    w, ws = _weight(n, k, n + k)
    dense = dequant_blocks(w, ws, torch.float64)
    tickets = gv.new_tickets(n, "cuda")
    for m in ROWS:
        x = _act(m, k, m)
        got = gv.gemv(x.q, x.s, w, ws, tickets=tickets)
        cublas = lin._scaled_mm(x, w, ws)
        exact = act_dequant_ref(x.q, x.s).double() @ dense.t()
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        for want, what in ((exact, "float64"), (cublas, "_scaled_mm")):
            big, rms = _errors(got, want)
            assert big <= GEMM_TOL and rms <= RMS_TOL, f"{name} M {m} vs {what}: max {big:.2e}, rms {rms:.2e}"
    assert int(tickets.abs().sum()) == 0


@pytest.mark.parametrize("name,n,k,m", [("kv_a", 576, 6144, 1), ("o_proj", 6144, 16384, 4), ("q_b", 16384, 2048, 32)])
def test_every_swept_config_is_correct(name, n, k, m):
    """Each config ``cpkv bench gemv --sweep`` times (other tiles, stages, waves, warps, the reduce kernel, pointer
    loads) within the tolerances of the float64 product."""
    from cpkv.bench.gemv import sweep_configs

    w, ws = _weight(n, k, 9)
    x = _act(m, k, 10)
    exact = act_dequant_ref(x.q, x.s).double() @ dequant_blocks(w, ws, torch.float64).t()
    for cname, cfg in sweep_configs().items():
        big, rms = _errors(gv.gemv(x.q, x.s, w, ws, cfg=cfg), exact)
        assert big <= GEMM_TOL and rms <= RMS_TOL, f"{name} M {m} {cname}: max {big:.2e}, rms {rms:.2e}"


def test_gemv_is_deterministic_and_batch_invariant():
    """o_proj (split over K, both reductions): two runs and the two reductions give the same bytes, the counters
    are left zeroed, and each row alone gives the bytes it has in a batch of 8 (both BM 16)."""
    w, ws = _weight(6144, 16384, 1)
    x = _act(8, 16384, 2)
    assert gv.plan(8, 6144, 16384, platform.sm_count(w)).split > 1
    tickets = gv.new_tickets(6144, "cuda")
    y = gv.gemv(x.q, x.s, w, ws, tickets=tickets)
    assert torch.equal(gv.gemv(x.q, x.s, w, ws, tickets=tickets), y)
    assert torch.equal(gv.gemv(x.q, x.s, w, ws, cfg=gv.GemvConfig(reduce="reduce")), y)
    assert int(tickets.abs().sum()) == 0
    for r in range(8):
        assert torch.equal(gv.gemv(x.q[r:r + 1], x.s[r:r + 1], w, ws, tickets=tickets), y[r:r + 1]), r


def test_tma_and_pointer_loads_give_the_same_bytes():
    """The same operands reach the same wgmmas whether loaded as TMA boxes or by pointer loads."""
    w, ws = _weight(4096, 6144, 11)
    x = _act(5, 6144, 12)
    assert torch.equal(gv.gemv(x.q, x.s, w, ws, cfg=gv.GemvConfig(tma=False)), gv.gemv(x.q, x.s, w, ws))


def test_gemv_makes_no_host_sync():
    w, ws = _weight(6144, 16384, 3)
    x = _act(4, 16384, 4)
    tickets = gv.new_tickets(6144, "cuda")
    y = twice_sync_free(lambda: gv.gemv(x.q, x.s, w, ws, tickets=tickets))
    assert torch.equal(y, gv.gemv(x.q, x.s, w, ws, tickets=tickets))


def _decode_chain(layers: dict, x: torch.Tensor) -> torch.Tensor:
    """A decode-like chain of fp8 linears through the dispatch point: q_a -> q_b, o_proj on q_b's first 16384
    columns, the dense MLP (gate_up, SwiGLU + quantisation, down)."""
    qa = layers["q_a"](layers["q_a"].quantised_input(x))
    qb = layers["q_b"](qa)
    o = layers["o_proj"](qb)
    return lin.swiglu(o, layers["gate_up"], layers["down"])


@pytest.mark.parametrize("m", [1, 8])
def test_a_captured_chain_replays_as_it_runs_eagerly(m):
    """A chain of Linears (the GEMV chosen for them, each with its own counters) captured in a CUDA graph after a
    warm-up: replays with new inputs give the eager bytes; the counters stay zeroed across replays."""
    shapes = {"q_a": (2048, 6144), "q_b": (16384, 2048), "o_proj": (6144, 16384), "gate_up": (24576, 6144),
              "down": (6144, 12288)}
    layers = {name: lin.Linear(*_weight(n, k, n + k), GEMV) for name, (n, k) in shapes.items()}
    assert all(layer.tickets is not None for layer in layers.values())
    gen = torch.Generator(device="cuda").manual_seed(5)
    static = torch.randn(m, 6144, generator=gen, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _decode_chain(layers, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_chain(layers, static)
    for seed in (6, 7):
        x = torch.randn(m, 6144, generator=gen.manual_seed(seed), device="cuda").to(torch.bfloat16)
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _decode_chain(layers, x)), seed
    assert all(int(layer.tickets.abs().sum()) == 0 for layer in layers.values())


def test_dispatch_follows_the_env(monkeypatch):
    """CPKV_FP8_GEMV resolved on CUDA: auto sends 1 .. FP8_GEMV_AUTO_ROWS rows to the GEMV (its bytes) and more to
    ``_scaled_mm`` (its bytes); off sends every row count to ``_scaled_mm``."""
    from cpkv.config import FP8_GEMV_AUTO_ROWS

    w, ws = _weight(4096, 2048, 8)
    for choice, gemv_rows in (("auto", FP8_GEMV_AUTO_ROWS), ("off", 0)):
        monkeypatch.setenv("CPKV_FP8_GEMV", choice)
        layer = lin.Linear(w, ws, platform.resolve("cuda"))
        assert layer.backends.fp8_gemv_rows == gemv_rows
        for m in (1, FP8_GEMV_AUTO_ROWS, FP8_GEMV_AUTO_ROWS + 1):
            x = _act(m, 2048, m)
            want = gv.gemv(x.q, x.s, w, ws) if m <= gemv_rows else lin._scaled_mm(x, w, ws)
            assert torch.equal(layer(x), want), (choice, m)
