"""``cpkv bench decode``: the paged decode step (docs/design.md §11) per batch and context, against its floor.

Per context length L (``--keys``) one prompt of L tokens is prefilled once (its pages kept, as the online engine
keeps a generation's) and cloned page for page, on the same owners, into B generations (``--batches``): each clone
holds its own copy of the KV under its own keys, so a step reads B contexts as B real generations would (their
top-k selections alike). Then ``--steps`` decode steps of all B are timed (each to its end: the device
synchronised, the tokens agreed between the ranks), after two untimed ones.

The floor is the bytes the busiest rank's step must read, at the copy rate measured in the same run: the
weights it keeps (the embedding table's B rows only, and W_UK / W_UV in place of kv_b_proj), the routed experts
its tokens can reach (min(local experts, B x top-k) per MoE layer), the context's index rows on the full layers
and top-k token rows per layer of the generations it runs. ``ratio_to_floor`` = step time / floor time.

    cpkv bench decode --model glm5 --num-layers 4 --cp 2 --device cuda --keys 1024,32768,131072 --batches 1,8,32
"""
from __future__ import annotations

import argparse
import math
import time

HELP = "The paged decode step per batch and context, against the bytes it must read at the copy rate."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli.args import positive_int

    p.add_argument("--model", default="tiny", help="preset or checkpoint dir (default tiny)")
    p.add_argument("--num-layers", type=positive_int, default=None, help="override the model's depth")
    p.add_argument("--cp", type=positive_int, default=1, help="rank processes (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--keys", default="256,1024", help="comma-separated context lengths (default 256,1024)")
    p.add_argument("--batches", default="1,4", help="comma-separated generations per step (default 1,4)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per case (default 5)")
    p.add_argument("--chunk-size", type=positive_int, default=None,
                   help="prefill chunk (default: the toy or model size preset's)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after each case's timed steps, one more step under torch's profiler on rank 0: its kernel "
                        "and host-op table (top 40 by device time, then by host time) written to DIR")
    p.add_argument("--json", action="store_true")


def _ints(text: str, flag: str) -> list[int]:
    from cpkv.errors import ConfigError

    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ConfigError(f"{flag}: expected comma-separated integers >= 1, got {text!r}")
    return out


