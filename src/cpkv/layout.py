"""Page-aligned in-sequence split of a CP batch (docs/design.md §2). No torch import.

A batch is a list of requests ``(prefix_len, extend_len)``. Each request's sequence is cut into pages::

    request r:  | prefix page | prefix page | cur | cur | cur | cur (partial) |
                  owner o0      owner o1      w0    w1    w1    w0
                  <--- cached, one owner each ---> <--- new, one writer each --->

The batch's *logical pages* are laid out in merged-span order (request 0's prefix pages, its current
pages, request 1's prefix pages, ...); slot i of a dense buffer holds logical page i, so a request's
keys sit contiguously in the dense buffer from row ``slot_start * page_size``.

Splitting the current pages over ranks:

- ``zigzag`` (default): 2·cp near-equal runs; rank r takes runs r and 2cp−1−r (balances causal work).
- ``contiguous``: cp near-equal runs; rank r takes run r.
- ``round-robin``: page by page.

Remainders rotate across the requests of a batch so that short requests do not all land on rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple, Sequence

from cpkv.config import STRATEGIES, is_power_of_two
from cpkv.errors import ConfigError, LayoutError


class PrefixPage(NamedTuple):
    """A cached page: which rank's pool holds it, and its page id there."""

    owner: int
    page_id: int


class CurrentPage(NamedTuple):
    """A new page: tokens [start, end) of its request's sequence, computed by ``writer``.

    ``compact`` is its index among the batch's current pages (merged-span order); ``index`` its index
    among its request's current pages.
    """

    request: int
    index: int
    compact: int
    start: int
    end: int
    writer: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class LogicalPage(NamedTuple):
    """Slot ``slot`` of the dense buffer. ``rank`` is the owner (prefix) or writer (current).

    ``page_id``: pool page id for prefix pages, −1 for current pages. ``compact``: index of the current
    page in the batch's compact list, −1 for prefix pages. ``start``/``end``: token positions.
    """

    slot: int
    request: int
    kind: str
    rank: int
    page_id: int
    compact: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class RequestLayout:
    index: int
    prefix_len: int
    extend_len: int
    prefix_pages: tuple[PrefixPage, ...]
    current_pages: tuple[CurrentPage, ...]
    slot_start: int

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.extend_len

    @property
    def slot_end(self) -> int:
        return self.slot_start + len(self.prefix_pages) + len(self.current_pages)

    @property
    def current_slot_start(self) -> int:
        return self.slot_start + len(self.prefix_pages)

    def key_row(self, pos: int, page_size: int) -> int:
        """Dense-buffer row of sequence position ``pos`` (handles a partial prefix page of a solo request)."""
        if pos < self.prefix_len:
            return self.slot_start * page_size + pos
        return self.current_slot_start * page_size + (pos - self.prefix_len)


@dataclass(frozen=True)
class BatchLayout:
    """Everything layer-invariant about where a batch's pages live and who computes what. Plain data: the
    per-batch plans built from it (compose, rank, indexer) are returned to their callers and passed on
    explicitly, never stored here.
    """

    page_size: int
    cp: int
    strategy: str
    requests: tuple[RequestLayout, ...]
    current_pages: tuple[CurrentPage, ...]
    rank_current: tuple[tuple[int, ...], ...]
    rank_query_ranges: tuple[tuple[tuple[int, int, int], ...], ...]
    rank_work: tuple[int, ...]

    @cached_property
    def logical_pages(self) -> tuple[LogicalPage, ...]:
        """Every slot of the dense buffer in order: each request's prefix pages, then its current pages. Built on
        first use (the engine's plans read the requests' pages directly: a 200K-token prefix is 3,072 slots)."""
        P, out = self.page_size, []
        for r in self.requests:
            out.extend(_prefix_slots(r.index, r.prefix_pages, r.slot_start, r.prefix_len, P))
            out.extend(LogicalPage(r.current_slot_start + k, r.index, "current", c.writer, -1, c.compact, c.start,
                                   c.end) for k, c in enumerate(r.current_pages))
        return tuple(out)

    @property
    def num_slots(self) -> int:
        return self.requests[-1].slot_end if self.requests else 0

    @property
    def num_current(self) -> int:
        return len(self.current_pages)

    @property
    def num_prefix_pages(self) -> int:
        return self.num_slots - self.num_current

    @property
    def extend_tokens(self) -> int:
        return sum(r.extend_len for r in self.requests)

    @property
    def prefix_tokens(self) -> int:
        return sum(r.prefix_len for r in self.requests)

    def balance(self) -> float:
        """max/mean causal attention work over ranks (1.0 is perfect)."""
        mean = sum(self.rank_work) / self.cp
        return max(self.rank_work) / mean if mean else 1.0

    def query_tokens(self, rank: int) -> int:
        return sum(e - s for _, s, e in self.rank_query_ranges[rank])

    def to_dict(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size,
            "cp": self.cp,
            "strategy": self.strategy,
            "requests": [_request_dict(r) for r in self.requests],
            "logical_pages": [
                {"slot": p.slot, "request": p.request, "kind": p.kind, "rank": p.rank, "page_id": p.page_id,
                 "start": p.start, "end": p.end}
                for p in self.logical_pages
            ],
            "rank_work": list(self.rank_work),
            "rank_pages": [list(x) for x in self.rank_current],
            "rank_query_ranges": [[list(t) for t in x] for x in self.rank_query_ranges],
            "balance": self.balance(),
        }


