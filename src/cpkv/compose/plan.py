"""ComposePlan: every layer-invariant compose descriptor of one batch on one rank, built once.

A plan is built from a ``BatchLayout`` (numpy/python) by ``ComposeRuntime.plan_batch``, its index tensors are
moved to the device once, and the caller passes it to every compose call of the batch (never looked up by
tensor address, never stored on the layout). Every layer and both kinds reuse it. Per slot of the dense buffer::

    slot s  : prefix page  -> source = owner o       (pool of rank o),    page = pool page id
              current page -> source = cp + writer w (staging of rank w), page = its staging page

Staging pages: writer w's j-th own current page (compact order restricted to w) is staging page j + 1
(page 0 is reserved), so a rank's current rows form one contiguous block ``[P, (1 + n_own) * P)`` of
its staging half; ``query_rows[t]`` is the row of that block holding this rank's t-th query token (its
query tokens in ``layout.rank_query_ranges[rank]`` order), ``tail_rows`` the rows past a partial page's
end (zeroed before the writer writes).

Gather entry sets (``Entries``: dest page, source index, source page; -1 source = zero fill):

    all       every slot, global table (2·cp sources)        symm
    prefix    prefix slots from pools, current slots -1      v2, prefetch (ahead of time)
    current   current slots from stagings                    prefetch (after the barrier)
    own       every slot: own prefix pages from the local pool (source 0), own current pages from the
              local staging (source 1), others -1              fused (legacy: one set per request span)
    compact   compact current pages: own from local staging (source 1), others -1      v2
    persist   (with current_page_ids) dest = the rank's own pool pages, from local staging  every mode
"""
from __future__ import annotations

import struct
from bisect import bisect_left
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import numpy as np
import torch

from cpkv.compose.staging import align
from cpkv.config import KINDS
from cpkv.errors import ComposeError
from cpkv.layout import BatchLayout
from cpkv.upload import upload



def _pack_into(out: np.ndarray, values: list[int]) -> None:
    """Write Python ints into contiguous int64 ``out``: struct packs them ~3x faster than numpy converts."""
    struct.pack_into(f"{len(values)}q", out, 0, *values)


Region = tuple[int, np.ndarray]  # (offset in the Packer buffer, writable int64 numpy view)


class Packer:
    """One preallocated int64 buffer for every index array of a plan, moved to the device in one copy.

    ``take(n, rows)`` reserves the next ``rows * n`` elements; ``row(region, i)`` is row i of a 2-D
    take. After ``upload``, ``view(region)`` is the device view of a region (on CPU it shares the numpy
    memory).
    """

    def __init__(self, size: int) -> None:
        self.flat = np.empty(size, np.int64)
        self.used = 0
        self.tensor: torch.Tensor | None = None

    def take(self, n: int, rows: int = 1) -> Region:
        off, self.used = self.used, self.used + n * rows
        view = self.flat[off: self.used]
        return off, (view.reshape(rows, n) if rows > 1 else view)

    @staticmethod
    def row(region: Region, i: int) -> Region:
        off, view = region
        return off + i * view.shape[1], view[i]

    def upload(self, device: torch.device) -> None:
        assert self.used == self.flat.size, (self.used, self.flat.size)
        self.tensor = upload(torch.from_numpy(self.flat), device)  # asynchronous on CUDA (no host sync)

    def view(self, region: Region) -> torch.Tensor:
        assert self.tensor is not None, "upload first"
        return self.tensor[region[0]: region[0] + region[1].size]


