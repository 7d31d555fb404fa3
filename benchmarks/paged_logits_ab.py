"""Experiment (GPU, Hopper): the paged decode logits kernels A/B at GLM-5 shapes (H 32, D 128, 132-byte index
rows, P 64, two pools; cpkv.bench.indexer_decode.make_case), every generation at a full context of L keys.

Per (B, L): device time of ``paged_logits_triton`` under each named config (CUDA events behind a spin kernel: no
launch cost; the configs interleaved over ``--rounds`` rounds, the median of the rounds' medians), the bytes moved
(index rows, q and w read, the [B, L] float32 logits written) per second, and that rate over the copy rate
``cpkv.bench.timing.copy_gbs`` measured in the same run (read + written per second, before and after; their mean).
``keys`` is the earlier default (paged.KEYS_CONFIG), ``runs`` the current one (paged.DEFAULT_CONFIG); the others
are runs tile shapes. Each config's logits are checked against the keys kernel's (-inf positions equal, within
2e-3 of each row's largest |logit|) and the runs default against the reference at the smallest case.

    PYTHONPATH=src python benchmarks/paged_logits_ab.py [--json] [--batches 1 8 32] [--lengths 32768 131072]

Targets (H200): B 32 at 32K <= 45 us, B 1 at 32K <= 11 us (the ``target`` column, runs default only).
Not part of the package.
"""
from __future__ import annotations

import argparse
import json
import statistics

from cpkv.bench.indexer_decode import rows_close

ROW, PAGE = 132, 64
TARGETS_US = {(32, 32768): 45.0, (1, 32768): 11.0}


def configs() -> dict:
    """name -> PagedLogitsConfig: the earlier default, the current one, then runs tile shapes."""
    from cpkv.kernels.mqa_logits.config import PagedLogitsConfig as C
    from cpkv.kernels.mqa_logits.paged import DEFAULT_CONFIG, KEYS_CONFIG

    return {"keys": KEYS_CONFIG, "runs": DEFAULT_CONFIG,
            "runs_r_auto": C(128, 1, 4, maxnreg=None), "runs_s64": C(64, 1, 4),
            "runs_s128_w8": C(128, 1, 8, maxnreg=None), "runs_s256_w8": C(256, 1, 8, maxnreg=None),
            "runs_s128_x2": C(128, 2, 4), "runs_s64_x4_st3": C(64, 4, 4, 3, maxnreg=None)}


def _launcher(c: dict, cfg):
    from cpkv.kernels.mqa_logits.paged import paged_logits_triton

    return lambda: paged_logits_triton(c["q"], c["weights"], c["bases"], c["owner_tab"], c["page_tab"], c["slot"],
                                       c["ctx"], PAGE, c["out"], config=cfg)


def time_case(B: int, L: int, named: dict, rounds: int, reps: int, check_ref: bool) -> dict:
    """Median device seconds per config (rounds interleaved), outputs checked against the keys kernel's."""
    import torch

    from cpkv.bench.indexer_decode import make_case
    from cpkv.bench.timing import event_median_s
    from cpkv.kernels.mqa_logits.ref import paged_mqa_logits_ref

    c = make_case(B, L)
    runs = {name: _launcher(c, cfg) for name, cfg in named.items()}
    outs = {}
    for name, run in runs.items():  # compile, and keep each config's logits
        c["out"].fill_(7.0)
        run()
        outs[name] = c["out"].clone()
    seconds = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:
            seconds[name].append(event_median_s(runs[name], reps=reps, device_only=True))
    res = {"batch": B, "keys": L, "bytes_read": B * L * ROW + c["q"].numel() + 4 * c["weights"].numel(),
           "bytes_written": 4 * c["out"].numel(),
           "configs": {name: {"s": statistics.median(v), "equal_to_keys": rows_close(outs[name], outs["keys"])}
                       for name, v in seconds.items()}}
    if check_ref:
        ref = paged_mqa_logits_ref(c["q"], c["weights"], c["pools"], c["owner_tab"], c["page_tab"], c["slot"],
                                   c["ctx"], PAGE, L, dtype=torch.float64)
        res["runs_matches_reference"] = rows_close(outs["runs"], ref)
    del c, outs
    torch.cuda.empty_cache()
    return res


def rates(res: dict, copy_gbs: float) -> None:
    """Adds us, GB/s of bytes moved and the fraction of the copy rate to each config of ``res`` (in place)."""
    moved = res["bytes_read"] + res["bytes_written"]
    for name, row in res["configs"].items():
        gbs = moved / row["s"] / 1e9
        row.update(us=row["s"] * 1e6, moved_gbs=gbs, read_gbs=res["bytes_read"] / row["s"] / 1e9,
                   copy_fraction=gbs / copy_gbs)
    target = TARGETS_US.get((res["batch"], res["keys"]))
    if target is not None:
        res["target_us"], res["runs_meets_target"] = target, res["configs"]["runs"]["us"] <= target


def run(batches, lengths, rounds: int, reps: int, only=None) -> dict:
    import torch

    from cpkv.bench.timing import copy_gbs

    named = configs()
    named = {k: v for k, v in named.items() if k in ("keys", "runs") or not only or k in only}
    before = copy_gbs()
    cases = [time_case(B, L, named, rounds, reps, check_ref=(B, L) == (min(batches), min(lengths)))
             for L in lengths for B in batches]
    after = copy_gbs()
    copy = (before + after) / 2
    for res in cases:
        rates(res, copy)
    return {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "copy_gbs_before": before,
            "copy_gbs_after": after, "cases": cases}


def show(r: dict) -> None:
    from cpkv.cli.fmt import table

    print(f"{r['device']}: paged decode logits, GLM-5 shapes; copy_ {r['copy_gbs']:.0f} GB/s (before "
          f"{r['copy_gbs_before']:.0f}, after {r['copy_gbs_after']:.0f}); GB/s of bytes moved (rows, q, w read; "
          f"logits written)")
    rows = []
    for c in r["cases"]:
        keys = c["configs"]["keys"]["us"]
        for name, x in c["configs"].items():
            target = c.get("target_us") if name == "runs" else None
            rows.append((c["batch"], c["keys"], name, x["us"], x["moved_gbs"], x["copy_fraction"], keys / x["us"],
                         x["equal_to_keys"], "" if target is None else f"<= {target:g}: {x['us'] <= target}"))
    table(["B", "L", "config", "us", "GB/s", "/copy", "x keys", "equal", "target"], rows)
    for c in r["cases"]:
        if "runs_matches_reference" in c:
            print(f"B={c['batch']} L={c['keys']}: runs default equals the reference: {c['runs_matches_reference']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--configs", nargs="*", help="runs tile shapes to time beside keys and runs (default: all)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = run(a.batches, a.lengths, a.rounds, a.reps, a.configs)
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        show(r)


if __name__ == "__main__":
    main()
