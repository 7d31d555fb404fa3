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
from cpkv.upload import upload, upload_arrays

GIB = 1 << 30
COL_ALIGN = 4  # logits rows padded to 16 B (the top-k kernel reads aligned quads)


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
        off = np.zeros(a.size, np.int64)
        for c in chunks:
            off[c.row_start: c.row_end] = c.key_start
        # the four int32 bound arrays in one asynchronous copy (no host sync)
        ks_d, ke_d, rel_ks, rel_ke = upload_arrays([v.astype(np.int32) for v in (a, b, a - off, b - off)], device)
        max_len = int(np.maximum(b - a, 0).max()) if a.size else 0
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
    takes rows while they fit. Empty rows (ks == ke) widen no chunk. Vectorised: per chunk, running key
    bounds over the remaining rows and the first row whose cost exceeds the budget (costs only grow)."""
    a, b = np.asarray(ks, dtype=np.int64).reshape(-1), np.asarray(ke, dtype=np.int64).reshape(-1)
    _check_rows(a, b, budget)
    empty = a == b
    lo_all = np.where(empty, np.iinfo(np.int64).max, a)
    hi_all = np.where(empty, np.iinfo(np.int64).min, b)
    chunks: list[IndexerChunk] = []
    start, n = 0, a.size
    if n:  # the common case: every row fits one chunk (the greedy's costs only grow, the last is the largest)
        lo, hi = int(lo_all.min()), int(hi_all.max())
        if hi <= lo or n * padded(hi - lo) * 4 <= budget:
            k0, k1 = (lo, hi) if hi > lo else (0, 0)
            return [IndexerChunk(0, n, k0, k1, int((b - a).max()))]
    while start < n:
        lo, hi = np.minimum.accumulate(lo_all[start:]), np.maximum.accumulate(hi_all[start:])
        seen = hi > lo  # some non-empty row so far
        width = np.where(seen, hi - lo, 0)
        cost = np.arange(1, n - start + 1) * (-(-width // COL_ALIGN) * COL_ALIGN) * 4
        over = np.flatnonzero(seen & (cost > budget))
        end = start + (int(over[0]) if over.size else n - start)
        j = end - start - 1
        k0, k1 = (int(lo[j]), int(hi[j])) if seen[j] else (0, 0)
        chunks.append(IndexerChunk(start, end, k0, k1, int((b[start:end] - a[start:end]).max())))
        start = end
    return chunks


def _check_rows(a: np.ndarray, b: np.ndarray, budget: int) -> None:
    """IndexerError for the first row with ke < ks or whose own logits row exceeds the budget."""
    w = b - a
    bad = np.flatnonzero((w < 0) | ((-(-np.maximum(w, 0) // COL_ALIGN) * COL_ALIGN) * 4 > budget))
    if not bad.size:
        return
    i = int(bad[0])
    if b[i] < a[i]:
        raise IndexerError(f"row {i}: ke ({b[i]}) < ks ({a[i]})")
    raise IndexerError(f"row {i} sees {b[i] - a[i]} keys: {padded(int(b[i] - a[i])) * 4} B of logits exceed the "
                       f"chunk budget of {budget} B")
