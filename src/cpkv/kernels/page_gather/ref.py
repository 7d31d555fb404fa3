"""Page gather, pure torch: the reference the Triton kernel is tested against, and the path off CUDA.

    out[dest[i]] = sources[src[i]][page[i]]      (whole uint8 pages), or zeros where src[i] == -1; nothing
                                                  written where src[i] == SKIP (-2)
"""
from __future__ import annotations

from typing import Sequence

import torch

SKIP = -2  # a ``src`` value: the entry writes nothing (its destination page is left as it is)


def page_gather_ref(out: torch.Tensor, sources: Sequence[torch.Tensor], dest: torch.Tensor, src: torch.Tensor,
                    page: torch.Tensor) -> None:
    """Reference: ``out[dest[i]] = sources[src[i]][page[i]]``, zeros where ``src[i] == -1``, nothing where
    ``src[i] == SKIP``."""
    dest, src, page = dest.long(), src.long(), page.long()
    none = src == -1
    if bool(none.any()):
        out.index_fill_(0, dest[none], 0)
    for s, source in enumerate(sources):
        sel = src == s
        if bool(sel.any()):
            gather_group(out, source, dest[sel], page[sel])


def gather_group(out: torch.Tensor, source: torch.Tensor, dest: torch.Tensor, page: torch.Tensor) -> None:
    """``out[dest] = source[page]`` for one source (uint8 pages; index tensors int64 on ``out``'s device)."""
    rows = source.index_select(0, page.to(source.device))
    out.index_copy_(0, dest, rows.to(out.device, non_blocking=True))
