"""``cpkv bench decode``: the paged decode step (docs/design.md §11) per batch and context, against its floor.

Per context length L (``--keys``) one prompt of L tokens is prefilled once (its pages kept, as the online engine
keeps a generation's) and cloned page for page, on the same owners, into B generations (``--batches``): each clone
holds its own copy of the KV under its own keys, so a step reads B contexts as B real generations would (their
top-k selections alike). Then ``--steps`` decode steps of all B are timed (each to its end: the device
synchronised, the tokens agreed between the ranks), after two untimed ones: ``sync_step_ms``, their median. Where the
runner pipelines (the graphs form at cp 1: ``DecodeRunner.launch``), ``4 x --steps`` more run as a serving loop
would: each step launched before the last one's tokens are read, its input tokens taken on the device;
``pipelined_ms`` is the time between consecutive steps' tokens reaching the host in that loop (the steady state,
after two), the time per output token a greedy generation sees. ``step_ms`` is the pipelined time where it runs,
else the synchronised one.

Each clone decodes its own next token, so the B generations route as B real ones would, not alike.

The floor is the bytes the busiest rank's step must read, at the copy rate measured in the same run (``copy_``'s
bytes read + written per second: the rate of a memory stream): the weights it keeps (the embedding table's B rows
only, and W_UK / W_UV in place of kv_b_proj), the routed experts its step served (the union over the ranks of each
MoE layer's routed experts, among those it holds: counted after the step, outside the timing), the context's index
rows on the full layers and top-k token rows per layer of the generations it runs. ``ratio_to_floor`` = step time
/ floor time. ``--weights fp8,bf16`` runs each mode in its own rank processes.

    cpkv bench decode --model glm5 --num-layers 4 --cp 2 --device cuda --keys 1024,32768,131072 --batches 1,8,32
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

HELP = "The paged decode step per batch and context, against the bytes it must read at the copy rate."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli.args import bounded_int, positive_int

    p.add_argument("--model", default="tiny", help="preset or checkpoint dir (default tiny)")
    p.add_argument("--num-layers", type=positive_int, default=None, help="override the model's depth")
    p.add_argument("--cp", type=positive_int, default=1, help="rank processes (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--keys", default="256,1024", help="comma-separated context lengths (default 256,1024)")
    p.add_argument("--batches", default="1,4", help="comma-separated generations per step (default 1,4)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per case (default 5)")
    p.add_argument("--weights", default="auto",
                   help="comma-separated weights modes, each run in its own rank processes: auto, fp8, bf16 "
                        "(default auto: fp8 on CUDA)")
    p.add_argument("--form", default="auto",
                   help="comma-separated decode step forms to time in the same rank processes: auto, graphs, static, "
                        "gather (CPKV_DECODE_STEP; default auto)")
    p.add_argument("--graph-tokens", type=bounded_int(0, 1 << 16), default=None, metavar="N",
                   help="steps of up to this many generations per rank run each layer's token-only pieces as CUDA "
                        "graphs (default: the engine's, 1024 on CUDA; 0 = eager)")
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
    keys, batches = _ints(args.keys, "--keys"), _ints(args.batches, "--batches")
    rows, graph_tokens = decode_cases(args.model, args.num_layers, None, args.cp, args.device, args.page_size, keys,
                                      batches, args.steps, weights_list(args.weights), args.graph_tokens,
                                      args.chunk_size, args.profile, forms_list(args.form))
    report = {"model": args.model, "cp": args.cp, "device": args.device, "graph_tokens": graph_tokens,
              "cases": rows}
    _print(report, args.json)
    return 0


def decode_cases(model: str, num_layers: int | None, experts: int | None, cp: int, device: str, page_size: int,
                 keys: list[int], batches: list[int], steps: int, weights: list[str], graph_tokens: int | None = None,
                 chunk_size: int | None = None, profile: str | None = None,
                 forms: list[str] | None = None) -> tuple[list[dict], int]:
    """Every (weights, keys, batch) case in fresh rank processes per weights mode -> (rank 0's rows, each with its
    ``weights``; the graph tokens they ran with). ``cpkv bench decode``'s cases, and ``cpkv bench engine
    --decode``'s."""
    from cpkv.config import SIZES
    from cpkv.dist import launch
    from cpkv.engine.config import EngineConfig, default_graph_tokens

    P = page_size
    sizes = SIZES["model" if device == "cuda" else "toy"]
    chunk = chunk_size or max(P, sizes.chunk_size // P * P)
    need = max(batches) * (max(keys) // P + 2 + steps // P + 2) + max(keys) // P + 4  # clones + the source
    rows, tokens = [], default_graph_tokens(device, graph_tokens)
    for w in weights:
        cfg = EngineConfig(model=model, num_layers=num_layers, experts=experts, cp=cp, device=device, page_size=P,
                           pages_per_rank=-(-need // cp) + 8, chunk_size=chunk, max_requests=1, look_ahead=False,
                           weights=w, graph_tokens=tokens)
        got = launch(decode_bench_rank, cp, args=(cfg, keys, batches, steps, profile, forms or ["auto"]),
                     device=device, timeout_s=3600)[0]
        rows += [{"weights": cfg.weights_dtype, **r} for r in got]
    return rows, tokens


def weights_list(spec: str) -> list[str]:
    """``--weights`` -> distinct modes in order (ConfigError naming the flag on a bad value)."""
    from cpkv.cli.args import choice_list
    from cpkv.model.config import WEIGHTS_MODES

    return choice_list(spec, "--weights", WEIGHTS_MODES)


def forms_list(spec: str) -> list[str]:
    """``--form`` -> distinct forms in order (ConfigError naming the flag on a bad value)."""
    from cpkv.cli.args import choice_list
    from cpkv.envs import DECODE_STEPS

    return choice_list(spec, "--form", DECODE_STEPS)


def decode_bench_rank(ctx, cfg, keys: list[int], batches: list[int], steps: int,
                      profile: str | None = None, forms: tuple[str, ...] = ("auto",)) -> list[dict]:
    """Every (keys, batch) case on this rank -> rank 0's rows (module docstring)."""
    from cpkv.bench.timing import copy_gbs
    from cpkv.engine.decode import DecodeRunner
    from cpkv.engine.executor import BatchExecutor
    from cpkv.engine.instruments import NoInstruments
    from cpkv.engine.rank import rank_model
    from cpkv.scheduler.decode import Decoder

    model = rank_model(ctx, cfg)
    ex = BatchExecutor(ctx, cfg, model, NoInstruments())
    runners = {f: DecodeRunner(model, ex.rt, ex.ep, ctx.rank, ex.graphs, form=f) for f in forms}
    rate = copy_gbs(device=cfg.device) * 1e9  # the copy rate (read + written bytes per second): a memory stream's
    shared = _ranks_share_gpu(cfg)
    out = []
    try:
        for n in keys:
            source = _prefill(ex, ctx, model, n)
            for b in batches:
                for form, runner in runners.items():
                    dec = Decoder(ex.kv, cfg.cp, cfg.page_size)
                    for g in range(b):
                        _clone(ex, dec, source, g, model.cfg.vocab_size)
                    times, floor, experts, total = _time_steps(ex, ctx, dec, runner, model, steps)
                    synced = times
                    if runner.pipelined:
                        times = _time_pipelined(ex, dec, runner, 4 * steps)
                    if profile:
                        _profile_step(ex, ctx, dec, runner, model,
                                      f"{profile}/decode_{form}_k{n}_b{b}_r{ctx.rank}.txt")
                    for rid in list(dec.seqs):
                        dec.finish(rid)
                    out.append({"keys": n, "batch": b, "form": runner.form, "step_ms": times * 1e3,
                                "sync_step_ms": synced * 1e3, "pipelined": runner.pipelined,
                                "floor_ms": floor / rate * 1e3, "floor_bytes": floor, "copy_gbs": rate / 1e9,
                                "ratio_to_floor": times * rate / floor, "experts_read": experts,
                                "ranks_share_gpu": shared})
                    if shared:  # one memory system serves every rank's bytes (an upper bound on the read: the
                        # busiest rank's count of experts taken for each rank)
                        out[-1].update(shared_floor_ms=total / rate * 1e3, ratio_to_shared_floor=times * rate / total)
                    if ctx.rank == 0:  # each case as it ends: a run stopped early keeps what it measured
                        print("case " + json.dumps({"weights": cfg.weights_dtype, **out[-1]}), file=sys.stderr,
                              flush=True)
            ex.kv.drop(source[1])
            ex.kv.release(source[2])
    finally:
        ex.close()
    return out


def _ranks_share_gpu(cfg) -> bool:
    """The ranks run on fewer GPUs than there are ranks (their steps then share one memory system: the floor of
    the busiest rank's bytes is not the step's, the sum of the ranks' is)."""
    import torch

    return cfg.device == "cuda" and cfg.cp > torch.cuda.device_count()


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
    # each generation decodes its own next token (the source's last one, shifted by g): their hidden states, and so
    # their routings, differ as real generations' do (identical clones would route alike and read few experts)
    dec.start(("gen", g), keys + [(keys[-1] + g) % vocab], held, got[full:])


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


def _time_pipelined(ex, dec, runner, steps: int) -> float:
    """Seconds between consecutive steps' tokens reaching the host when each step is launched before the last one's
    tokens are read (module docstring), over ``steps`` after two; greedy, cp 1."""
    ex.sync_time()
    pending, marks = None, []

    def read(got) -> None:
        for rid, tok in got.tokens().items():
            dec.seqs[rid].tokens.append(tok)
        marks.append(time.perf_counter())

    for _ in range(steps + 3):
        step, failed = dec.plan()
        assert step is not None and not failed
        got = runner.launch(step)
        if pending is not None:
            read(pending)
        for e in step.entries:
            dec.advance(e.rid)
        pending = got
    read(pending)
    ex.sync_time()
    return (marks[-1] - marks[2]) / (len(marks) - 3)


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


def _time_steps(ex, ctx, dec, runner, model, steps: int) -> tuple[float, float, int, float]:
    """(median seconds per step, floor bytes of the busiest rank's step, the routed experts it read, the ranks'
    floor bytes summed) over two untimed and ``steps`` timed steps."""
    times, floor, experts, total = [], 0.0, 0, 0.0
    kept = ("fp8" if model.weights_dtype == "fp8" else "bf16", str(model.dtype).removeprefix("torch."))
    for s in range(steps + 2):
        t0 = ex.sync_time()
        step = _step(ctx, dec, runner)
        t1 = ex.sync_time()
        if s >= 2:
            times.append(t1 - t0)
            read = routed_experts_read(ctx, model, len(step.on(ctx.rank)))
            each = [step_floor(step, model.cfg, r, *kept, experts_read=read) for r in range(step.cp)]
            if max(each) > floor:
                floor, experts, total = max(each), read, sum(each)
    times.sort()
    return times[len(times) // 2], floor, experts, total


def routed_experts_read(ctx, model, own: int) -> int:
    """(MoE layer, routed expert) pairs the busiest rank's experts served in the last step: the union over the ranks
    of the experts their tokens were routed to (each MoE layer's ``routed``, this rank's ``own`` tokens' rows),
    counted among the experts each rank holds; the maximum over the ranks. Syncs: call outside the timing."""
    import torch

    moe = [layer for layer in model.layers if layer.is_moe]
    if not moe:
        return 0
    n = model.cfg.n_routed_experts
    mask = torch.zeros((len(moe), n), dtype=torch.int64)
    for i, layer in enumerate(moe):
        if own and layer.routed is not None:
            mask[i, layer.routed[:own].reshape(-1).long().cpu()] = 1
    union = torch.tensor(ctx.all_reduce_max_list(mask.reshape(-1).tolist())).view(len(moe), n)
    mine = sum(int(union[i, list(layer.experts)].sum()) for i, layer in enumerate(moe))
    return max(ctx.all_reduce_max_list([mine]))


def step_floor(step, m, rank: int, weights: str, compute: str, experts_read: int | None = None) -> float:
    """Bytes ``rank``'s share of ``step`` must read (module docstring); ``weights``: "fp8" or "bf16" (the compute
    dtype), ``compute``: "bfloat16" or "float32"; ``experts_read``: the (MoE layer, routed expert) pairs its step
    read (``routed_experts_read``), else the most its tokens can reach, min(local experts, B x top-k) per layer."""
    from cpkv.memplan import DTYPE_BYTES, weight_bytes

    wb = weight_bytes(m, weights, compute)
    el = DTYPE_BYTES[compute]
    b = len(step.entries)
    kv_b = m.num_layers * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * el
    weights_read = wb.replicated - m.vocab_size * m.hidden_size * el - kv_b + b * m.hidden_size * el
    local = math.ceil(m.n_routed_experts / step.cp)
    pairs = experts_read if experts_read is not None else min(local, b * m.num_experts_per_tok) * wb.moe_layers
    experts = pairs * wb.expert
    full = m.indexer_types.count("full")
    mine = step.on(rank)
    kv = sum(e.context * m.row_bytes("index") * full + min(e.context, m.index_topk) * m.row_bytes("token") *
             m.num_layers for e in mine)
    return weights_read + experts + kv


def _print(rep: dict, as_json: bool) -> None:
    from cpkv.cli.fmt import emit_json

    if as_json:
        emit_json(rep)
        return
    print_cases(rep["cases"])
    print(f"\n{rep['model']} at cp {rep['cp']} on {rep['device']}: time per paged decode step of every "
          f"generation (pipelined: launched before the last step's tokens are read; synced: each to its end, tokens "
          f"agreed); floor: the busiest rank's bytes at the copy rate of this run")


def print_cases(cases: list[dict]) -> None:
    """The decode cases' table."""
    from cpkv.cli.fmt import table

    table(("weights", "form", "keys", "batch", "step ms", "synced ms", "floor ms", "floor MB", "experts read",
           "ratio to floor", "ratio, GPU shared"),
          [(r["weights"], r.get("form", "") + (" pipelined" if r.get("pipelined") else ""), r["keys"], r["batch"],
            f"{r['step_ms']:.3f}", f"{r.get('sync_step_ms', r['step_ms']):.3f}", f"{r['floor_ms']:.3f}",
            f"{r['floor_bytes'] / 1e6:.1f}", r["experts_read"], f"{r['ratio_to_floor']:.2f}",
            f"{r['ratio_to_shared_floor']:.2f}" if "ratio_to_shared_floor" in r else "") for r in cases])
