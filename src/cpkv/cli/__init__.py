"""The ``cpkv`` command line. Each command lives in its own module, found through a registry.

A command module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``,
and imports torch only inside ``run`` so that ``cpkv --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from cpkv import __version__, envs
from cpkv.errors import CpkvError

COMMANDS: dict[str, str] = {
    "run": "cpkv.cli.run_cmd",
    "replay": "cpkv.cli.replay_cmd",
    "layout": "cpkv.cli.layout_cmd",
    "env": "cpkv.cli.env_cmd",
}
CHECKS: dict[str, str] = {"compose": "cpkv.bench.check_cmd"}
BENCHES: dict[str, str] = {
    "compose": "cpkv.bench.compose_cmd",
    "indexer": "cpkv.bench.indexer",
    "attention": "cpkv.bench.attention",
    "engine": "cpkv.bench.engine",
}


def _load(path: str) -> ModuleType | None:
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name and path.startswith(exc.name):
            return None  # the command is not part of this build
        raise


def _add_commands(sub: argparse._SubParsersAction, table: dict[str, str]) -> None:
    for name, path in table.items():
        mod = _load(path)
        if mod is None:
            continue
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, epilog=getattr(mod, "EPILOG", None),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)


def _add_group(sub: argparse._SubParsersAction, name: str, help: str, table: dict[str, str]) -> None:
    p = sub.add_parser(name, help=help, description=help)
    inner = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    _add_commands(inner, table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpkv",
        description="Context-parallel long-context prefill of DSA models, KV cache shared across ranks.",
    )
    parser.add_argument("--version", action="version", version=f"cpkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_commands(sub, COMMANDS)
    _add_group(sub, "check", "Correctness checks across real rank processes.", CHECKS)
    _add_group(sub, "bench", "Benchmarks that report ratios to ceilings measured in the same run.", BENCHES)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.get("CPKV_LOG_LEVEL"), format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except CpkvError as exc:
        name = " ".join(x for x in (args.command, getattr(args, "target", None)) if x)
        print(f"cpkv {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cpkv: interrupted", file=sys.stderr)
        return 130
