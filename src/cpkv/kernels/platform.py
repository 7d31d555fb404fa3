"""Platform facts, looked up in one place: is Triton (and Gluon's Hopper API) importable, may the kernels run
on a tensor's device (CUDA, and ``CPKV_DISABLE_TRITON`` off), the device's compute capability and SM count.

Every kernel dispatch point asks here (``use_triton(x)``) instead of importing Triton itself, so the pure-torch
references run wherever Triton is missing or disabled. Importable checks and device properties are cached:
they are asked per layer.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from cpkv import envs


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


def use_triton(x: torch.Tensor | torch.device) -> bool:
    """True when the Triton / Gluon kernels may run for ``x`` (a tensor or a device): CUDA, Triton importable
    and ``CPKV_DISABLE_TRITON`` off."""
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
