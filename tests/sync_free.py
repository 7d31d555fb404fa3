"""CUDA calls checked to make no device->host synchronisation (imported by the GPU tests; tests/ is on the path)."""
from __future__ import annotations

from typing import Any, Callable


def sync_free(fn: Callable[[], Any]) -> Any:
    """fn() under torch's sync debug mode "error" (any device->host synchronisation raises), after a synchronise."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def twice_sync_free(fn: Callable[[], Any]) -> Any:
    """fn() once (JIT compiles, autotuning, first allocations), then again under ``sync_free``: its result."""
    fn()
    return sync_free(fn)
