"""GPU: the layers' pieces captured as CUDA graphs and replayed (``cpkv.engine.graphs``).

A replay must give the bytes the same pieces give run eagerly over the same buffers (same kernels, same
shapes): a graph that kept a stale address, or missed a launch, shows here. The engine with graphs must run
with no device->host synchronisation, replay every piece once warmed up, and give the reference's logits.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)

FIELDS = ("q", "token", "index", "iq", "iw")


def test_replays_give_the_eager_pieces_bytes_batch_after_batch():
    """The tiny model (dense and MoE layers, full and shared indexer layers) on the GPU: batches of 37, 100, 37,
    20 and 100 tokens (buckets 64, 128, 64, 32, 128) through a capturing LayerGraphs and an eager one fed the same
    inputs. The first batch of a bucket runs eagerly and captures; the later ones replay on new data. Every
    piece's results are equal byte for byte, every batch."""
    from cpkv.engine.graphs import LayerGraphs
    from cpkv.model import load_model

    model = load_model("tiny", seed=0, device="cuda")
    cap, ref = LayerGraphs(model, 128), LayerGraphs(model, 128, capture=False)
    assert cap.capture and not ref.capture
    gen = torch.Generator(device="cuda").manual_seed(0)
    cfg, layers = model.cfg, len(model.layers)
    seen = set()
    for k, t in enumerate((37, 100, 37, 20, 100)):
        h = torch.randn(t, cfg.hidden_size, generator=gen, device="cuda").to(model.dtype)
        rot = model.rotary(torch.randint(0, 8192, (t,), generator=gen, device="cuda"))
        tb = cap.begin(h, rot)
        assert ref.begin(h, rot) == tb
        for n, layer in enumerate(model.layers):
            a, b = cap.project(n, layer), ref.project(n, layer)
            for name in FIELDS:
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None)
                if x is not None:
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (k, t, n, name)
            latent = torch.randn(t, cfg.num_heads, cfg.kv_lora_rank, generator=gen, device="cuda").to(torch.bfloat16)
            cap.finish(n, layer, latent)
            ref.finish(n, layer, latent)
            for x, y in zip(cap.result(), ref.result()):
                assert torch.equal(x, y), (k, t, n)
                assert bool(torch.isfinite(x).all())
        seen.add(tb)
        assert cap.captured == 2 * layers * len(seen)
    assert cap.eager_runs == 2 * layers * len(seen) and cap.batches == 5


def test_warm_captures_every_bucket_and_batches_then_only_replay():
    """``warm``: every layer's A and C at every bucket captured before any batch (each run once eagerly on the
    buffers' scratch first); batches after it run no piece eagerly and give the eager pieces' bytes."""
    from cpkv.engine.graphs import LayerGraphs
    from cpkv.model import load_model

    model = load_model("tiny", seed=1, device="cuda")
    cap, ref = LayerGraphs(model, 64), LayerGraphs(model, 64, capture=False)
    layers = len(model.layers)
    assert cap.sizes == (16, 32, 64)
    assert cap.warm() == 2 * layers * 3 == cap.captured == cap.eager_runs and cap.warm_s > 0
    assert ref.warm() == 0 and ref.captured == 0
    gen = torch.Generator(device="cuda").manual_seed(1)
    cfg = model.cfg
    for t in (20, 64, 3):
        h = torch.randn(t, cfg.hidden_size, generator=gen, device="cuda").to(model.dtype)
        rot = model.rotary(torch.arange(t, device="cuda") * 7)
        assert cap.begin(h, rot) == ref.begin(h, rot)
        for n, layer in enumerate(model.layers):
            a, b = cap.project(n, layer), ref.project(n, layer)
            assert torch.equal(a.q, b.q) and torch.equal(a.token, b.token), (t, n)
            latent = torch.randn(t, cfg.num_heads, cfg.kv_lora_rank, generator=gen, device="cuda").to(torch.bfloat16)
            cap.finish(n, layer, latent)
            ref.finish(n, layer, latent)
            assert all(torch.equal(x, y) for x, y in zip(cap.result(), ref.result())), (t, n)
    assert cap.eager_runs == 2 * layers * 3 and cap.batches == 3


def _trace():
    from cpkv.scheduler.trace import TraceRequest

    # cold prompts past the buckets (eager), then turns whose new tokens fit them (graphs)
    return [TraceRequest("a0", 0.0, 3000), TraceRequest("b0", 0.0, 2500), TraceRequest("a1", 0.0, 3150, None, "a0"),
            TraceRequest("b1", 0.0, 2600, None, "b0"), TraceRequest("a2", 0.0, 3230, None, "a1")]


@pytest.mark.parametrize("cp", [1, 2])
def test_engine_with_graphs_replays_every_piece_without_a_host_sync(cp):
    """The tiny model at cp 1 and cp 2 (expert parallelism: a MoE layer's R piece, then its exchange eagerly) under
    the sync check: the engine captures every bucket before its first batch, so its batches capture nothing and
    run no piece eagerly, and its logits match the reference and the run without graphs; the memory plan's graph
    item bounds the memory the graphs hold."""
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_jobs, verify_run
    from cpkv.engine.graphs import buckets
    from cpkv.engine.instruments import MeasureConfig
    from cpkv.memplan import Setup, graph_bytes

    cfg = EngineConfig(model="tiny", cp=cp, device="cuda", page_size=64, pages_per_rank=200, chunk_size=4096,
                       max_requests=1, warmup=True)
    trace = _trace()
    sync = MeasureConfig(sync_check=True)
    off, on = run_jobs([(cfg, trace, sync), (dataclasses.replace(cfg, graph_tokens=256), trace, sync)], timeout_s=500)
    assert [r.id for r in on.requests] == ["a0", "b0", "a1", "b1", "a2"] and not on.rejected
    report = verify_run(on, trace)
    assert report.ok, report
    layers = on.cfg.model_config().num_layers
    bound = graph_bytes(Setup(on.cfg.model_config(), cp, 1 << 50, weights=on.cfg.weights_dtype, compute="bfloat16",
                              page_size=64, chunk_size=4096, max_requests=1, graph_tokens=256))
    for st in on.stats["graphs_per_rank"]:
        # the memory plan's item bounds what the graphs hold, measured (reserved: buffers and the captures' pool)
        assert st["buffer_bytes"] < st["device_bytes"] <= bound, (st, bound)
        assert st["batches"] >= 2 and st["captured"] == 0 and st["warm_s"] > 0
        assert st["graphs_held"] == len(buckets(256)) * 2 * layers and st["eager_pieces"] == 0, st
    for a, b in zip(off.requests, on.requests):  # bf16 GEMMs over more rows may round another way
        torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=0.05 * float(a.logits.abs().max()))
