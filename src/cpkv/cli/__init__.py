"""The ``cpkv`` command line. Each command lives in its own module, found through a registry.

A command module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``, and
imports torch only inside ``run``. The registry holds each command's help line, so ``cpkv --help`` lists
every command without importing any of them; only the command named on the command line is imported
(``cpkv --help`` and ``cpkv env`` never import torch).

Before any command starts, the ``CPKV_*`` environment variables are checked (``cpkv env`` lists them and
says which are invalid). A user error is one line ``cpkv <command>: error: ...`` and exit status 2;
SIGTERM and SIGHUP stop a command as Ctrl-C does (its rank processes ended, no partial output files).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from pathlib import Path

from cpkv import __version__, envs
from cpkv.errors import CpkvError

# name -> (module, the line ``cpkv --help`` lists; the command's own --help shows its module's HELP)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("cpkv.cli.run_cmd", "CP prefill of a trace on rank processes, verified against one rank"),
    "serve": ("cpkv.serve.cmd", "the engine behind an OpenAI-compatible HTTP server with Prometheus metrics"),
    "replay": ("cpkv.cli.replay_cmd", "replay a trace through the prefix cache and admission; TTFT"),
    "plan": ("cpkv.cli.plan_cmd", "memory per rank (weights, expert shard, KV, buffers) and the KV tokens that fit"),
    "layout": ("cpkv.cli.layout_cmd", "how a batch's pages split over the CP ranks"),
    "env": ("cpkv.cli.env_cmd", "the CPKV_* environment variables: defaults, values, problems"),
}
CHECKS: dict[str, tuple[str, str]] = {
    "compose": ("cpkv.bench.check_cmd", "every compose mode on real rank processes against a reference"),
    "verify": ("cpkv.bench.verify_cmd", "cpkv run's verification over models, weights, precisions, cp and seeds"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "compose": ("cpkv.bench.compose_cmd", "compose modes per layer and the page gather against a device copy"),
    "indexer": ("cpkv.bench.indexer", "indexer logits and top-k against an fp8 GEMM and torch.topk"),
    "attention": ("cpkv.bench.attention", "sparse MLA attention against a bf16 GEMM"),
    "engine": ("cpkv.bench.engine", "the CP engine's prefill per part"),
    "decode": ("cpkv.bench.decode", "the paged decode step per batch and context against the bytes it must read"),
    "serve": ("cpkv.bench.serve_cmd", "HTTP load generator for cpkv serve: TTFT percentiles, replay prediction"),
    "moe": ("cpkv.bench.moe", "routed-expert GEMMs: grouped fp8 against the dense block-scaled GEMM and bf16"),
    "gemv": ("cpkv.bench.gemv", "fp8 linears at decode rows: cpkv's Triton GEMV against cuBLAS, vs the copy rate"),
}
GROUPS: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "check": ("correctness checks across real rank processes", CHECKS),
    "bench": ("benchmarks, as ratios to ceilings measured in the same run", BENCHES),
}
STOP_SIGNALS = ("SIGTERM", "SIGHUP")


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C (rank processes ended, temporary files removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _present(module: str) -> bool:
    """The command's module is part of this build (looked up on disk: importing it could import torch)."""
    root = Path(__file__).resolve().parent.parent
    return root.joinpath(*module.split(".")[1:]).with_suffix(".py").is_file()


def _chosen(argv: list[str]) -> tuple[str | None, str | None]:
    """(command, target) named on the command line, before parsing (options come after them)."""
    words = [a for a in argv if not a.startswith("-")]
    command = words[0] if words else None
    target = words[1] if command in GROUPS and len(words) > 1 else None
    return command, target


def _add_commands(sub: argparse._SubParsersAction, table: dict[str, tuple[str, str]], chosen: str | None) -> None:
    for name, (module, help) in table.items():
        if not _present(module):
            continue
        if name == chosen:
            mod = importlib.import_module(module)
            p = sub.add_parser(name, help=help, description=mod.HELP, epilog=getattr(mod, "EPILOG", None),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
            mod.add_arguments(p)
            from cpkv.cli.args import document_ranges
            document_ranges(p)  # every bounded option's range in its --help line
            p.set_defaults(_run=mod.run)
        else:
            sub.add_parser(name, help=help, description=help)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser; only the command named in ``argv`` gets its arguments (and is imported)."""
    command, target = _chosen(argv)
    parser = argparse.ArgumentParser(
        prog="cpkv",
        description="Context-parallel long-context prefill of DSA models, KV cache shared across ranks.",
    )
    parser.add_argument("--version", action="version", version=f"cpkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_commands(sub, COMMANDS, command)
    for name, (help, table) in GROUPS.items():
        p = sub.add_parser(name, help=help, description=help)
        inner = p.add_subparsers(dest="target", metavar="TARGET", required=True)
        _add_commands(inner, table, target if command == name else None)
    return parser


def _stop(signum: int, frame) -> None:
    for name in STOP_SIGNALS:  # a second signal must not interrupt the clean-up the first one starts
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise Stopped(signum)


def _install_stop_handlers() -> dict:
    """SIGTERM/SIGHUP raise Stopped in the main thread; returns the previous handlers (for a caller that
    runs commands in-process, e.g. tests); a no-op outside the main thread."""
    old = {}
    for name in STOP_SIGNALS:
        if hasattr(signal, name):
            sig = getattr(signal, name)
            try:
                old[sig] = signal.signal(sig, _stop)
            except ValueError:  # not the main thread: signals stay as they are
                break
    return old


def _rank_traceback(exc: CpkvError) -> None:
    """After a RankFailure whose first failed rank raised something other than a cpkv error (a bug, not bad
    input), that rank's traceback, indented under the error line."""
    first = getattr(exc, "first", None)
    tb = getattr(exc, "tracebacks", {}).get(first)
    if tb and not isinstance(getattr(exc, "errors", {}).get(first), CpkvError):
        print(f"rank {first}'s traceback:\n" + "\n".join("    " + x for x in tb.rstrip().splitlines()), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command, target = _chosen(argv)
    name = " ".join(x for x in (command, target) if x) if command in (*COMMANDS, *GROUPS) else ""
    bad_env = envs.problems()
    if bad_env and command != "env":  # ``cpkv env`` shows them itself
        print(f"cpkv{' ' + name if name else ''}: error: {'; '.join(bad_env)} (see cpkv env)", file=sys.stderr)
        return 2
    if not bad_env:
        logging.basicConfig(level=envs.get("CPKV_LOG_LEVEL"), format="%(levelname)s %(name)s: %(message)s")
    old = _install_stop_handlers()
    try:
        args = build_parser(argv).parse_args(argv)
        return int(args._run(args) or 0)
    except CpkvError as exc:
        from cpkv.cli.fmt import printable
        print(f"cpkv {name}: error: {printable(str(exc))}", file=sys.stderr)
        _rank_traceback(exc)
        return 2
    except Stopped as exc:
        print(f"cpkv{' ' + name if name else ''}: stopped by {exc.args[0]}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("cpkv: interrupted", file=sys.stderr)
        return 130
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