class Entries:
    """One gather's descriptors: ``dest`` page, ``src`` index (-1 = zero fill), source ``page``; int64 [n]
    device views of the plan's single upload, made on first use (a mode reads a few of the plan's entry
    sets). ``np`` holds the same arrays on the host; ``groups()`` splits them per source for the torch
    path (built on first use)."""

    def __init__(self, pack: Packer, dest: Region, src: Region, page: Region) -> None:
        self._pack, self._regions = pack, (dest, src, page)
        self.np = (dest[1], src[1], page[1])
        self.n = int(dest[1].size)
        self._groups: tuple[list, torch.Tensor] | None = None
        self.launchers: dict[tuple, Callable[[], None]] = {}  # built kernel launches (compose.launches.GatherLaunches)

    def __getattr__(self, name: str) -> torch.Tensor:
        if name not in ("dest", "src", "page") or "_regions" not in self.__dict__:
            raise AttributeError(name)
        self.dest, self.src, self.page = (self._pack.view(r) for r in self._regions)
        return self.__dict__[name]

    def slice(self, start: int, end: int) -> Entries:
        """Entries [start, end) as views (dest pages unchanged)."""
        out = Entries.__new__(Entries)
        out.np = tuple(a[start:end] for a in self.np)
        out.n, out._groups, out.launchers = end - start, None, {}
        out.dest, out.src, out.page = self.dest[start:end], self.src[start:end], self.page[start:end]
        return out

    def groups(self) -> tuple[list[tuple[int, torch.Tensor, torch.Tensor]], torch.Tensor]:
        """([(source, dest int64, page int64)], dest int64 of the -1 entries) on the entries' device."""
        if self._groups is None:
            dest, src, page = self.np
            dev = self.dest.device
            per = [(int(s), torch.from_numpy(dest[src == s]).to(dev), torch.from_numpy(page[src == s]).to(dev))
                   for s in np.unique(src) if s >= 0]
            self._groups = (per, torch.from_numpy(dest[src < 0]).to(dev))
        return self._groups


@dataclass
class Span:
    """A request's slots [start, end) and the ``own`` entries of those slots (legacy mode; dest is the slot)."""

    start: int
    end: int
    own: Entries


