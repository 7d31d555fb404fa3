"""``cpkv bench compose``: per-batch compose time per mode and the gather kernel against a device copy."""
from __future__ import annotations

import argparse

from cpkv.cli.args import MODES_EPILOG as EPILOG  # noqa: F401  (shown under --help)
from cpkv.config import DEFAULT_PAGE_SIZE

HELP = "Time every compose mode at the traced-batch shape, and the page gather against a device copy."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli import args as a

    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    from cpkv.config import TOY_SIZES

    p.add_argument("--cp", type=a.ranks, default=TOY_SIZES.cp, help=f"rank processes (default {TOY_SIZES.cp})")
    p.add_argument("--modes", default="all", help="comma-separated modes (listed below) or all")
    p.add_argument("--model", default="glm5", help="row sizes and layer count from this preset (default glm5)")
    p.add_argument("--page-size", type=a.page_size, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--requests", type=a.batch_requests, default=12)
    p.add_argument("--extend-tokens", type=a.tokens, default=44_600, help="query tokens of the batch (default 44600)")
    p.add_argument("--prefix-tokens", type=a.bounded_int(0, 1 << 30), default=500_000, help="cached prefix tokens (default 500000)")
    p.add_argument("--layers", type=a.layers, default=4,
                   help="layers timed per iteration; the per-batch figure is scaled to the model's layers")
    p.add_argument("--iters", type=a.bounded_int(1, 100_000), default=3)
    p.add_argument("--no-kernel", action="store_true", help="skip the gather-kernel bandwidth bench")
    p.add_argument("--json", action="store_true")


def _check_fits(cfg) -> None:
    """On the CPU: each rank's share of the pool plus the batch's dense buffers (every key, both halves) must fit
    this host (on CUDA they live on the GPUs)."""
    from cpkv import envs
    from cpkv.bench.compose import bench_model
    from cpkv.cli.hostmem import check_ranks_fit

    if cfg.device != "cpu":
        return
    m = bench_model(cfg)
    keys = cfg.prefix_tokens + cfg.extend_tokens
    per_rank = keys * m.kv_bytes_per_token() // cfg.cp + 2 * keys * (m.row_bytes("token") + m.row_bytes("index"))
    check_ranks_fit(f"--prefix-tokens {cfg.prefix_tokens} --extend-tokens {cfg.extend_tokens}",
                    "the pools and dense buffers", per_rank, cfg.cp, shm=not envs.get("CPKV_DISABLE_PEER_MEMORY"),
                    fix="lower --prefix-tokens, --extend-tokens or --layers")


def run(args: argparse.Namespace) -> int:
    from cpkv.bench.compose import BenchConfig, run_bench
    from cpkv.cli.fmt import Progress, emit_json, table
    from cpkv.compose.modes import parse_modes

    cfg = BenchConfig(cp=args.cp, device=args.device, model=args.model, page_size=args.page_size,
                      requests=args.requests, extend_tokens=args.extend_tokens, prefix_tokens=args.prefix_tokens,
                      layers=args.layers, iters=args.iters, modes=tuple(parse_modes(args.modes)),
                      kernel=not args.no_kernel)
    _check_fits(cfg)
    bar = Progress(len(cfg.modes) + 1, "cpkv bench compose")
    bar.set(0, f"starting {cfg.cp} rank processes")
    try:
        out = run_bench(cfg, on_progress=lambda step, what: bar.set(step, what))
    finally:
        bar.close()
    if args.json:
        emit_json(out)
        return 0
    b = out["batch"]
    print(f"batch: {b['requests']} requests, {b['extend_tokens']} query tokens, {b['prefix_tokens']} cached tokens "
          f"(hit {b['hit_ratio']:.1%}), page {cfg.page_size}, {cfg.model} rows; cp={cfg.cp} "
          f"device={cfg.device} peer memory={out['peer_memory']} triton={out['triton']}")
    full, layers = out["model_full_layers"], out["model_layers"]
    print(f"timed {cfg.layers} full (and {cfg.layers} shared) indexer layers x {cfg.iters} iterations; per batch = "
          f"full x {full} + shared x {layers - full} layers")
    if out["shared_device"]:
        print("ranks share one GPU: peer-memory figures measure device memory, not NVLink; collectives are gloo "
              "through the host")
    elif cfg.device == "cuda":
        print("one GPU per rank: collectives through NCCL, peer reads through CUDA IPC over the GPUs' links")
    table(["mode", "ms/full layer", "ms/shared layer", "ms/batch", "ran as"],
          [(m, v["ms_per_layer"], v["ms_per_shared_layer"], v["ms_per_batch"], v["effective"] + ("" if v["requests"] != 1 or m != "prefetch"
                                                                        else " (bs=1: largest request alone)"))
           for m, v in out["modes"].items()])
    print(f"plan build: {out['plan_ms']:.3f} ms ({out['plan_ms_host_only']:.3f} ms without the upload); host work "
          f"per (layer, kind) with the plan cached: "
          f"{out['host_us_per_layer_kind']:.1f} us per (layer, kind), {out['host_us_per_layer']:.1f} us per layer with "
          f"both kinds in one call (gather path, no barrier wait; calls back to back as a forward pass issues "
          f"them, ranks one at a time; {out['host_us_per_layer_idle']:.1f} us per layer for a call alone on an idle "
          f"device"
          f"{'; on the CPU the copy itself runs inside the call' if cfg.device == 'cpu' else ''})")
    print(f"whole compose_layer under symm, barrier round included, every rank at once: "
          f"{out['host_us_per_layer_symm']:.1f} us per layer (slowest rank)")
    k = out.get("kernel")
    if k:
        nan = float("nan")
        print(f"gather kernel: {k['pages']} pages of {k['page_bytes']} B, device time; device copy "
              f"{k['copy_GBps']:.0f} GB/s ({k['copy_GBps_event']:.0f} with its launch), index_select "
              f"{k['index_select_GBps']:.0f} GB/s ({k['index_select_ratio']:.3f})")
        table(["block", "warps", "GB/s", "x copy", "x copy, launch incl.", "correct"],
              [(v["block"], v["num_warps"], v.get("GBps", nan), v.get("ratio_to_copy", nan),
                v.get("ratio_to_copy_event", nan), v["correct"])
               for v in k["variants"]])
        print(f"compose modes above ran with the best gather config: {k.get('best', 'none (no variant was correct)')}")
        print(f"gather launch host time {k['launch_host_us']:.1f} us (a one-element torch op: "
              f"{k['torch_launch_host_us']:.1f} us); best config on pages in address order "
              f"{k.get('sorted_ratio', nan):.3f} of copy, on contiguous pages {k.get('contiguous_ratio', nan):.3f}, "
              f"in the allocator's order {k.get('allocator_ratio', nan):.3f};"
              f" 16-byte loads per compiled variant (PTX): {k['ptx_v4_loads']}")
    return 0