def _request_dict(r: RequestLayout) -> dict[str, Any]:
    return {
        "prefix_len": r.prefix_len,
        "extend_len": r.extend_len,
        "prefix_pages": [{"owner": p.owner, "page_id": p.page_id} for p in r.prefix_pages],
        "current_pages": [{"start": c.start, "end": c.end, "writer": c.writer} for c in r.current_pages],
        "slots": [r.slot_start, r.slot_end],
    }


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_setup(page_size: int, cp: int, strategy: str) -> None:
    if not isinstance(page_size, int) or not is_power_of_two(page_size):
        raise ConfigError(f"page_size must be a power of two >= 1, got {page_size!r}")
    if not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"cp must be an integer >= 1, got {cp!r}")
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown split strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")


def _check_requests(reqs: Sequence[tuple[int, int]], page_size: int, max_context: int | None) -> None:
    if len(reqs) == 0:
        raise LayoutError("a batch needs at least one request, got none")
    if max_context is not None and (not isinstance(max_context, int) or max_context < 1):
        raise LayoutError(f"max_context must be an integer >= 1, got {max_context!r}")
    for i, (prefix, extend) in enumerate(reqs):
        if not isinstance(prefix, int) or prefix < 0:
            raise LayoutError(f"request {i}: prefix_len must be an integer >= 0, got {prefix!r}")
        if not isinstance(extend, int) or extend < 1:
            raise LayoutError(f"request {i}: extend_len must be an integer >= 1, got {extend!r}")
        if max_context is not None and prefix + extend > max_context:
            raise LayoutError(
                f"request {i}: {prefix + extend} tokens ({prefix} cached + {extend} new) exceed the maximum context"
                f" of {max_context}")
        if prefix % page_size and len(reqs) > 1:
            raise LayoutError(
                f"request {i}: prefix_len {prefix} is not a multiple of page_size {page_size}; an unaligned prefix"
                f" must run alone in its batch (this batch has {len(reqs)} requests)")


def run_sizes(n: int, order: Sequence[int], rot: int) -> list[int]:
    """Split n pages into len(order) near-equal runs; the n % runs extra pages go to runs order[rot], order[rot+1], ..."""
    runs = len(order)
    base, rem = divmod(n, runs)
    sizes = [base] * runs
    for i in range(rem):
        sizes[order[(rot + i) % runs]] += 1
    return sizes


def split_writers(n: int, cp: int, strategy: str, rot: int) -> list[int]:
    """Writer rank of each of a request's n current pages, in page order.

    ``rot`` rotates where remainder pages go, so the short requests of a batch spread over the ranks.
    """
    if strategy == "round-robin":
        return [(rot + i) % cp for i in range(n)]
    if strategy == "contiguous":
        owners = list(range(cp))
        order = owners
    else:  # zigzag: runs r and 2cp-1-r belong to rank r; extras visit ranks 0..cp-1 then again
        owners = list(range(cp)) + list(reversed(range(cp)))
        order = list(range(cp)) + list(range(2 * cp - 1, cp - 1, -1))
    writers: list[int] = []
    for run, size in enumerate(run_sizes(n, order, rot)):
        writers.extend([owners[run]] * size)
    return writers


def rotation_step(n: int, cp: int, strategy: str) -> int:
    """How far ``rot`` advances after a request of n pages (the extras it placed, or n for round-robin)."""
    if strategy == "round-robin":
        return n
    return n % (cp if strategy == "contiguous" else 2 * cp)


def default_prefix_pages(reqs: Sequence[tuple[int, int]], page_size: int, cp: int) -> list[list[PrefixPage]]:
    """Round-robin owners over the whole batch, page ids counting from 1 on each owner (for display)."""
    next_id = [1] * cp
    out: list[list[PrefixPage]] = []
    k = 0
    for prefix, _ in reqs:
        pages = []
        for _ in range(cdiv(prefix, page_size)):
            owner = k % cp
            pages.append(PrefixPage(owner, next_id[owner]))
            next_id[owner] += 1
            k += 1
        out.append(pages)
    return out


def _check_prefix_pages(i: int, pages: Sequence[PrefixPage], expected: int, cp: int) -> None:
    if len(pages) != expected:
        raise LayoutError(f"request {i}: expected {expected} prefix pages, got {len(pages)}")
    if not pages:
        return
    if any(len(p) != 2 for p in pages):
        raise LayoutError(f"request {i}: each prefix page must be (owner, page_id)")
    owners = [p[0] for p in pages]
    if min(owners) < 0 or max(owners) >= cp:
        bad = next(o for o in owners if not 0 <= o < cp)
        raise LayoutError(f"request {i}: prefix page owner must be in [0, {cp}), got {bad}")
    if min(p[1] for p in pages) < 1:
        bad = min(p[1] for p in pages)
        raise LayoutError(f"request {i}: prefix page id must be >= 1 (page 0 is reserved), got {bad}")


