"""Host tier: whole pages offloaded to / loaded from (pinned, where CUDA exists) host memory.

    host[kind]: uint8 [num_layers, host_pages, page_size * row_bytes]

Index lists are page ids, so every copy is page-aligned by construction. Copies are issued per run of
consecutive pages with ``non_blocking=True`` and never inspect device tensors (no stream sync per call);
call ``synchronize()`` before reading offloaded bytes on the host.
"""
from __future__ import annotations

from typing import Sequence

import torch

from cpkv.config import KINDS
from cpkv.kvcache.pool import KVPool


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group (src, dst) id pairs into runs consecutive on both sides: (src_start, dst_start, length)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class HostTier:
    def __init__(self, pool: KVPool, host_pages: int) -> None:
        pin = torch.cuda.is_available() and pool.device.type == "cuda"
        self.pool, self.host_pages = pool, host_pages
        self.buffers = {
            kind: torch.zeros(pool.buffers[kind].shape[0], host_pages + 1, pool.buffers[kind].shape[2],
                              dtype=torch.uint8, pin_memory=pin)
            for kind in KINDS
        }

    def offload(self, page_ids: Sequence[int], slots: Sequence[int]) -> None:
        """host[:, slots[i]] = pool[:, page_ids[i]] for every layer and kind."""
        self._copy(self.pool.buffers, self.buffers, page_ids, slots)

    def load(self, slots: Sequence[int], page_ids: Sequence[int]) -> None:
        """pool[:, page_ids[i]] = host[:, slots[i]] for every layer and kind."""
        self._copy(self.buffers, self.pool.buffers, slots, page_ids)

    @staticmethod
    def _copy(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], a: Sequence[int], b: Sequence[int]) -> None:
        if len(a) != len(b):
            raise ValueError(f"host tier copy: {len(a)} sources for {len(b)} destinations")
        for s, d, n in _runs(a, b):
            for kind in KINDS:
                dst[kind][:, d:d + n].copy_(src[kind][:, s:s + n], non_blocking=True)

    def synchronize(self) -> None:
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()
