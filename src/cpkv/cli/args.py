"""Argument helpers shared by the commands: numeric argparse types, output files, device checks. No torch import
at module level.

Numeric types turn a bad value into an argparse usage error (exit 2, one line naming the option, what was
expected and what came). Output files (``--log-batches``, ``--save-trace``, ``--plot``) are checked before any
work starts and written through :func:`atomic_output`, so a failed or interrupted run never leaves a partly
written file behind (an existing file keeps its old contents).
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from cpkv.config import COMPOSE_MODES
from cpkv.errors import ConfigError, CpkvError
from cpkv.files import atomic_output, atomic_path

__all__ = ["MODES_EPILOG", "as_flags", "atomic_output", "atomic_path", "check_distinct", "check_output", "flag_names",
           "flags_of", "int_list", "nonneg_int", "positive_float", "positive_int", "require_cuda"]

# the compose modes, one line each, for the --help of every command that takes --mode / --modes
MODES_EPILOG = "compose modes (byte-identical results):\n" + "\n".join(
    f"  {name:<9} {what}" for name, what in COMPOSE_MODES.items())


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _int_at_least(1, "an integer >= 1")
nonneg_int = _int_at_least(0, "an integer >= 0")


def positive_float(text: str) -> float:
    """A finite float > 0 (timeouts, scales)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """'4096,16384' -> [4096, 16384]: a comma-separated list of integers >= 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1 (e.g. 4096,16384), got {text!r}")
    return values


def check_output(path: str | None, option: str) -> None:
    """Raise ConfigError unless ``path`` can be created: its folder exists and takes a new file (tried with a
    temporary file, removed at once), and it is not itself a folder."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option} {path!r}: expected a file name, got a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"{option} {path!r}: the folder {str(parent)!r} does not exist")
    probe = parent / f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.probe"
    try:
        probe.open("x").close()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{option} {path!r}: cannot create a file in {str(parent)!r} ({exc.strerror})") from None


def check_distinct(paths: Mapping[str, str | None], inputs: Mapping[str, str | None] = {}) -> None:
    """Raise ConfigError when two output options (option -> path) name one file, or an output names an input."""
    seen: dict[str, str] = {}
    for option, path in [*inputs.items(), *paths.items()]:
        if path is None:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise ConfigError(f"{option} {path!r} names the same file as {seen[key]}: each output needs its own file")
        seen[key] = option


@contextmanager
def as_flags(flags: Mapping[str, str]) -> Iterator[None]:
    """Inside the block, an error of a config object names the command's flags instead of its fields
    (``chunk_size 24 must be a multiple of page_size 16`` -> ``--chunk-size 24 ... --page-size 16``)."""
    try:
        yield
    except CpkvError as exc:
        raise type(exc)(flag_names(str(exc), flags)) from None


def flag_names(message: str, flags: Mapping[str, str]) -> str:
    for field, flag in sorted(flags.items(), key=lambda kv: -len(kv[0])):
        message = re.sub(rf"(?<![\w-]){re.escape(field)}(?!\w)", flag, message)
    return message


def flags_of(names: Sequence[str]) -> dict[str, str]:
    """field -> --field-name for config fields named like their flags."""
    return {n: "--" + n.replace("_", "-") for n in names}


def require_cuda(device: str, command: str) -> None:
    """Raise ConfigError when ``device`` is cuda and torch sees no CUDA device (imports torch)."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{command} runs on --device cuda (the default), but torch sees no CUDA device on this "
                          "machine; --device cpu runs it on the CPU")