class ComposePlan:
    """Compose descriptors of one batch for one rank (see module docstring).

    Built with one Python pass over the prefix pages (owner, page id) and numpy on whole arrays, no
    per-slot objects. A value table ``V`` int64 [6, M + C] (the M prefix pages in slot order, then the
    C current pages in compact order) holds each page's entry values, rows::

        0 all.src  1 all.page  2 own.src  3 own.page  4 prefix.src  5 prefix.page

    and one ``take`` along the slots (``perm``: slot -> column of V) writes the three slot-indexed
    entry sets at once. Rows 0-3 of the current columns are ``current`` (src, page) and ``compact``
    (src, page). Every int64 array lives in one ``Packer`` buffer uploaded in one copy; ``all``,
    ``prefix`` and ``own`` share their dest (the slots). Small per-request and per-current-page lists
    are built in Python (cheaper than numpy calls at this size).
    """

    def __init__(self, layout: BatchLayout, rank: int, capacity: int, page_bytes: dict[str, int],
                 device: torch.device, current_page_ids: Sequence[int] | None) -> None:
        self.rank, self.cp, self.page_size = rank, layout.cp, layout.page_size
        self.capacity, self.device = capacity, device
        self.num_slots, self.num_current = layout.num_slots, layout.num_current
        self.num_requests = len(layout.requests)
        self._request_slots = [(r.slot_start, r.slot_end) for r in layout.requests]
        self.signature = (layout.cp, layout.page_size, capacity, tuple(page_bytes.items()))
        self.views: dict[tuple, object] = {}  # the runtime's arena and staging-row views of this batch
        self.launch_layers = 0  # layers [0, launch_layers) whose compose launches are built (GatherLaunches)
        self.launch_uses: dict[str, int] = {}  # the staging use counters as layer launch_layers will find them
        own = layout.rank_current[rank]
        self.num_own = len(own)
        tails = self._tails(layout, own)
        self.num_query_tokens = self.num_own * self.page_size - len(tails)
        assert self.num_query_tokens == layout.query_tokens(rank)
        pool_pages = self._persist(current_page_ids, own)
        pack = Packer(7 * self.num_slots + 6 * self.num_current + self.num_own * self.page_size
                      + 3 * len(pool_pages or ()))
        self._entries(layout, pack)
        self._rows(pack, tails)
        pp = None if pool_pages is None else self._persist_entries(pack, pool_pages)
        self._upload(pack, pp)
        self._arena(page_bytes)

    # host descriptors -----------------------------------------------------------------------------

    def _tails(self, layout: BatchLayout, own: Sequence[int]) -> list[int]:
        """Ascending rows j * P + [n_j, P) past the end of this rank's partial own pages j (n_j tokens);
        only a request's last current page can be partial."""
        P, out = self.page_size, []
        for r in layout.requests:
            if r.current_pages:
                c = r.current_pages[-1]
                if c.writer == self.rank and c.end - c.start < P:
                    j = bisect_left(own, c.compact)
                    out += range(j * P + c.end - c.start, (j + 1) * P)
        return out

    def _persist(self, current_page_ids: Sequence[int] | None, own: Sequence[int]) -> list[int] | None:
        """This rank's writer-side pool page per own current page (validated), or None."""
        self._given_ids = current_page_ids
        if current_page_ids is None:
            return None
        ids = current_page_ids
        if isinstance(ids, np.ndarray):
            ids = ids.tolist() if ids.ndim == 1 else ()
        if len(ids) != self.num_current:
            raise ComposeError(f"current_page_ids: expected one writer-side page id per current page "
                               f"({self.num_current}, compact order), got shape {list(np.shape(current_page_ids))}")
        mine = [ids[c] for c in own]
        if mine and (min(mine) < 1 or len(set(mine)) != len(mine)):
            raise ComposeError(f"rank {self.rank}: current page ids must be distinct pool pages >= 1 (page 0 is "
                               f"reserved), got {mine}")
        self.max_own_pool_page = max(mine, default=0)
        return mine

    @cached_property
    def current_page_ids(self) -> np.ndarray | None:
        """int64 [num_current] writer-side pool page per current page (compact order), as given, or None."""
        return None if self._given_ids is None else np.asarray(self._given_ids, np.int64)

    def _writer_order(self, rc: Sequence[Sequence[int]]) -> np.ndarray:
        """int64 [4, C] over the compact ids grouped by writer (``by_writer``): cp + writer, staging page
        (j + 1 for the writer's j-th page), compact src (1 own, else -1), compact page (own, else 0)."""
        cp, C = self.cp, self.num_current
        a = sum(len(x) for x in rc[: self.rank])
        b = a + self.num_own
        by_writer: list[int] = []
        src: list[int] = []
        stage: list[int] = []
        for w, x in enumerate(rc):
            by_writer += x
            src += [cp + w] * len(x)
            stage += range(1, len(x) + 1)
        G = np.empty((5, C), np.int64)
        _pack_into(G.reshape(-1), by_writer + src + stage + [-1] * a + [1] * (b - a) + [-1] * (C - b)
                   + [0] * a + stage[a:b] + [0] * (C - b))
        self.by_writer, self.own_compact = G[0], G[0, a:b]
        return G[1:]

    def _prefix_columns(self, layout: BatchLayout, blk: np.ndarray) -> list[int]:
        """Write owners (row 0) and pool pages (row 1) at every prefix slot of ``blk`` (int64 [6, S], rows
        as in the class docstring); return the current slots (compact order)."""
        current: list[int] = []
        row0, row1 = blk[0], blk[1]
        for r in layout.requests:
            pages, s0 = r.prefix_pages, r.slot_start
            struct.pack_into(f"{len(pages)}q", row0, 8 * s0, *[p.owner for p in pages])
            struct.pack_into(f"{len(pages)}q", row1, 8 * s0, *[p.page_id for p in pages])
            current += range(s0 + len(pages), r.slot_end)
        assert len(current) == self.num_current
        return current

    def _entries(self, layout: BatchLayout, pack: Packer) -> None:
        """The five entry sets: ``all``/``own``/``prefix`` from ``blk`` int64 [6, S] (rows as in the class
        docstring), ``current``/``compact`` from ``cur4`` int64 [4, C] (compact order)."""
        S, C, cp = self.num_slots, self.num_current, self.cp
        slots, blk, cur4 = pack.take(S), pack.take(S, rows=6), pack.take(C, rows=4)
        cs, compact = pack.take(C), pack.take(C)
        B = blk[1]
        _pack_into(cs[1], self._prefix_columns(layout, B))
        mine = B[0] == self.rank  # current columns: not yet written, overwritten below
        np.subtract(mine, 1, out=B[2])  # own pool page: source 0, else -1
        np.multiply(B[1], mine, out=B[3])
        cur4[1][:, self.by_writer] = self._writer_order(layout.rank_current)
        B[0:4, cs[1]] = cur4[1]
        B[4:6] = B[0:2]
        B[4:6, cs[1]] = [[-1], [0]]  # prefix entries zero-fill current slots
        self.is_current = B[0] >= cp
        slots[1][:] = np.arange(S)
        compact[1][:] = slots[1][:C]
        self.current_slots, self.staging_page = cs[1], cur4[1][1]  # staging page by compact index
        row = Packer.row
        self.all = Entries(pack, slots, row(blk, 0), row(blk, 1))
        self.own = Entries(pack, slots, row(blk, 2), row(blk, 3))
        self.prefix = Entries(pack, slots, row(blk, 4), row(blk, 5))
        self.current = Entries(pack, cs, row(cur4, 0), row(cur4, 1))
        self.compact = Entries(pack, compact, row(cur4, 2), row(cur4, 3))

    def _rows(self, pack: Packer, tails: list[int]) -> None:
        """query rows j * P + [0, n_j) and tail rows j * P + [n_j, P) of the rank's own pages j."""
        n = self.num_own * self.page_size
        self._q, self._t = pack.take(n - len(tails)), pack.take(len(tails))
        if not tails:
            self._q[1][:] = np.arange(n)
            return
        _pack_into(self._t[1], tails)
        filled = np.ones(n, bool)
        filled[self._t[1]] = False
        np.compress(filled, np.arange(n), out=self._q[1])

    def _persist_entries(self, pack: Packer, pool_pages: list[int]) -> Region:
        """``persist``: this rank's j-th own current page (local staging, source 1, page j + 1) into its pool
        page ``pool_pages[j]`` (dest), as a gather over the local table. Returns the pool pages' region."""
        n = len(pool_pages)
        pp, src, page = pack.take(n), pack.take(n), pack.take(n)
        _pack_into(pp[1], pool_pages)
        src[1][:] = 1
        page[1][:] = np.arange(1, n + 1)
        self.persist_entries = Entries(pack, pp, src, page)
        return pp

    def _upload(self, pack: Packer, pp: Region | None) -> None:
        """One host-to-device copy of every index array; entry views are made on first use."""
        pack.upload(self.device)
        self.query_rows, self.tail_rows = pack.view(self._q), pack.view(self._t)
        self.own_pool_pages: torch.Tensor | None = None if pp is None else pack.view(pp)

    @property
    def current_slots_t(self) -> torch.Tensor:
        """int64 [num_current] on the device: slot of each compact current page."""
        return self.current.dest

    @cached_property
    def spans(self) -> list[Span]:
        """Per request its slots and ``own`` entries (legacy mode only; built on first use)."""
        return [Span(a, b, self.own.slice(a, b)) for a, b in self._request_slots]

    def _arena(self, page_bytes: dict[str, int]) -> None:
        """Deterministic offsets inside an arena half: per kind the dense buffer, then v2's compact scratch."""
        off = 0
        self.dense_offset: dict[str, int] = {}
        self.compact_offset: dict[str, int] = {}
        for k in KINDS:
            self.dense_offset[k] = off
            off += align(self.num_slots * page_bytes[k])
            self.compact_offset[k] = off
            off += align(max(self.num_current, 1) * page_bytes[k])
        self.arena_bytes = off

    # checks ---------------------------------------------------------------------------------------

    def check(self, rank: int, signature: tuple) -> None:
        """Raise ComposeError unless this plan was built on ``rank`` with this runtime's setup."""
        if rank != self.rank or signature != self.signature:
            raise ComposeError(f"compose plan was built for rank {self.rank} with (cp, page_size, staging, "
                               f"page_bytes) = {self.signature}; this runtime is rank {rank} with {signature}")

    @property
    def persists(self) -> bool:
        return self.own_pool_pages is not None
