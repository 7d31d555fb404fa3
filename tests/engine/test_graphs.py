"""The CUDA graphs' protocol on CPU (``cpkv.engine.graphs``): buckets, the fixed buffers and padding.

Off CUDA the pieces run eagerly through the same buffers and pad rows as a capture replays them, so these
tests check what the GPU test (tests/engine/test_graphs_gpu.py) cannot isolate: a batch of T tokens run as
its bucket's Tb rows gives the bytes of the layers run on T rows, whatever the pad rows hold (they are
poisoned with NaN here), and the engine gives the same logits with and without the graphs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cpkv.engine.graphs import LayerGraphs, bucket_of, buckets
from cpkv.model import load_model
from cpkv.model.ops import Rotary


def test_buckets_cover_every_count_with_bounded_padding():
    for top in (1, 16, 100, 128, 1000, 2048, 4096):
        sizes = buckets(top)
        assert sizes[-1] == top and list(sizes) == sorted(set(sizes))
        for t in range(1, top + 1):
            b = bucket_of(t, sizes)
            assert t <= b <= top
            assert b <= max(16, 2 * t - 1)                # under half a bucket of padding (16 at least)
            if t > 128 and b != top:
                assert 3 * (b - t) < b, (t, b)            # above 128: under a third
        assert bucket_of(top + 1, sizes) is None
    with pytest.raises(ValueError):
        buckets(0)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def _batch(model, t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(t, model.cfg.hidden_size, generator=gen)
    pos = torch.randperm(4 * t, generator=gen)[:t]
    return h, model.rotary(pos)


def _poison(g: LayerGraphs, t: int) -> None:
    """Every float buffer's rows past the batch's T: NaN (what a pad row holds must never reach a real one)."""
    for buf in (g.h, g.delta, g.latent, g.cos, g.sin, g.q, *g.out.values()):
        if buf.is_floating_point():
            buf[t:].fill_(float("nan"))


def _pad(x: torch.Tensor, tb: int) -> torch.Tensor:
    return torch.cat((x, x.new_zeros((tb - x.shape[0],) + tuple(x.shape[1:]))))


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """float32 within 1e-5 of the values' scale (CPU GEMMs round by their row count: one ulp or so, ~1e-6), bf16
    (the query) within one ulp more;
    uint8 rows and fp8 values (quantised from such values) equal but for the rare byte a one-ulp input moves."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if got.element_size() == 1:  # fp8 values: their bytes, as uint8 rows
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if got.is_floating_point():
        scale = float(want.abs().max()) + 1.0
        assert bool(torch.isfinite(got).all()), what
        rtol = 2 ** -7 if got.dtype == torch.bfloat16 else 0  # a bf16 result may round one ulp the other way
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-5 * scale, msg=what)
    else:
        assert (got != want).float().mean() <= 0.01, what


PIECE_FIELDS = ("q", "token", "index", "iq", "iw")


