"""``cpkv check compose``: run every compose mode in real rank processes, compare with the reference."""
from __future__ import annotations

import argparse

from cpkv.cli.args import MODES_EPILOG as EPILOG  # noqa: F401  (shown under --help)
from cpkv.config import DEFAULT_PAGE_SIZE

HELP = "Compose dense KV in N real rank processes with every mode; compare byte for byte with a reference."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli import args as a

    from cpkv.config import TOY_SIZES

    p.add_argument("--cp", type=a.ranks, default=TOY_SIZES.cp, help=f"rank processes (default {TOY_SIZES.cp})")
    p.add_argument("--modes", default="all", help="comma-separated modes (listed below) or all")
    p.add_argument("--batches", type=a.bounded_int(1, 100_000), default=6, help="random batches (default 6)")
    p.add_argument("--seed", type=a.seed, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--page-size", type=a.page_size, default=DEFAULT_PAGE_SIZE,
                   help=f"tokens per page (power of two, default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--layers", type=a.layers, default=3, help="layers composed per batch (default 3)")
    p.add_argument("--model", default="tiny",
                   help="preset whose KV row sizes are composed (tiny, glm5, deepseek-v32; default tiny)")
    p.add_argument("--timeout", type=a.timeout_s, default=600.0,
                   help="seconds before the ranks are ended (default 600; raise it for long soaks)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _check_fits(cfg) -> None:
    """The ranks' pools (and as much again for dense buffers and staging) must fit this host on the CPU."""
    from cpkv import envs
    from cpkv.cli.hostmem import check_ranks_fit
    from cpkv.config import preset

    if cfg.device != "cpu":
        return
    pool = cfg.pages_per_rank * cfg.page_size * preset(cfg.model).with_layers(cfg.layers).kv_bytes_per_token()
    check_ranks_fit(f"--page-size {cfg.page_size} --layers {cfg.layers}", "the ranks' KV pools and buffers",
                    2 * pool, cfg.cp, shm=not envs.get("CPKV_DISABLE_PEER_MEMORY"),
                    fix="lower --page-size, --layers or --cp")


def run(args: argparse.Namespace) -> int:
    from cpkv.bench.check import CheckConfig, run_check
    from cpkv.cli.args import as_flags, flags_of
    from cpkv.cli.fmt import Progress, emit_json, table
    from cpkv.compose.modes import parse_modes

    with as_flags(flags_of(["cp", "batches", "seed", "page_size", "layers"])):
        cfg = CheckConfig(cp=args.cp, modes=tuple(parse_modes(args.modes)), batches=args.batches, seed=args.seed,
                          device=args.device, page_size=args.page_size, layers=args.layers, model=args.model,
                          timeout_s=args.timeout)
    _check_fits(cfg)
    bar = Progress(cfg.batches, "cpkv check compose")
    try:
        out = run_check(cfg, on_progress=lambda done: bar.set(done, f"cp {cfg.cp}"))  # every value validated above
    finally:
        bar.close()
    if args.json:
        emit_json({"ok": out["ok"], "modes": {m: {k: v[k] for k in ("digest", "mismatches", "bytes", "batches",
                                                                      "effective")} for m, v in out["modes"].items()},
                   "cp": out["cp"], "device": out["device"], "model": cfg.model, "batches": cfg.batches,
                   "layers": cfg.layers, "page_size": cfg.page_size, "solo_batches": out["solo_batches"],
                   "peer_memory": out["peer_memory"],
                   "backend": out["backend"], "shared_device": out["shared_device"]})
    else:
        _print(out, table, cfg.model)
    return 0 if out["ok"] else 1


def _print(out: dict, table, model: str) -> None:
    rows = [(m, v["batches"], v["bytes"], v["mismatches"], v["digest"][:16],
             _ran_as(m, v["effective"])) for m, v in out["modes"].items()]
    table(["mode", "batches", "bytes compared", "mismatches", "sha256", "ran as"], rows)
    print(f"cp={out['cp']} device={out['device']} backend={out['backend']} peer memory={out['peer_memory']}"
          f"{' (ranks share one GPU)' if out['shared_device'] else ''} page={out['page_size']} layers={out['layers']}"
          f" kinds=token,index model={model}")
    if "prefetch" in out["modes"]:
        print(f"prefetch runs only on batches of one request: {out['solo_batches']} of {out['batches']} batches"
              f" (prefetch hits per rank: {out['prefetch_hits']})")
    print("OK: every rank's dense buffers match the reference" if out["ok"] else "MISMATCH: see the table above")


def _ran_as(mode: str, effective: str) -> str:
    """What really ran: the mode itself, or the collective fallback when the group has no peer memory."""
    return mode if effective == mode else f"{effective} (no peer memory)"
