"""One typed registry of environment variables, all prefixed ``CPKV_``.

Read a value with ``envs.get("CPKV_BARRIER_TIMEOUT_S")``; list them with ``cpkv env``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from cpkv.config import COMPOSE_MODES
from cpkv.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{self.name}={raw!r}: expected {self.parse.__name__} ({exc})") from None

    def raw(self) -> str | None:
        return os.environ.get(self.name)


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("one of 1/0/true/false/yes/no/on/off")


_bool.__name__ = "bool"

_VARS: tuple[EnvVar, ...] = (
    EnvVar("CPKV_BARRIER_TIMEOUT_S", 60.0, float, "Seconds a counting barrier waits before raising ComposeTimeout."),
    EnvVar("CPKV_MQA_LOGITS_CHUNK_MAX_GB", 2.0, float, "Budget in GiB for one chunk of indexer logits (rows x visible keys x 4 B)."),
    EnvVar("CPKV_COMPOSE_MODE", "symm", str, f"Default compose mode ({', '.join(COMPOSE_MODES)})."),
    EnvVar("CPKV_DISABLE_PEER_MEMORY", False, _bool, "Force the collective fallback: never use peer memory."),
    EnvVar("CPKV_DISABLE_TRITON", False, _bool, "Use the pure-torch references even on CUDA."),
    EnvVar("CPKV_MASTER_PORT", 0, int, "TCP port for the rank processes' rendezvous (0: pick a free one)."),
    EnvVar("CPKV_LOG_LEVEL", "WARNING", str, "Python logging level of cpkv's loggers."),
)

REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str):
    """Typed value of a registered variable (its default when unset)."""
    try:
        return REGISTRY[name].get()
    except KeyError:
        raise ConfigError(f"unknown environment variable {name!r}; registered: {', '.join(REGISTRY)}") from None
