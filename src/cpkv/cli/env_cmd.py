"""``cpkv env``: list the CPKV_ environment variables, their defaults, current values and what is wrong with
any of them (an invalid value also makes the command exit 2, after the listing)."""
from __future__ import annotations

import argparse
import os

from cpkv import envs
from cpkv.cli import fmt
from cpkv.errors import ConfigError

HELP = "List cpkv's environment variables (all prefixed CPKV_) with defaults and current values."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    rows = [(v.name, v.default, _shown(v), v.problem(), v.help) for v in envs.REGISTRY.values()]
    rows += [(n, None, os.environ[n], p, "(not a cpkv variable)") for n, p in envs.unknown_names().items()]
    if args.json:
        fmt.emit_json([{"name": n, "default": d, "value": c or None, "valid": p is None, "problem": p, "help": h}
                       for n, d, c, p, h in rows])
    else:
        fmt.table(("name", "default", "set to", "description"),
                  [(n, "" if d is None else d, c + ("  <- INVALID" if p else ""), h) for n, d, c, p, h in rows])
    bad = [p for *_, p, _ in rows if p]
    if bad:
        raise ConfigError("; ".join(bad))
    return 0


def _shown(var: envs.EnvVar) -> str:
    """The value as set ('' when unset); a secret's as '(set, hidden)'."""
    raw = var.raw()
    if raw is None:
        return ""
    return "(set, hidden)" if var.secret and raw else raw