@pytest.mark.parametrize("t", [5, 16, 37, 100])
def test_pieces_over_a_bucket_give_the_layers_results_over_t_rows(tiny, t):
    """Every layer (full and shared indexer, dense MLP and MoE) through A and C over the bucket's Tb rows.

    - Clean pads (``begin``'s zeros): the buffers give exactly the bytes of the layer's own ``project`` and
      ``finish`` over the zero-padded Tb rows, layer after layer (the query written in place, delta carried to
      the next layer's norm, the shared layers' missing indexer rows).
    - Pads poisoned with NaN before every piece: the real rows stay finite and equal the layer run on the T rows
      alone, within CPU rounding (``_close``): nothing crosses from a pad row into a real one."""
    model = tiny
    clean, dirty = LayerGraphs(model, 128, capture=False), LayerGraphs(model, 128, capture=False)
    h, rot = _batch(model, t, t)
    tb = clean.begin(h, rot)
    assert dirty.begin(h, rot) == tb == bucket_of(t, clean.sizes) and tb >= t
    gen = torch.Generator().manual_seed(1000 + t)
    hp, rotp = _pad(h, tb), Rotary(_pad(rot.cos, tb), _pad(rot.sin, tb))  # the padded reference
    dp, delta = None, None
    kinds = set()
    for n, layer in enumerate(model.layers):
        kinds.add((layer.full, layer.is_moe))
        want_pad, want = layer.project(hp, rotp, dp), layer.project(h, rot, delta)
        got = clean.project(n, layer)
        _poison(dirty, t)
        dirty.h[:t].copy_(h)  # each piece from the reference's real rows: its own rounding only, not compounded
        if delta is not None:
            dirty.delta[:t].copy_(delta)
        bad = dirty.project(n, layer)
        for name in PIECE_FIELDS:
            a, b, w = getattr(got, name), getattr(bad, name), getattr(want, name)
            assert (a is None) == (b is None) == (w is None) == (name != "q" and name != "token" and not layer.full)
            if a is not None:
                assert torch.equal(a, getattr(want_pad, name)[:t]), name
                _close(b, w, f"layer {n} {name}")
        latent = torch.randn(t, model.cfg.num_heads, model.cfg.kv_lora_rank, generator=gen)
        hp, dp = layer.finish(want_pad.h, _pad(latent, tb))
        h, delta = layer.finish(want.h, latent)
        clean.finish(n, layer, latent)
        _poison(dirty, t)
        dirty.out["h"][:t].copy_(want.h)
        dirty.finish(n, layer, latent)
        got_h, got_d = clean.result()
        assert torch.equal(got_h, hp[:t]) and torch.equal(got_d, dp[:t])
        bad_h, bad_d = dirty.result()
        _close(bad_h, h, f"layer {n} h")
        _close(bad_d, delta, f"layer {n} delta")
    assert {(True, False), (True, True)} <= kinds  # the tiny model has dense and MoE layers
    assert clean.captured == 0 and clean.eager_runs == 2 * len(model.layers) and clean.batches == 1


def test_a_batch_past_the_buckets_is_refused(tiny):
    g = LayerGraphs(tiny, 32, capture=False)
    h, rot = _batch(tiny, 33, 0)
    assert g.bucket(33) is None and g.bucket(0) is None and g.bucket(32) == 32
    with pytest.raises(ValueError, match="33 tokens"):
        g.begin(h, rot)
    with pytest.raises(ValueError, match="CUDA"):
        LayerGraphs(tiny, 32, capture=True)


def test_pads_are_zeroed_at_each_batch(tiny):
    """begin: the batch's embedding and rotary rows in, the pad rows of those and of the latent zeroed (what a
    longer batch before left there is gone)."""
    g = LayerGraphs(tiny, 64, capture=False)
    h, rot = _batch(tiny, 50, 1)
    g.begin(h, rot)
    g.latent.fill_(3.0)
    h2, rot2 = _batch(tiny, 20, 2)
    assert g.begin(h2, rot2) == 32
    assert torch.equal(g.h[:20], h2) and torch.equal(g.cos[:20], rot2.cos) and torch.equal(g.sin[:20], rot2.sin)
    for buf in (g.h, g.cos, g.sin, g.latent):
        assert not buf[20:32].any()
    assert torch.equal(g.h[32:50], h[32:50])  # past the bucket: untouched (no piece reads it)


def test_a_buffer_first_made_after_a_capture_is_allowed_a_changed_one_is_not(tiny):
    """Under expert parallelism warm captures layer 0's A before the first MoE layer's R piece makes the exchange's
    buffers ('x', 'idx', ...): a buffer made for the first time then is fine (no graph holds its address; the GPU
    test failed on this in 2026-12-02's first call), one that would be replaced after a capture is an error."""
    g = LayerGraphs(tiny, 64, capture=False)
    g.capture, g.graphs[(0, "A", 64)] = True, object()  # as if a piece had been captured (no CUDA here)
    x = g._buffer("x", torch.zeros(4, 8))
    assert x.shape == (64, 8) and g._buffer("x", torch.ones(9, 8)) is x
    with pytest.raises(RuntimeError, match="'x' would change shape"):
        g._buffer("x", torch.zeros(4, 9))
    with pytest.raises(RuntimeError, match="'x' would change shape"):
        g._buffer("x", torch.zeros(4, 8, dtype=torch.int32))
    g.graphs.clear()  # nothing captured yet: the buffer is simply remade
    assert g._buffer("x", torch.zeros(4, 9)).shape == (64, 9)