def run(args: argparse.Namespace) -> int:
    from cpkv.config import SIZES
    from cpkv.dist import launch
    from cpkv.engine.config import EngineConfig

    keys, batches = _ints(args.keys, "--keys"), _ints(args.batches, "--batches")
    P = args.page_size
    sizes = SIZES["model" if args.device == "cuda" else "toy"]
    chunk = args.chunk_size or max(P, sizes.chunk_size // P * P)
    need = max(batches) * (max(keys) // P + 2 + args.steps // P + 2) + max(keys) // P + 4  # clones + the source
    cfg = EngineConfig(model=args.model, num_layers=args.num_layers, cp=args.cp, device=args.device, page_size=P,
                       pages_per_rank=-(-need // args.cp) + 8, chunk_size=chunk, max_requests=1,
                       look_ahead=False)
    rows = launch(decode_bench_rank, args.cp, args=(cfg, keys, batches, args.steps, args.profile), device=args.device,
                  timeout_s=3600)[0]
    report = {"model": args.model, "cp": args.cp, "device": args.device, "cases": rows}
    _print(report, args.json)
    return 0


def decode_bench_rank(ctx, cfg, keys: list[int], batches: list[int], steps: int,
                      profile: str | None = None) -> list[dict]:
    """Every (keys, batch) case on this rank -> rank 0's rows (module docstring)."""
    from cpkv.bench.timing import copy_gbs
    from cpkv.engine.decode import DecodeRunner
    from cpkv.engine.executor import BatchExecutor
    from cpkv.engine.instruments import NoInstruments
    from cpkv.engine.rank import rank_model
    from cpkv.scheduler.decode import Decoder

    model = rank_model(ctx, cfg)
    ex = BatchExecutor(ctx, cfg, model, NoInstruments())
    runner = DecodeRunner(model, ex.rt, ex.ep, ctx.rank, ex.graphs)
    rate = copy_gbs(device=cfg.device) * 1e9 / 2  # bytes read per second (copy_gbs counts read + write)
    out = []
    try:
        for n in keys:
            source = _prefill(ex, ctx, model, n)
            for b in batches:
                dec = Decoder(ex.kv, cfg.cp, cfg.page_size)
                for g in range(b):
                    _clone(ex, dec, source, g, model.cfg.vocab_size)
                times, floor = _time_steps(ex, ctx, dec, runner, model, steps)
                if profile:
                    _profile_step(ex, ctx, dec, runner, model, f"{profile}/decode_k{n}_b{b}_r{ctx.rank}.txt")
                for rid in list(dec.seqs):
                    dec.finish(rid)
                out.append({"keys": n, "batch": b, "step_ms": times * 1e3, "floor_ms": floor / rate * 1e3,
                            "floor_bytes": floor, "read_gbs": rate / 1e9, "ratio_to_floor": times * rate / floor})
            ex.kv.drop(source[1])
            ex.kv.release(source[2])
    finally:
        ex.close()
    return out


def _prefill(ex, ctx, model, n: int):
    """One prompt of ``n`` tokens prefilled with its pages kept -> (tokens, its held prefix, its tail pages)."""
    import random

    from cpkv.scheduler import Request

    rng = random.Random(n)
    tokens = [rng.randrange(model.cfg.vocab_size) for _ in range(n)]
    req = Request(("source", n), tokens, n)
    req.keep = True
    ex.sched.add(req)
    while ex.sched.has_work:
        ex.run(ex.sched.next_batch())
    return tokens, req.prefix, req.tail


def _clone(ex, dec, source, g: int, vocab: int) -> None:
    """Generation ``g``: a copy of the source's pages on the same owners (each rank copies its own), its full pages
    cached under keys of its own, started in ``dec`` with a next token to decode."""
    tokens, prefix, tail = source
    pages = prefix.pages + tuple(tail)
    got = ex.kv.allocate([o for o, _ in pages])
    assert got is not None, "the bench sized the pool for every clone"
    pool = ex.rt.pool
    for (o, src), (_, dst) in zip(pages, got):
        if o == ex.rank:
            for buf in pool.buffers.values():
                buf[:, dst].copy_(buf[:, src])
    keys = [(g + 1 + i) % vocab if i == 0 else t for i, t in enumerate(tokens)]
    full = len(prefix)
    held = ex.kv.commit(keys[: full * pool.page_size], ex.kv.match([]), got[:full], hold=True)
    dec.start(("gen", g), keys + [keys[-1]], held, got[full:])


def _step(ctx, dec, runner):
    """One decode step of every generation in ``dec``, greedy, its tokens agreed between the ranks -> the step."""
    import torch

    step, failed = dec.plan()
    assert step is not None and not failed
    logits = runner.run(step)
    mine = [e.rid for e in step.entries if e.rid in logits]
    top = torch.stack([logits[r] for r in mine]).argmax(-1).tolist() if mine else []  # one sync
    got = dict(zip(mine, top))
    tokens = ctx.all_reduce_max_list([got.get(e.rid, -1) for e in step.entries])
    for e, t in zip(step.entries, tokens):
        dec.seqs[e.rid].tokens.append(t)
        dec.advance(e.rid)
    return step


def _profile_step(ex, ctx, dec, runner, model, path: str) -> None:
    """One more step under torch's profiler; rank 0 writes its tables to ``path``."""
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    ex.sync_time()
    with profile(activities=acts) as prof:
        _step(ctx, dec, runner)
        ex.sync_time()
    if ctx.rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        ka = prof.key_averages()
        by_dev = "cuda_time_total" if model.device.type == "cuda" else "cpu_time_total"
        with open(path, "w") as f:
            f.write(ka.table(sort_by=by_dev, row_limit=40) + "\n\n")
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")


def _time_steps(ex, ctx, dec, runner, model, steps: int) -> tuple[float, float]:
    """(median seconds per step, floor bytes of the busiest rank's step) over two untimed and ``steps`` timed steps."""
    times, floor = [], 0.0
    for s in range(steps + 2):
        t0 = ex.sync_time()
        step = _step(ctx, dec, runner)
        t1 = ex.sync_time()
        if s >= 2:
            times.append(t1 - t0)
            kept = ("fp8" if model.weights_dtype == "fp8" else "bf16", str(model.dtype).removeprefix("torch."))
            floor = max(floor, max(step_floor(step, model.cfg, r, *kept) for r in range(step.cp)))
    times.sort()
    return times[len(times) // 2], floor


def step_floor(step, m, rank: int, weights: str, compute: str) -> float:
    """Bytes ``rank``'s share of ``step`` must read (module docstring); ``weights``: "fp8" or "bf16" (the compute
    dtype), ``compute``: "bfloat16" or "float32"."""
    from cpkv.memplan import DTYPE_BYTES, weight_bytes

    wb = weight_bytes(m, weights, compute)
    el = DTYPE_BYTES[compute]
    b = len(step.entries)
    kv_b = m.num_layers * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * el
    weights_read = wb.replicated - m.vocab_size * m.hidden_size * el - kv_b + b * m.hidden_size * el
    local = math.ceil(m.n_routed_experts / step.cp)
    experts = min(local, b * m.num_experts_per_tok) * wb.expert * wb.moe_layers
    full = m.indexer_types.count("full")
    mine = step.on(rank)
    kv = sum(e.context * m.row_bytes("index") * full + min(e.context, m.index_topk) * m.row_bytes("token") *
             m.num_layers for e in mine)
    return weights_read + experts + kv


def _print(rep: dict, as_json: bool) -> None:
    from cpkv.cli.fmt import emit_json, table

    if as_json:
        emit_json(rep)
        return
    table(("keys", "batch", "step ms", "floor ms", "floor MB", "ratio to floor"),
          [(r["keys"], r["batch"], f"{r['step_ms']:.3f}", f"{r['floor_ms']:.3f}", f"{r['floor_bytes'] / 1e6:.1f}",
            f"{r['ratio_to_floor']:.2f}") for r in rep["cases"]])
    print(f"\n{rep['model']} at cp {rep['cp']} on {rep['device']}: median time of a paged decode step of every "
          f"generation (synchronised, tokens agreed); floor: the busiest rank's bytes at the copy rate of this run")
