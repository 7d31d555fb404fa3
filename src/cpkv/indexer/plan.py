"""Per-batch ragged indexer plan (docs/design.md §5, §8): built once per batch from host lists, reused by
every layer, so a layer's indexer call does no host work beyond a loop over a few chunks and never
reads a device value.

Dense key buffer of a batch (composed per layer; request r's visible keys are rows base_r ...):

    rows:   | req 0: prefix ... current | req 1: prefix ... current | ...
            ^ base_0                     ^ base_1
    query token at sequence position p of request r (causal) sees ks = base_r, ke = base_r + p + 1

This rank's query tokens of a request may be several runs (zigzag gives each rank two runs of pages):
they are given as the list of their positions, in the order the rank holds the tokens.

Chunks: consecutive query rows [row_start, row_end) whose logits block
rows x padded width x 4 B (width = max ke - min ks over the rows, padded to 4 columns) fits the
budget; a single row that cannot fit raises IndexerError.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from cpkv import envs
from cpkv.errors import IndexerError
from cpkv.kernels.mqa_logits.work import WorkShape, logits_work_items
from cpkv.upload import stage, upload

GIB = 1 << 30
COL_ALIGN = 4  # logits rows padded to 16 B (the top-k kernel reads aligned quads); a power of two
_FAR = 1 << 62  # beyond any key row
_BLOCK = 2048  # rows a block in split_chunks


def default_chunk_max_bytes() -> int:
    """The budget from CPKV_MQA_LOGITS_CHUNK_MAX_GB (GiB, default 2)."""
    return int(envs.get("CPKV_MQA_LOGITS_CHUNK_MAX_GB") * GIB)


def padded(width: int) -> int:
    return -(-width // COL_ALIGN) * COL_ALIGN


@dataclass(frozen=True)
class IndexerChunk:
    """Query rows [row_start, row_end) whose logits cover keys [key_start, key_end); max_len: the
    longest row's ke - ks (when <= topk the chunk needs no logits)."""

    row_start: int
    row_end: int
    key_start: int
    key_end: int
    max_len: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def width(self) -> int:
        return self.key_end - self.key_start

    @property
    def nbytes(self) -> int:
        return self.rows * padded(self.width) * 4