def test_the_graphs_do_not_keep_their_model_alive():
    """``for_model``'s table is keyed weakly by the model: once the engine drops a model (a bench's next weights
    mode), its graphs and buffers go with it."""
    import gc
    import weakref

    from cpkv.engine.graphs import for_model

    model = load_model("tiny", seed=3)
    g = for_model(model, 32)
    assert for_model(model, 32) is g and for_model(model, 64) is not g
    ref, gref = weakref.ref(model), weakref.ref(for_model(model, 64))
    del model, g
    gc.collect()
    assert ref() is None and gref() is None


def test_graphs_are_on_by_default_only_on_cuda_at_fp8_precision():
    from cpkv.engine.config import GRAPH_TOKENS, default_graph_tokens

    assert default_graph_tokens("cuda", None) == default_graph_tokens("cuda", None, "fp8") == GRAPH_TOKENS == 1024
    assert default_graph_tokens("cuda", None, "exact") == default_graph_tokens("cpu", None) == 0
    assert default_graph_tokens("cpu", 64) == 64 and default_graph_tokens("cuda", 0) == 0


def test_bad_graph_tokens_is_a_config_error():
    from cpkv.engine.config import EngineConfig
    from cpkv.errors import ConfigError

    for bad in (-1, 1 << 17, 2.5):
        with pytest.raises(ConfigError, match="graph_tokens"):
            EngineConfig(graph_tokens=bad)
    assert EngineConfig(graph_tokens=256).graph_tokens == 256


@pytest.mark.slow
def test_engine_logits_are_the_same_through_the_graphs_buffers():
    """cp 2 (the MoE layers under expert parallelism: their C pieces run eagerly over T rows) and cp 1 (every
    piece through the buffers): with graph_tokens the engine gives the logits it gives without, and reports the
    batches that went through the buffers."""
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_jobs
    from cpkv.scheduler.trace import TraceRequest

    trace = [TraceRequest("a0", 0.0, 150), TraceRequest("b0", 0.0, 90), TraceRequest("a1", 0.0, 170, None, "a0"),
             TraceRequest("a2", 0.0, 181, None, "a1")]
    base = EngineConfig(page_size=16, pages_per_rank=128, chunk_size=256, max_requests=4)
    for cp in (2, 1):
        cfg = dataclasses.replace(base, cp=cp)
        off, on = run_jobs([(cfg, trace), (dataclasses.replace(cfg, graph_tokens=96), trace)], timeout_s=300)
        assert [r.id for r in on.requests] == [r.id for r in off.requests] == ["a0", "b0", "a1", "a2"]
        for a, b in zip(off.requests, on.requests):
            # cp 2: the graphs' batches equal at every byte here; cp 1 runs the MoE over pad rows as well, and CPU
            # GEMMs round by their row count (~1e-6 on logits of order 3)
            if cp == 2:
                assert torch.equal(a.logits, b.logits), a.id
            torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-4)
            assert a.first_token == b.first_token
        assert off.stats["graphs_per_rank"] == [None] * cp
        for st in on.stats["graphs_per_rank"]:
            # the hits' new tokens (20 and 11 at cp 1) fit the buckets; the cold prompts do not at cp 1
            assert st["max_tokens"] == 96 and st["batches"] >= 2 and st["captured"] == 0
            assert st["eager_pieces"] >= 2 * 2 * st["batches"] and st["buffer_bytes"] > 0
