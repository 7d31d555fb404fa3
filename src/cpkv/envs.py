"""One typed registry of environment variables, all prefixed ``CPKV_``.

Read a value with ``envs.get("CPKV_BARRIER_TIMEOUT_S")``; list them with ``cpkv env``. Every value is parsed
and range-checked by its variable's parser; :func:`problems` lists the bad ones, and the command line checks
them before any command starts (a bad value is one error line naming the variable, never a traceback; so is
a ``CPKV_*`` name that is not registered, with the closest registered name: a misspelling is never ignored).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from cpkv.config import (COMPOSE_MODES, FP8_GEMV_AUTO_ROWS, FP8_GEMV_CHOICES, FP8_GEMV_MAX_ROWS, SPARSE_BACKENDS,
                         compose_mode)
from cpkv.errors import ConfigError

T = TypeVar("T")

PREFIX = "CPKV_"
# the compose modes by name: cpkv.config.COMPOSE_MODES (torch-free), which cpkv.compose.modes implements
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """``parse`` turns the raw text into a value or raises ValueError whose message says what was expected."""

    name: str
    default: T
    parse: Callable[[str], T]
    help: str
    secret: bool = False  # its value is never shown (``cpkv env``, error messages)

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            shown = "(hidden)" if self.secret else repr(raw)
            raise ConfigError(f"{self.name}={shown}: expected {exc}") from None

    def raw(self) -> str | None:
        return os.environ.get(self.name)

    def problem(self) -> str | None:
        """The error message of the current value, or None when it is unset or valid."""
        try:
            self.get()
        except ConfigError as exc:
            return str(exc)
        return None


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("one of 1/0/true/false/yes/no/on/off")


def _positive_seconds(raw: str) -> float:
    return _positive(raw, "a finite number of seconds > 0")


def _positive_gib(raw: str) -> float:
    return _positive(raw, "a finite number of GiB > 0")


def _number(raw: str, cast: Callable[[str], float], ok: Callable[[float], bool], what: str):
    """``cast(raw)`` when it parses and ``ok`` accepts it; ValueError saying ``what`` was expected otherwise."""
    try:
        value = cast(raw)
    except ValueError:
        raise ValueError(what) from None
    if not ok(value):
        raise ValueError(what)
    return value


def _positive(raw: str, what: str) -> float:
    return _number(raw, float, lambda v: math.isfinite(v) and v > 0, what)


def _nonneg_seconds(raw: str) -> float:
    return _number(raw, float, lambda v: math.isfinite(v) and v >= 0, "a finite number of seconds >= 0")


def _port(raw: str) -> int:
    return _number(raw, int, lambda v: 0 <= v <= 65535, "a TCP port in 0..65535 (0: pick a free one)")


def _api_key(raw: str) -> str:
    if not all(33 <= ord(c) <= 126 for c in raw):
        raise ValueError("printable ASCII without spaces (it travels in an HTTP header)")
    return raw


def _mode(raw: str) -> str:
    raw = compose_mode(raw)  # an earlier spelling names its mode
    if raw not in COMPOSE_MODES:
        raise ValueError(f"one of {', '.join(COMPOSE_MODES)}")
    return raw


def _sparse_backend(raw: str) -> str:
    if raw not in SPARSE_BACKENDS:
        raise ValueError(f"one of {', '.join(SPARSE_BACKENDS)}")
    return raw


def _fp8_gemv(raw: str) -> str:
    """``auto``, ``on``, ``off`` or a row count 0..FP8_GEMV_MAX_ROWS (as text: ``platform.resolve`` maps it)."""
    low = raw.strip().lower()
    if low in FP8_GEMV_CHOICES or low.isdigit() and int(low) <= FP8_GEMV_MAX_ROWS:
        return low
    raise ValueError(f"one of {', '.join(FP8_GEMV_CHOICES)} or a row count 0..{FP8_GEMV_MAX_ROWS}")


DECODE_STEPS = ("auto", "graphs", "static", "gather")


def _decode_step(raw: str) -> str:
    if raw not in DECODE_STEPS:
        raise ValueError(f"one of {', '.join(DECODE_STEPS)}")
    return raw


def _log_level(raw: str) -> str:
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"a logging level, one of {', '.join(LOG_LEVELS)}")
    return level


_VARS: tuple[EnvVar, ...] = (
    EnvVar("CPKV_BARRIER_TIMEOUT_S", 60.0, _positive_seconds,
           "Seconds a counting barrier waits before raising ComposeTimeout."),
    EnvVar("CPKV_MQA_LOGITS_CHUNK_MAX_GB", 2.0, _positive_gib,
           "Budget in GiB for one chunk of indexer logits (rows x visible keys x 4 B)."),
    EnvVar("CPKV_COMPOSE_MODE", "symm", _mode, f"Default compose mode ({', '.join(COMPOSE_MODES)})."),
    EnvVar("CPKV_DISABLE_PEER_MEMORY", False, _bool, "Force the collective fallback: never use peer memory."),
    EnvVar("CPKV_DISABLE_TRITON", False, _bool,
           "Use the pure-torch references even on CUDA, no Triton or Gluon kernel (read once, when a model loads)."),
    EnvVar("CPKV_SPARSE_MLA", "auto", _sparse_backend,
           "Sparse attention: auto (FlashMLA where the flash_mla package imports and takes the call, else cpkv's "
           "kernel), cpkv, or flashmla (an error where it does not import); read once, when a model loads."),
    EnvVar("CPKV_GROUPED_MM_TORCH", False, _bool,
           "bf16 routed experts through torch._grouped_mm even where cpkv's Gluon grouped GEMM applies (to compare; "
           "read once, when a model loads)."),
    EnvVar("CPKV_FP8_GEMV", "auto", _fp8_gemv,
           "fp8 linears of few rows (decode) through cpkv's Triton GEMV instead of torch._scaled_mm (cuBLAS): auto "
           f"(at most {FP8_GEMV_AUTO_ROWS} rows), on (at most {FP8_GEMV_MAX_ROWS}, the kernel's limit), off, or a row "
           "count N (at most N rows; 0: off); only where the Triton kernels run; read once, when a model loads."),
    EnvVar("CPKV_DECODE_STEP", "auto", _decode_step,
           "The paged decode step's form: auto (graphs where the step has no expert exchange on CUDA with cpkv's "
           "kernels, else static where the kernels run, else gather), graphs (the whole step as CUDA graphs per batch "
           "and context bucket), static (the attention read in place by the paged kernels, the rest as gather), "
           "gather (the rows gathered, then the prefill's kernels); read when a decode runner starts."),
    EnvVar("CPKV_MEMORY_SITES", "", str,
           "A diagnostic: a folder where each CUDA rank writes, when its trace loop is set up (the run's setup_bytes "
           "mark), its live GPU memory by allocation site (cpkv's innermost frames), as "
           "memory_sites_r<rank>_<n>.json; allocation history is recorded from the rank's start (slower)."),
    EnvVar("CPKV_MASTER_PORT", 0, _port, "TCP port for the rank processes' rendezvous (0: pick a free one)."),
    EnvVar("CPKV_LOG_LEVEL", "WARNING", _log_level, "Python logging level of cpkv's loggers."),
    EnvVar("CPKV_PROGRESS_S", 5.0, _nonneg_seconds,
           "Seconds between progress lines on stderr when it is not a terminal (0: every update)."),
    EnvVar("CPKV_API_KEY", None, _api_key,
           "cpkv serve's API key (as --api-key): clients send 'Authorization: Bearer KEY'.", secret=True),
)

REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str):
    """Typed value of a registered variable (its default when unset)."""
    try:
        var = REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown environment variable {name!r}; registered: {', '.join(REGISTRY)}") from None
    return var.get()


def unknown_names() -> dict[str, str]:
    """name -> message for each ``CPKV_*`` variable set in the environment that is not registered (a misspelt
    name would otherwise be ignored silently), the message naming the closest registered name."""
    import difflib

    out = {}
    for name in sorted(n for n in os.environ if n.startswith(PREFIX) and n not in REGISTRY):
        close = difflib.get_close_matches(name, REGISTRY, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(REGISTRY)}"
        out[name] = f"{name} is not a cpkv environment variable ({hint})"
    return out


def unknown() -> list[str]:
    """The messages of :func:`unknown_names`."""
    return list(unknown_names().values())


def problems() -> list[str]:
    """One message per registered variable whose current value is invalid and per unknown ``CPKV_*`` name
    (empty when all are fine)."""
    return [p for p in (v.problem() for v in REGISTRY.values()) if p is not None] + unknown()