@dataclass(frozen=True, eq=False)
class IndexerPlan:
    """ks/ke: int32 [T] on the device (absolute dense rows); rel_ks/rel_ke: int32 [T], the same bounds
    as columns of each row's chunk; chunks: host-side; max_len: longest row (host int); host_ks / host_ke:
    the bounds as host int64 arrays, from which the logits kernel's work items are built (work_items)."""

    ks: torch.Tensor
    ke: torch.Tensor
    rel_ks: torch.Tensor
    rel_ke: torch.Tensor
    chunks: tuple[IndexerChunk, ...]
    chunk_max_bytes: int
    max_len: int
    host_ks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    host_ke: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _items: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.ks.shape[0]

    @property
    def max_chunk_elems(self) -> int:
        return max((c.nbytes // 4 for c in self.chunks), default=0)

    @classmethod
    def build(
        cls,
        requests: Sequence[tuple[int, Sequence[int]]],
        device: torch.device | str,
        chunk_max_bytes: int | None = None,
    ) -> "IndexerPlan":
        """requests: per request (dense base row, sequence positions of this rank's query tokens);
        rows are laid out request after request, positions in the given order."""
        ks: list[int] = []
        ke: list[int] = []
        for i, (base, positions) in enumerate(requests):
            if base < 0 or any(p < 0 for p in positions):
                raise IndexerError(f"request {i}: base row and positions must be >= 0, got base {base}")
            ks.extend([base] * len(positions))
            ke.extend(base + p + 1 for p in positions)
        return cls.from_bounds(ks, ke, device, chunk_max_bytes)

    @classmethod
    def from_bounds(
        cls,
        ks: Sequence[int],
        ke: Sequence[int],
        device: torch.device | str,
        chunk_max_bytes: int | None = None,
    ) -> "IndexerPlan":
        """Host per-row bounds (sequences or int arrays; ks <= ke; an empty row has ks == ke) -> plan on
        ``device``. Vectorised on the host (numpy), uploaded without a host synchronisation."""
        if len(ks) != len(ke):
            raise IndexerError(f"ks and ke must have the same length, got {len(ks)} and {len(ke)}")
        budget = default_chunk_max_bytes() if chunk_max_bytes is None else int(chunk_max_bytes)
        a, b = np.asarray(ks, dtype=np.int64).reshape(-1), np.asarray(ke, dtype=np.int64).reshape(-1)
        chunks = split_chunks(a, b, budget)
        # the four int32 bound arrays written straight into one staged upload (no temporaries; no host sync)
        staged = stage([a.size] * 4, np.int32, device)
        ks_h, ke_h, rel_ks_h, rel_ke_h = staged.host
        ks_h[:], ke_h[:] = a, b
        for c in chunks:
            r = slice(c.row_start, c.row_end)
            np.subtract(a[r], c.key_start, out=rel_ks_h[r], casting="same_kind")
            np.subtract(b[r], c.key_start, out=rel_ke_h[r], casting="same_kind")
        ks_d, ke_d, rel_ks, rel_ke = staged.send()
        max_len = max((c.max_len for c in chunks), default=0)  # widths are >= 0 (split_chunks checked them)
        return cls(ks_d, ke_d, rel_ks, rel_ke, tuple(chunks), budget, max_len, a, b)

    def work_items(self, chunk: IndexerChunk, shape: WorkShape) -> torch.Tensor:
        """The logits kernel's work items of ``chunk`` for ``shape`` (cpkv.kernels.mqa_logits.work), on the plan's
        device: built on the first call for that chunk and shape, then reused (every layer of the batch)."""
        key = (chunk, shape)
        if key not in self._items:
            r = slice(chunk.row_start, chunk.row_end)
            items = logits_work_items(self.host_ks[r], self.host_ke[r], chunk.key_start, chunk.width, shape)
            self._items[key] = upload(items, self.ks.device)
        return self._items[key]

    def prepare_items(self, shape: WorkShape | None, topk: int, chunks: int | None = None) -> None:
        """Build (and upload) the logits work items of the first ``chunks`` (None: every) chunks that compute
        logits (rows seeing more than ``topk`` keys) for ``shape`` now, so a layer's indexer call finds them
        built. The batch plan builds the first one: the first full layer builds each further one when it reaches
        that chunk, while the GPU works on the chunks before it (built up front, a long prompt's eight chunks
        kept the GPU idle ~10 ms per 32K chunk); later layers find them all built. ``shape`` None: nothing."""
        if shape is None:
            return
        todo = [c for c in self.chunks if c.max_len > topk]
        for c in todo if chunks is None else todo[:chunks]:
            self.work_items(c, shape)

    @classmethod
    def from_tensors(cls, ks: torch.Tensor, ke: torch.Tensor, chunk_max_bytes: int | None = None) -> "IndexerPlan":
        """Plan from device bounds: reads them to the host once (a synchronisation; pass a plan
        built from host lists on the hot path)."""
        return cls.from_bounds(ks.tolist(), ke.tolist(), ks.device, chunk_max_bytes)


def split_chunks(ks: Sequence[int] | np.ndarray, ke: Sequence[int] | np.ndarray, budget: int) -> list[IndexerChunk]:
    """Greedy split of rows into chunks whose rows x padded(width) x 4 B stays within ``budget``: each chunk
    takes rows while they fit. Empty rows (ks == ke) widen no chunk.

    A chunk's cost only grows with its rows, so the greedy walks blocks of ``_BLOCK`` rows by their key bounds
    (one ``reduceat`` pass over the rows for all blocks) and runs bounds row by row only inside the block where a
    chunk ends: a batch's plan runs this before its first indexer kernel, and per-row running bounds over all
    remaining rows for every chunk cost ~1 ms at 32K rows."""
    a, b = np.asarray(ks, dtype=np.int64).reshape(-1), np.asarray(ke, dtype=np.int64).reshape(-1)
    w = _check_rows(a, b, budget)
    n = a.size
    if not n:
        return []
    empty = w == 0
    lo_all = np.where(empty, _FAR, a)  # sentinels: an empty row's bounds widen nothing (and hi - lo cannot wrap)
    hi_all = np.where(empty, -_FAR, b)
    lo, hi = int(lo_all.min()), int(hi_all.max())
    if hi <= lo or n * padded(hi - lo) * 4 <= budget:  # the common case: every row fits one chunk
        k0, k1 = (lo, hi) if hi > lo else (0, 0)
        return [IndexerChunk(0, n, k0, k1, int(w.max()))]
    starts = np.arange(0, n, _BLOCK)
    blo, bhi = np.minimum.reduceat(lo_all, starts).tolist(), np.maximum.reduceat(hi_all, starts).tolist()
    limit = budget // 4  # rows x padded width x 4 > budget  <=>  rows x padded width > budget // 4
    chunks: list[IndexerChunk] = []
    start = 0
    while start < n:
        end, lo, hi = _chunk_end(lo_all, hi_all, blo, bhi, start, limit)
        k0, k1 = (lo, hi) if hi > lo else (0, 0)
        chunks.append(IndexerChunk(start, end, k0, k1, int(w[start:end].max())))
        start = end
    return chunks


def _chunk_end(lo_all: np.ndarray, hi_all: np.ndarray, blo: list[int], bhi: list[int], start: int,
               limit: int) -> tuple[int, int, int]:
    """(end, min ks, max ke) of the chunk the greedy starts at row ``start``: block by block while a whole block
    still fits, then row by row inside the block where the first row over ``limit`` is."""
    n = lo_all.size
    lo, hi, pos = _FAR, -_FAR, start
    while pos < n:
        blk = pos // _BLOCK
        stop = min((blk + 1) * _BLOCK, n)
        if pos % _BLOCK == 0:
            l, h = min(lo, blo[blk]), max(hi, bhi[blk])
        else:  # the chunk starts inside this block
            l, h = min(lo, int(lo_all[pos:stop].min())), max(hi, int(hi_all[pos:stop].max()))
        if (stop - start) * padded(max(h - l, 0)) <= limit:
            lo, hi, pos = l, h, stop
            continue
        run_lo = np.minimum.accumulate(lo_all[pos:stop])
        run_hi = np.maximum.accumulate(hi_all[pos:stop])
        np.minimum(run_lo, lo, out=run_lo)
        np.maximum(run_hi, hi, out=run_hi)
        cost = run_hi - run_lo  # <= 0 until a non-empty row
        np.maximum(cost, 0, out=cost)
        cost += COL_ALIGN - 1
        cost &= -COL_ALIGN  # padded width (COL_ALIGN is a power of two)
        cost *= np.arange(pos - start + 1, stop - start + 1, dtype=np.int64)
        k = int((cost > limit).argmax())  # there is one: the whole block did not fit; never the chunk's first row
        if k:
            return pos + k, int(run_lo[k - 1]), int(run_hi[k - 1])
        return pos, lo, hi
    return n, lo, hi


def _check_rows(a: np.ndarray, b: np.ndarray, budget: int) -> np.ndarray:
    """The rows' widths ke - ks; IndexerError for the first row with ke < ks or whose own logits row exceeds the
    budget."""
    w = b - a
    if not w.size or (int(w.min()) >= 0 and padded(int(w.max())) * 4 <= budget):  # two reductions when all is well
        return w
    bad = np.flatnonzero((w < 0) | ((-(-np.maximum(w, 0) // COL_ALIGN) * COL_ALIGN) * 4 > budget))
    i = int(bad[0])
    if b[i] < a[i]:
        raise IndexerError(f"row {i}: ke ({b[i]}) < ks ({a[i]})")
    raise IndexerError(f"row {i} sees {b[i] - a[i]} keys: {padded(int(b[i] - a[i])) * 4} B of logits exceed the "
                       f"chunk budget of {budget} B")
