"""Staging (peer-visible current pages) and the dense-buffer arena, each in two parity halves.

Staging, per kind, in peer memory::

    staging[kind] : uint8 [2, 1 + C, page_size * row_bytes]      C = caps.staging_pages(page_size)
                         ^ half = layer % 2
                            ^ page 0 reserved (dummy-page convention); a rank's j-th own current page
                              (compact order restricted to that rank) is page j + 1, so its pages form
                              one contiguous, writable block of rows

C is one round of current pages: the chunk in pages plus one slack page per request (a request's
last page may be partial). Layer L writes half L % 2; a half is rewritten (layer L + 2) only after every
rank passed layer L + 1's barrier, hence finished reading layer L. ``check`` raises StagingOverflow on
every rank alike, because it is decided from the batch layout only.

Arena: dense buffers and per-batch scratch come from a deterministic bump arena ``uint8 [2, H]`` (half
= layer % 2, so a prefetch may fill layer L + 1's half while layer L's buffer is in use). Offsets depend
only on the batch (the plan computes them). It is sized at construction from the admission caps;
growing it after registration raises ComposeError.
"""
from __future__ import annotations

import torch

from cpkv.config import KINDS, AdmissionCaps, ModelConfig
from cpkv.errors import ComposeError, StagingOverflow

ALIGN = 256


def align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class Staging:
    """This rank's staging buffers (one per kind), allocated through ``alloc`` (peer memory)."""

    def __init__(self, model: ModelConfig, page_size: int, caps: AdmissionCaps, alloc) -> None:
        self.page_size, self.caps = page_size, caps
        self.capacity = caps.staging_pages(page_size)
        expected = caps.chunk_tokens(page_size) // page_size + caps.max_requests
        assert self.capacity == expected, f"staging identity: {self.capacity} != extend pages + request slack"
        self.page_bytes = {k: page_size * model.row_bytes(k) for k in KINDS}
        self.buffers = {k: alloc((2, 1 + self.capacity, self.page_bytes[k]), f"staging.{k}") for k in KINDS}

    def check(self, num_current: int, num_requests: int) -> None:
        """Raise StagingOverflow when a batch's current pages exceed one round of staging."""
        if num_current > self.capacity:
            raise StagingOverflow(
                f"batch has {num_current} current pages ({num_requests} requests); staging holds {self.capacity} "
                f"= chunk {self.caps.chunk_tokens(self.page_size)} tokens / page {self.page_size} "
                f"+ {self.caps.max_requests} request slack pages")

    def half(self, layer: int, kind: str) -> torch.Tensor:
        """uint8 [1 + C, page_bytes]: the half layer ``layer`` uses."""
        return self.buffers[kind][layer & 1]


class DenseArena:
    """Deterministic bump arena with two parity halves (see module docstring)."""

    def __init__(self, half_bytes: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.half_bytes = align(max(half_bytes, ALIGN))
        self.buffer = torch.empty((2, self.half_bytes), dtype=torch.uint8, device=self.device)
        self.registered = False

    def register(self) -> None:
        """From now on the arena's storage is fixed (peers and plans may hold its addresses)."""
        self.registered = True

    def reserve(self, nbytes: int) -> None:
        """Make each half hold ``nbytes``; growing a registered arena raises ComposeError."""
        if nbytes <= self.half_bytes:
            return
        if self.registered:
            raise ComposeError(
                f"the batch needs {nbytes} arena bytes per parity half, the registered arena holds "
                f"{self.half_bytes}; size it from the admission caps before registration")
        self.half_bytes = align(nbytes)
        self.buffer = torch.empty((2, self.half_bytes), dtype=torch.uint8, device=self.device)

    def view(self, layer: int, offset: int, rows: int, row_bytes: int) -> torch.Tensor:
        """uint8 [rows, row_bytes] at ``offset`` of half ``layer % 2``."""
        n = rows * row_bytes
        if offset + n > self.half_bytes:
            raise ComposeError(f"arena view [{offset}, {offset + n}) exceeds the half's {self.half_bytes} bytes")
        return self.buffer[layer & 1, offset: offset + n].view(rows, row_bytes)


def arena_bytes(page_bytes: dict[str, int], slots: int, compact: int) -> int:
    """Bytes one half needs for dense buffers of ``slots`` pages and ``compact`` scratch pages, every kind."""
    return sum(align(slots * page_bytes[k]) + align(compact * page_bytes[k]) for k in KINDS)


def caps_arena_bytes(page_bytes: dict[str, int], page_size: int, caps: AdmissionCaps) -> int:
    """Arena half size implied by the caps: cached pages + one partial page per request + staging pages."""
    return arena_bytes(page_bytes, caps.max_slots(page_size), caps.staging_pages(page_size))
