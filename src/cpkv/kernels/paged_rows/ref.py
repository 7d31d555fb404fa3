"""Rows of a paged pool, read across the group, pure torch: the semantics the paged decode kernels match.

    pools[r]  uint8 [num_pages * page_size, row_bytes]   rank r's rows of one layer and kind (peer memory's view)
    owner     int64 [n]                                 the rank holding each wanted row
    row       int64 [n]                                 its row in that pool (page * page_size + offset); -1: none
    ->        uint8 [n, row_bytes]                      pools[owner[i]][row[i]]; zeros where row[i] < 0

No host synchronisation and any n (0 included): each pool is read at every position and the owner's rows kept,
so the reference reads cp times the bytes a kernel would (a CPU path and a test oracle, not a fast path).
"""
from __future__ import annotations

from typing import Sequence

import torch


def paged_rows_ref(pools: Sequence[torch.Tensor], owner: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """See the module docstring."""
    if not pools:
        raise ValueError("paged_rows_ref needs every rank's pool (none given)")
    width = pools[0].shape[-1]
    out = torch.zeros((row.shape[0], width), dtype=torch.uint8, device=pools[0].device)
    for r, pool in enumerate(pools):
        mine = (owner == r) & (row >= 0)
        got = pool.index_select(0, torch.where(mine, row, torch.zeros_like(row)))
        out = torch.where(mine[:, None], got, out)
    return out