def causal_work(start: int, end: int) -> int:
    """Sum over query positions p in [start, end) of visible keys (p + 1)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def build_layout(
    requests: Sequence[tuple[int, int]],
    *,
    page_size: int,
    cp: int,
    strategy: str = "zigzag",
    prefix_pages: Sequence[Sequence[PrefixPage | tuple[int, int]]] | None = None,
    max_context: int | None = None,
) -> BatchLayout:
    """Lay out a batch. ``prefix_pages[r]``: (owner, page_id) of each of request r's ceil(prefix/P) pages."""
    _check_setup(page_size, cp, strategy)
    reqs = [(r[0], r[1]) for r in requests]
    _check_requests(reqs, page_size, max_context)
    if prefix_pages is None:
        given = default_prefix_pages(reqs, page_size, cp)
    else:
        if len(prefix_pages) != len(reqs):
            raise LayoutError(f"prefix_pages: expected one list per request ({len(reqs)}), got {len(prefix_pages)}")
        new = tuple.__new__
        given = [[new(PrefixPage, p) for p in pages] for pages in prefix_pages]
    return _assemble(reqs, given, page_size, cp, strategy)


def _assemble(reqs, given, page_size: int, cp: int, strategy: str) -> BatchLayout:
    requests: list[RequestLayout] = []
    current: list[CurrentPage] = []
    rot = slots = 0
    for i, (prefix, extend) in enumerate(reqs):
        _check_prefix_pages(i, given[i], cdiv(prefix, page_size), cp)
        slot_start = slots
        n = cdiv(extend, page_size)
        writers = split_writers(n, cp, strategy, rot)
        rot += rotation_step(n, cp, strategy)
        cur = []
        for k, w in enumerate(writers):
            start = prefix + k * page_size
            page = CurrentPage(i, k, len(current), start, min(start + page_size, prefix + extend), w)
            cur.append(page)
            current.append(page)
        slots += len(given[i]) + n
        requests.append(RequestLayout(i, prefix, extend, tuple(given[i]), tuple(cur), slot_start))
    return _finish(requests, current, page_size, cp, strategy)


def _prefix_slots(i: int, pages: Sequence[PrefixPage], slot_start: int, prefix: int, P: int) -> list[LogicalPage]:
    """Logical pages of request i's prefix (tuple.__new__ skips the NamedTuple constructor: ~8K pages/batch)."""
    new = tuple.__new__
    out = [new(LogicalPage, (slot_start + k, i, "prefix", o, pid, -1, k * P, k * P + P))
           for k, (o, pid) in enumerate(pages)]
    if out and prefix % P:
        out[-1] = out[-1]._replace(end=prefix)
    return out


def _finish(requests, current, page_size: int, cp: int, strategy: str) -> BatchLayout:
    rank_current: list[list[int]] = [[] for _ in range(cp)]
    ranges: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    work = [0] * cp
    for c in current:
        rank_current[c.writer].append(c.compact)
        work[c.writer] += causal_work(c.start, c.end)
        runs = ranges[c.writer]
        if runs and runs[-1][0] == c.request and runs[-1][2] == c.start:
            runs[-1] = (c.request, runs[-1][1], c.end)
        else:
            runs.append((c.request, c.start, c.end))
    return BatchLayout(
        page_size=page_size, cp=cp, strategy=strategy, requests=tuple(requests),
        current_pages=tuple(current), rank_current=tuple(tuple(x) for x in rank_current),
        rank_query_ranges=tuple(tuple(x) for x in ranges), rank_work=tuple(work),
    )


def check_invariants(layout: BatchLayout) -> None:
    """Assert the layout invariants (used by tests and debug runs)."""
    P = layout.page_size
    seen_compact = []
    for r in layout.requests:
        pos = r.prefix_len
        for k, c in enumerate(r.current_pages):
            assert c.start == pos, f"request {r.index}: page {k} starts at {c.start}, expected {pos}"
            assert 0 < c.end - c.start <= P
            assert c.end - c.start == P or k == len(r.current_pages) - 1, "only the last page may be partial"
            assert 0 <= c.writer < layout.cp
            pos = c.end
            seen_compact.append(c.compact)
        assert pos == r.seq_len, f"request {r.index}: pages end at {pos}, expected {r.seq_len}"
    assert seen_compact == list(range(layout.num_current))
    writes = sorted(i for pages in layout.rank_current for i in pages)
    assert writes == list(range(layout.num_current)), "every current page has exactly one writer"
    assert [p.slot for p in layout.logical_pages] == list(range(layout.num_slots))
