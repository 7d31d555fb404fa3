"""Argument helpers shared by the commands: bounded numeric argparse types, output files, device checks. No torch
import at module level.

Numeric types carry their range (``bounds``, ``range_text``; the registry appends it to each option's --help)
and turn a bad value into an argparse usage error (exit 2, one line naming the option, what was expected and
what came), before anything is read or allocated. The limits themselves (``MAX_*``) are listed in docs/reliability.md.
Output files (``--logits-out``, ``--log-batches``, ``--save-trace``, ``--plot``) follow the
output policy of :mod:`cpkv.files`: checked before any work starts, written through :func:`atomic_output`.
"""
from __future__ import annotations

import argparse
import re
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Sequence

from cpkv.config import COMPOSE_MODE_ALIASES, COMPOSE_MODES
from cpkv.errors import ConfigError, CpkvError
from cpkv.files import atomic_output, atomic_path, check_output, check_outputs

__all__ = ["MODES_EPILOG", "as_flags", "atomic_output", "atomic_path", "bounded_float", "bounded_int", "check_distinct",
           "check_output", "check_outputs", "document_ranges", "flag_names", "flags_of", "int_list", "nonneg_int",
           "positive_float", "positive_int", "require_cuda"]

# the compose modes, one line each, for the --help of every command that takes --mode / --modes
MODES_EPILOG = "compose modes (byte-identical results):\n" + "\n".join(
    f"  {name:<14} {what}" for name, what in COMPOSE_MODES.items()) + "\nearlier spellings, still accepted: " + ", ".join(
    f"{old} = {name}" for old, name in COMPOSE_MODE_ALIASES.items())


def _number_text(x: float) -> str:
    """4096 -> '4096', 2**40 -> '2^40', 2**63-1 -> '2^63-1' (ranges in --help and errors stay short)."""
    if isinstance(x, int) and x >= 1 << 20:
        if x & (x - 1) == 0:
            return f"2^{x.bit_length() - 1}"
        if (x + 1) & x == 0:
            return f"2^{x.bit_length()}-1"
    return f"{x:g}" if isinstance(x, float) else str(x)


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in low..high (``.bounds``; the range is added to the option's --help)."""
    what = f"an integer in {_number_text(low)}..{_number_text(high)}"

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {_clip_number(text)}")
        return value
    parse.__name__ = what  # argparse names the type in some messages
    parse.bounds = (low, high)  # type: ignore[attr-defined]
    parse.range_text = f"{_number_text(low)}..{_number_text(high)}"  # type: ignore[attr-defined]
    return parse


def bounded_float(low: float, high: float, low_open: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite number in (low, high] (``low_open``) or [low, high]."""
    what = f"a finite number {'>' if low_open else '>='} {_number_text(float(low))} and <= {_number_text(float(high))}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        above = value > low if low_open else value >= low
        if not (above and value <= high):  # NaN fails both
            raise argparse.ArgumentTypeError(f"expected {what}, got {_clip_number(text)}")
        return value
    parse.__name__ = what
    parse.bounds = (low, high)  # type: ignore[attr-defined]
    parse.range_text = f"{'>' if low_open else '>='} {_number_text(float(low))}, <= {_number_text(float(high))}"  # type: ignore[attr-defined]
    return parse


def _clip_number(text: str, width: int = 40) -> str:
    text = text.strip()
    return text if len(text) <= width else f"{text[:20]}...({len(text)} characters)"


def document_ranges(parser: argparse.ArgumentParser) -> None:
    """Append each bounded option's range to its --help line (the ranges live in one place: the types)."""
    for action in parser._actions:
        text = getattr(action.type, "range_text", None)
        if text and action.help is not argparse.SUPPRESS and text not in (action.help or ""):
            action.help = f"{action.help} [{text}]" if action.help else f"[{text}]"


# the limits every numeric option of every command is held to (docs/reliability.md)
MAX_RANKS = 64              # rank processes one command starts on one host (--cp of run, check, benches)
MAX_SIM_RANKS = 4096        # ranks a simulation models (replay, layout)
MAX_TOKENS = 1 << 24        # tokens of one prompt or chunk (the trace format's prompt_len cap)
MAX_LAYERS = 1024
MAX_PAGE_SIZE = 1 << 16
MAX_PAGES = 1 << 24         # pages of one pool (device pool per rank, host tier)
MAX_KV_TOKENS = 1 << 40     # a simulated rank's KV budget in tokens (replay; the pages must fit host memory)
MAX_BATCH_REQUESTS = 1 << 16
MAX_TRACE_REQUESTS = 1_000_000
MAX_SEED = (1 << 63) - 1
MAX_TIMEOUT_S = 7 * 86400.0
MAX_SCALE = 1000.0

positive_int = bounded_int(1, 1 << 31)
nonneg_int = bounded_int(0, 1 << 31)
ranks = bounded_int(1, MAX_RANKS)
sim_ranks = bounded_int(1, MAX_SIM_RANKS)
tokens = bounded_int(1, MAX_TOKENS)
layers = bounded_int(1, MAX_LAYERS)
experts = bounded_int(1, 1 << 16)
page_size = bounded_int(1, MAX_PAGE_SIZE)
batch_requests = bounded_int(1, MAX_BATCH_REQUESTS)
trace_requests = bounded_int(1, MAX_TRACE_REQUESTS)
seed = bounded_int(0, MAX_SEED)
timeout_s = bounded_float(0.0, MAX_TIMEOUT_S)
positive_float = bounded_float(0.0, 1e12)


def share(text: str) -> float:
    """An argparse type: a share in [0, 1) (a cached fraction)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1), got {_clip_number(text)}")
    return value


share.bounds = (0.0, 1.0)  # type: ignore[attr-defined]
share.range_text = "0 <= x < 1"  # type: ignore[attr-defined]


def int_list(text: str) -> list[int]:
    """'4096,16384' -> [4096, 16384]: a comma-separated list of integers >= 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 or max(values) > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers in 1..{_number_text(MAX_TOKENS)} (e.g. "
                                         f"4096,16384), got {_clip_number(text)!r}")
    return values


int_list.bounds = (1, MAX_TOKENS)  # type: ignore[attr-defined]
int_list.range_text = "each 1..2^24"  # type: ignore[attr-defined]


def check_distinct(paths: Mapping[str, str | None], inputs: Mapping[str, object] = {}) -> None:
    """Every output path (option -> path) can take a file under the output policy (cpkv.files) and names
    neither an input (label -> path or paths) nor another output; ConfigError naming the option otherwise."""
    check_outputs(paths, inputs)  # type: ignore[arg-type]


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


def choice_list(spec: str, flag: str, choices) -> list[str]:
    """A comma-separated list of distinct values of ``choices``, in order (ConfigError naming ``flag`` otherwise)."""
    out = [v for v in spec.split(",") if v]
    if not out or any(v not in choices for v in out) or len(set(out)) != len(out):
        raise ConfigError(f"{flag}: expected distinct values of {', '.join(choices)}, comma-separated; got {spec!r}")
    return out
