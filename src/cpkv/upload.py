"""Host data onto a device without a host synchronisation (plans are built from host data once per batch).

A CPU tensor copied to CUDA from pageable memory is a synchronous copy: the host waits for the stream to
drain, which exposes every launch latency behind it. ``upload`` stages through pinned memory and copies
asynchronously on the current stream; torch's caching host allocator keeps the pinned block until that
copy has run, so the caller may drop it at once.
"""
from __future__ import annotations

from typing import Sequence

import torch


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: asynchronous through pinned memory on CUDA; on the CPU the
    tensor itself (no copy)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload_list(values: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Python ints -> a ``dtype`` tensor [len(values)] on ``device`` (``upload``)."""
    return upload(torch.tensor(values, dtype=dtype), device)
