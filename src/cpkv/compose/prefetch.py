"""Prefetcher: the ``prefetch`` mode's gathers of the next layer's prefix pages, ahead of time (docs/design.md §4).

Per kind at most one gather is pending: (plan, layer, arena half) and, on GPU, the event its side stream
recorded. The compose of that (plan, layer, kind, half) takes it (a hit: its prefix pages are in place); any
other compose of the kind first orders the current stream after it, because it writes the arena either way.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from cpkv.compose.plan import ComposePlan
from cpkv.config import KINDS


@dataclass
class _Pending:
    plan: ComposePlan
    layer: int
    half: int
    event: torch.cuda.Event | None


class Prefetcher:
    """One rank's pending prefetch per kind, its side stream (GPU) and its hit count (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending: dict[str, _Pending | None] = {k: None for k in KINDS}
        self.hits = 0

    @contextmanager
    def ahead(self, plan: ComposePlan, layer: int, kind: str, half: int) -> Iterator[None]:
        """The gathers inside run ahead of the stream (on the side stream on GPU) and become the pending prefetch
        of ``kind`` for (plan, layer, half)."""
        event = None
        if self.side_stream is not None:
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side_stream):
                yield
                event = torch.cuda.Event()
                event.record(self.side_stream)
        else:
            yield
        self.pending[kind] = _Pending(plan, layer, half, event)

    def take(self, plan: ComposePlan, layer: int, kind: str, half: int) -> bool:
        """True (and the prefetched pages are ready) when a prefetch of exactly this use is pending."""
        p = self.settle(kind)
        if p is None or p.plan is not plan or p.layer != layer or p.half != half:
            return False
        self.hits += 1
        return True

    def settle(self, kind: str) -> _Pending | None:
        """Order the current stream after a pending prefetch of ``kind`` (hit or stale: it writes the arena)."""
        p, self.pending[kind] = self.pending[kind], None
        if p is not None and p.event is not None:
            torch.cuda.current_stream(self.device).wait_event(p.event)
        return p
