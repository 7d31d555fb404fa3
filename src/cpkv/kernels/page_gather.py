"""Page gather: copy whole pages as bytes from a table of sources (pools, stagings) into a dense buffer.

    out    : uint8 [n_out, page_bytes]          destination pages (a dense buffer viewed by pages)
    dest   : int32 [n]                          destination page of entry i
    src    : int32 [n]                          source index of entry i in [0, n_src), or -1 = zero fill
    page   : int64 [n]                          page id inside that source
    Triton: bases   int64 [n_src]  byte address of each source's page 0 (any process-mapped memory:
                                   this rank's pools, peers' pools and stagings mapped through IPC)
    torch:  sources list of n_src uint8 [n_pages_s, page_bytes] tensors

    out[dest[i]] = source[src[i]][page[i]]      (all page_bytes bytes), or zeros where src[i] == -1

The Triton kernel moves 16-byte vectors when ``page_bytes`` and every address are multiples of 16
(4-byte words otherwise, bytes as a last resort). Program (i, c) copies chunk c of entry i's page.
Triton is imported lazily; :func:`page_gather_ref` is the reference and the CPU path.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import torch

DEFAULT_CONFIG = {"chunk": 4096, "block": 1024, "num_warps": 4}


def page_gather_ref(out: torch.Tensor, sources: Sequence[torch.Tensor], dest: torch.Tensor, src: torch.Tensor,
                    page: torch.Tensor) -> None:
    """Reference: ``out[dest[i]] = sources[src[i]][page[i]]``, zeros where ``src[i] == -1``."""
    dest, src, page = dest.long(), src.long(), page.long()
    none = src < 0
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


@lru_cache(maxsize=1)
def load() -> Any:
    """The Triton kernel, compiled on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def _page_gather(OUT, BASES, DEST, SRC, PAGE, out_addr, PAGE_ELEMS: tl.constexpr, ELEM_BYTES: tl.constexpr,
                     VEC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        c0 = tl.program_id(1) * CHUNK
        s = tl.load(SRC + i)
        d = tl.load(DEST + i).to(tl.int64)
        out_page = OUT + d * PAGE_ELEMS
        if s >= 0:
            base = tl.load(BASES + s)
            pg = tl.load(PAGE + i)
            delta = (base + pg * (PAGE_ELEMS * ELEM_BYTES) - out_addr) // ELEM_BYTES
            delta = tl.multiple_of(delta, VEC)
            src_page = OUT + delta
            for c in tl.static_range(0, CHUNK, BLOCK):
                offs = tl.max_contiguous(tl.multiple_of(c0 + c + tl.arange(0, BLOCK), BLOCK), BLOCK)
                mask = offs < PAGE_ELEMS
                x = tl.load(src_page + offs, mask=mask, eviction_policy="evict_first")
                tl.store(out_page + offs, x, mask=mask, cache_modifier=".cs")
        else:
            for c in tl.static_range(0, CHUNK, BLOCK):
                offs = c0 + c + tl.arange(0, BLOCK)
                mask = offs < PAGE_ELEMS
                tl.store(out_page + offs, tl.zeros([BLOCK], dtype=OUT.dtype.element_ty), mask=mask)

    return _page_gather


def _word(page_bytes: int, addr_ok16: bool) -> tuple[torch.dtype, int, int]:
    """(element dtype, element bytes, elements per 16-byte vector) for this page size."""
    if page_bytes % 16 == 0 and addr_ok16:
        return torch.int32, 4, 4
    if page_bytes % 4 == 0:
        return torch.int32, 4, 1
    return torch.uint8, 1, 1


def page_gather_triton(out: torch.Tensor, bases: torch.Tensor, dest: torch.Tensor, src: torch.Tensor,
                       page: torch.Tensor, *, aligned16: bool = True, config: dict | None = None) -> None:
    """Triton gather. ``bases``: int64 [n_src] device tensor of byte addresses; ``aligned16``: every
    address (bases and out) is a multiple of 16. See the module docstring for the semantics."""
    n, page_bytes = dest.numel(), out.shape[-1]
    if n == 0:
        return
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    dtype, ebytes, vec = _word(page_bytes, aligned16 and out.data_ptr() % 16 == 0)
    elems = page_bytes // ebytes
    chunk = min(cfg["chunk"], _pow2_at_least(elems))
    block = min(cfg["block"], chunk)
    grid = (n, -(-elems // chunk))
    load()[grid](out.view(dtype), bases, dest, src, page, out.data_ptr(), PAGE_ELEMS=elems, ELEM_BYTES=ebytes,
                 VEC=vec, CHUNK=chunk, BLOCK=block, num_warps=cfg["num_warps"])


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def triton_available(device: torch.device) -> bool:
    """True when the Triton path may run on ``device`` (CUDA, triton importable, not disabled)."""
    from cpkv import envs
    if device.type != "cuda" or envs.get("CPKV_DISABLE_TRITON"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
