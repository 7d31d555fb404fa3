"""``cpkv env``: list the CPKV_ environment variables, their defaults and current values."""
from __future__ import annotations

import argparse

from cpkv import envs
from cpkv.cli import fmt

HELP = "List cpkv's environment variables (all prefixed CPKV_) with defaults and current values."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    rows = [(v.name, v.default, v.raw() if v.raw() is not None else "", v.help) for v in envs.REGISTRY.values()]
    if args.json:
        fmt.emit_json([{"name": n, "default": d, "value": c or None, "help": h} for n, d, c, h in rows])
    else:
        fmt.table(("name", "default", "set to", "description"), rows)
    return 0
