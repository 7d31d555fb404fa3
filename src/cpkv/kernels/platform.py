"""Platform facts, looked up in one place, and the kernel backends chosen from them once.

    triton_importable() / gluon_importable()   Triton (and Gluon's Hopper API) importable, checked once
    capability(x) / sm_count(x)                a CUDA tensor's / device's compute capability and SM count (cached)
    resolve(device) -> Backends                the kernels a device runs: the platform and the ``CPKV_*``
                                               environment read once, at start-up (a model's load)
    backends_for(x) -> Backends                the same, cached per device: for dispatch functions called on
                                               their own (tests, benchmarks) without a Backends

Every dispatch point takes a ``Backends`` from the object that runs it (the model hands its own to its layers,
linears and experts), so the per-call path reads no environment variable: ``CPKV_DISABLE_TRITON``,
``CPKV_SPARSE_MLA``, ``CPKV_GROUPED_MM_TORCH`` and ``CPKV_FP8_GEMV`` are honoured when the backends are resolved.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from cpkv import envs
from cpkv.config import FP8_GEMV_AUTO_ROWS, FP8_GEMV_MAX_ROWS
from cpkv.errors import ConfigError

SPARSE_MLA = ("flashmla", "cpkv")  # Backends.sparse_mla: FlashMLA where it takes the call, else cpkv's kernel
GROUPED_MM = ("gluon", "torch")  # Backends.grouped_mm: the bf16 routed experts' grouped GEMM


@dataclass(frozen=True)
class Backends:
    """The kernels one device runs, resolved once and held by the objects that run them.

    ``triton``: cpkv's Triton / Gluon kernels run (CUDA, Triton importable, ``CPKV_DISABLE_TRITON`` off); else the
    pure-torch references. ``sparse_mla``: ``flashmla`` (FlashMLA's kernel where it takes the call's shapes, else
    as ``cpkv``) or ``cpkv`` (cpkv's kernel where ``triton``, else the reference). ``grouped_mm``: ``gluon`` (bf16
    routed experts through cpkv's warp-specialised grouped GEMM where it takes the shapes) or ``torch``
    (``torch._grouped_mm`` where it applies, else one expert at a time). ``fp8_gemv_rows``: the fp8 linears send
    products of at most this many rows to cpkv's Triton GEMV (``kernels/fp8_gemm/gemv.py``; 0: never, all go to
    ``torch._scaled_mm``); taken only with ``triton``."""

    triton: bool = False
    sparse_mla: str = "cpkv"
    grouped_mm: str = "torch"
    fp8_gemv_rows: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.fp8_gemv_rows <= FP8_GEMV_MAX_ROWS:
            raise ConfigError(f"Backends.fp8_gemv_rows: expected 0..{FP8_GEMV_MAX_ROWS}, got {self.fp8_gemv_rows}")
        for name, value, names in (("sparse_mla", self.sparse_mla, SPARSE_MLA),
                                   ("grouped_mm", self.grouped_mm, GROUPED_MM)):
            if value not in names:
                raise ConfigError(f"Backends.{name}: expected one of {', '.join(names)}, got {value!r}")


REFERENCE = Backends()  # the pure-torch references (every CPU device)


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """True when ``import triton`` would succeed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=1)
def gluon_importable() -> bool:
    """True when Triton's Gluon dialect with its Hopper API imports (newer Triton builds only)."""
    if not triton_importable():
        return False
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(device: torch.device | str, *, disable_triton: bool | None = None, sparse_mla: str | None = None,
            grouped_mm_torch: bool | None = None, fp8_gemv: str | None = None) -> Backends:
    """The backends of ``device``; each argument left None is read from its ``CPKV_*`` variable (here, once per
    call: call it at start-up). A CPU device gets ``REFERENCE``. ``sparse_mla``: the choice ``auto`` / ``cpkv`` /
    ``flashmla`` (``SPARSE_MLA_CHOICES``); ``flashmla`` where the ``flash_mla`` package does not import is a
    ConfigError naming why. ``fp8_gemv``: ``CPKV_FP8_GEMV``'s text (``fp8_gemv_rows``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return REFERENCE
    if disable_triton is None:
        disable_triton = envs.get("CPKV_DISABLE_TRITON")
    if grouped_mm_torch is None:
        grouped_mm_torch = envs.get("CPKV_GROUPED_MM_TORCH")
    hopper = capability(device)[0] == 9
    gluon = hopper and gluon_importable() and not (grouped_mm_torch or disable_triton)  # Gluon is Triton's
    triton = triton_importable() and not disable_triton
    gemv = fp8_gemv_rows(envs.get("CPKV_FP8_GEMV") if fp8_gemv is None else fp8_gemv)
    return Backends(triton=triton,
                    sparse_mla=_sparse_mla(envs.get("CPKV_SPARSE_MLA") if sparse_mla is None else sparse_mla, hopper),
                    grouped_mm="gluon" if gluon else "torch", fp8_gemv_rows=gemv if triton else 0)


def fp8_gemv_rows(choice: str) -> int:
    """The most rows the fp8 GEMV takes under a ``CPKV_FP8_GEMV`` choice: auto, on (the kernel's limit), off (0) or
    a count (cpkv.config's FP8_GEMV_* constants)."""
    named = {"auto": FP8_GEMV_AUTO_ROWS, "on": FP8_GEMV_MAX_ROWS, "off": 0}
    low = choice.strip().lower()
    if low in named:
        return named[low]
    if not low.isdigit() or int(low) > FP8_GEMV_MAX_ROWS:
        raise ConfigError(f"fp8 GEMV: expected one of auto, on, off or a row count 0..{FP8_GEMV_MAX_ROWS}, "
                          f"got {choice!r}")
    return int(low)


def _sparse_cpkv(hopper: bool) -> str:
    return "cpkv"


def _sparse_auto(hopper: bool) -> str:
    from cpkv.kernels.sparse_mla import flashmla

    return "flashmla" if hopper and flashmla.load() is not None else "cpkv"


def _sparse_flashmla(hopper: bool) -> str:
    from cpkv.kernels.sparse_mla import flashmla

    if flashmla.load() is None:  # the import error is read only for the message (each attempt is costly)
        raise ConfigError(f"CPKV_SPARSE_MLA=flashmla: expected the flash_mla package, got {flashmla.import_error()}")
    return "flashmla" if hopper else "cpkv"


SPARSE_MLA_CHOICES = {"auto": _sparse_auto, "cpkv": _sparse_cpkv, "flashmla": _sparse_flashmla}


def _sparse_mla(choice: str, hopper: bool) -> str:
    """The sparse MLA implementation a choice of ``SPARSE_MLA_CHOICES`` gives on a (Hopper or other) CUDA GPU."""
    if choice not in SPARSE_MLA_CHOICES:
        raise ConfigError(f"sparse MLA backend: expected one of {', '.join(SPARSE_MLA_CHOICES)}, got {choice!r}")
    return SPARSE_MLA_CHOICES[choice](hopper)


def backends_for(x: torch.Tensor | torch.device | str) -> Backends:
    """``resolve`` of a tensor's / device's device, cached per device for the process (``REFERENCE`` off CUDA):
    what a dispatch function called on its own, without a Backends, runs (the model passes its own)."""
    device = x.device if isinstance(x, torch.Tensor) else torch.device(x)
    return REFERENCE if device.type != "cuda" else _cached(_index(device))


@functools.lru_cache(maxsize=None)
def _cached(index: int) -> Backends:
    return resolve(torch.device("cuda", index))


def use_triton(x: torch.Tensor | torch.device) -> bool:
    """True when the Triton kernels may run on ``x``'s device (``resolve(device).triton``, the environment read
    now): for an object that decides once, when it is built (the compose runtime, a barrier)."""
    device = x if isinstance(x, torch.device) else x.device
    return device.type == "cuda" and triton_importable() and not envs.get("CPKV_DISABLE_TRITON")


@functools.lru_cache(maxsize=None)
def _properties(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def _index(x: torch.Tensor | torch.device | int | None) -> int:
    if isinstance(x, torch.Tensor):
        x = x.device
    if isinstance(x, torch.device):
        x = x.index
    return torch.cuda.current_device() if x is None else int(x)


def capability(x: torch.Tensor | torch.device | int | None) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA tensor's / device's GPU; None for a CPU tensor or device."""
    if isinstance(x, torch.Tensor) and not x.is_cuda or isinstance(x, torch.device) and x.type != "cuda":
        return None
    return _properties(_index(x))[0]


def sm_count(x: torch.Tensor | torch.device | int | None) -> int:
    """Streaming multiprocessors of a CUDA tensor's / device's GPU."""
    return _properties(_index(x))[1]
