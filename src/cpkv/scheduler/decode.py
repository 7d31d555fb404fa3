"""Paged decode bookkeeping: the running generations whose KV stays where it lies (docs/design.md §11). No torch.

A generation's prompt is prefilled by the batch loop; its last chunk keeps its pages (``Request.keep``): the full
pages committed to the prefix cache and held, the partial tail page kept out of the cache. The ``Decoder`` then
advances every running generation by one token per step::

    0            P           2P                    length          (P = page size)
    | full page  | full page  | tail page (partial) |
    |<-- prefix: cached, held -->|<- tail: the generation's own ->|
                                  ^ the next token's KV goes at ``length`` (a fresh page when length % P == 0)

    dec = Decoder(kv, cp, page_size)
    dec.start(rid, tokens, prefix, tail)   # tokens: the generation's list (prompt + tokens so far), kept by reference
    step, failed = dec.plan()              # DecodeStep: one entry per generation: its token, position, table slot
                                           #   and the entries of its page table that changed since its last step
    ...the step's forward writes each token's KV rows into its page on its owner...
    dec.advance(rid)                       # the token's KV is stored (tokens[length] known): a filled tail page
                                           #   enters the prefix cache, held
    dec.finish(rid)                        # the prefix dropped (its pages stay cached), the tail page released

Pipelined (the step's greedy token stays on the device, ``engine.decode.DecodeRunner.launch``): step n + 1 is planned
and launched before step n's tokens reach the host. A generation whose next input token is not in ``tokens`` yet
gets ``PENDING`` as its entry's token (the device supplies it); the loop is plan(n + 1) -> launch(n + 1) -> step n's
tokens appended -> advance(n + 1's entries) (advance reads the tokens up to the one it stores).

Each generation holds a slot (the lowest free) of the engine's page table; a step carries only the table entries
that changed (a fresh tail page; a filled page the cache swapped for its twin; every page at a generation's first
step), so a step's host work does not grow with the context.

A fresh tail page goes to rank (spread + page index) % cp: each generation's pages, and so its steps, rotate over
the group, and concurrent generations start on different ranks. The rank that owns a step's tail page computes
the step (its query, its KV rows, its attention over every page of the context, wherever they lie). Every rank
holds the same Decoder and makes the same calls, so every rank plans the same steps.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Hashable, Sequence

from cpkv.kvcache.manager import KVCacheManager, Page, Prefix


@dataclass(eq=False)
class DecodeSeq:
    """One running generation. ``tokens``: prompt + tokens so far (the caller's list); ``length``: tokens whose KV
    is stored; ``prefix``: its full pages (held); ``tail``: the partial page after them, or None; ``slot``: its row
    of the page table; ``fresh``: the first page index changed since its last step (``NONE``: none)."""

    rid: Hashable
    tokens: list[int]
    prefix: Prefix
    tail: Page | None
    length: int
    spread: int
    slot: int
    fresh: int = 0

    @property
    def pages(self) -> tuple[Page, ...]:
        return self.prefix.pages + ((self.tail,) if self.tail is not None else ())

    def changes(self) -> tuple[tuple[int, int, int], ...]:
        """(page index, owner, page id) of the pages from ``fresh`` on, the tail last; ``fresh`` reset."""
        if self.fresh == NONE:
            return ()
        start, self.fresh = self.fresh, NONE
        pages = self.prefix.pages_from(start) + ((self.tail,) if self.tail is not None else ())
        return tuple((start + i, o, p) for i, (o, p) in enumerate(pages))


NONE = 1 << 62  # DecodeSeq.fresh when no page changed
PENDING = -1    # DecodeEntry.token when the generation's input token is still on the device (module docstring)


@dataclass(frozen=True)
class DecodeEntry:
    """One generation in a step: its input ``token`` (``PENDING``: its previous step's, on the device) at
    ``position`` (= the tokens already in KV), the ``owner``
    rank computing it (its tail page's), ``page``: that tail page's id (the token's KV goes there), ``slot``: its row of
    the page table, ``changes``: the table entries to write first ((page index, owner, page id))."""

    rid: Hashable
    token: int
    position: int
    owner: int
    page: int
    slot: int
    changes: tuple[tuple[int, int, int], ...] = ()

    @property
    def context(self) -> int:
        """Keys the token attends to: every earlier token and itself."""
        return self.position + 1


@dataclass(frozen=True)
class DecodeStep:
    """One step of every running generation, in start order (the same on every rank)."""

    index: int
    entries: tuple[DecodeEntry, ...]
    page_size: int
    cp: int

    def on(self, rank: int) -> tuple[DecodeEntry, ...]:
        """The entries ``rank`` computes."""
        return tuple(e for e in self.entries if e.owner == rank)

    def counts(self) -> list[int]:
        """Tokens per rank."""
        out = [0] * self.cp
        for e in self.entries:
            out[e.owner] += 1
        return out


class Decoder:
    """The running generations of the paged decode path and their pages (module docstring)."""

    def __init__(self, kv: KVCacheManager, cp: int, page_size: int, max_context: int | None = None) -> None:
        if kv.page_size != page_size:
            raise ValueError(f"the decoder needs a token-keyed cache (page size {page_size}), got {kv.page_size}")
        self.kv, self.cp, self.page_size, self.max_context = kv, cp, page_size, max_context
        self.seqs: dict[Hashable, DecodeSeq] = {}
        self._free: list[int] = []  # slots given back (a heap: the lowest is reused first)
        self.slots = 0              # slots ever used: the page table's rows
        self.started = 0
        self.steps = 0

    def start(self, rid: Hashable, tokens: list[int], prefix: Prefix, tail: Sequence[Page]) -> None:
        """Take over a prefilled generation: ``prefix`` held (its full pages), ``tail`` its partial page (0 or 1)."""
        if rid in self.seqs:
            raise ValueError(f"generation {rid!r} is already decoding")
        kept = tuple(tail)
        if len(kept) > 1:
            raise ValueError(f"generation {rid!r}: at most one partial tail page, got {kept}")
        length = len(tokens) - 1  # every token but the last sampled one has its KV stored
        if not len(prefix) * self.page_size <= length <= (len(prefix) + len(kept)) * self.page_size:
            raise ValueError(f"generation {rid!r}: {length} tokens in KV do not fit {len(prefix)} full pages and "
                             f"{len(kept)} tail page(s) of {self.page_size}")
        slot = heapq.heappop(self._free) if self._free else self.slots
        self.slots = max(self.slots, slot + 1)
        self.seqs[rid] = DecodeSeq(rid, tokens, prefix, kept[0] if kept else None, length, self.started, slot)
        self.started += 1

    def plan(self) -> tuple[DecodeStep | None, list[tuple[Hashable, str]]]:
        """The next step (None: no generation runs) and the generations that could not get a page this step
        ((rid, reason): finished and gone from the decoder)."""
        entries, failed = [], []
        for seq in list(self.seqs.values()):
            why = self._blocked(seq)
            if why is not None:
                failed.append((seq.rid, why))
                self.finish(seq.rid)
                continue
            token = seq.tokens[seq.length] if seq.length < len(seq.tokens) else PENDING
            entries.append(DecodeEntry(seq.rid, token, seq.length, seq.tail[0], seq.tail[1], seq.slot,
                                       seq.changes()))
        if not entries:
            return None, failed
        self.steps += 1
        return DecodeStep(self.steps - 1, tuple(entries), self.page_size, self.cp), failed

    def _blocked(self, seq: DecodeSeq) -> str | None:
        """Why ``seq``'s next token cannot run (None: it can; a fresh tail page taken when it needs one)."""
        if self.max_context is not None and seq.length >= self.max_context:
            return f"max_context: the model's context of {self.max_context} tokens is full"
        if seq.length % self.page_size == 0 and not self._grow(seq):
            return f"pages: no free page on rank {self._owner(seq)} for the next token"
        return None

    def _owner(self, seq: DecodeSeq) -> int:
        return (seq.spread + seq.length // self.page_size) % self.cp

    def _grow(self, seq: DecodeSeq) -> bool:
        """A fresh tail page for the next token (LRU leaves evicted as needed); False when none is free."""
        got = self.kv.allocate([self._owner(seq)])
        if got is None:
            return False
        seq.tail = got[0]
        seq.fresh = min(seq.fresh, len(seq.prefix))
        return True

    def advance(self, rid: Hashable) -> None:
        """The step's token of ``rid`` has its KV stored; a tail page it filled enters the prefix cache (held)."""
        seq = self.seqs[rid]
        if seq.length >= len(seq.tokens):
            raise ValueError(f"generation {rid!r}: advance before its input token {seq.length} reached the host")
        seq.length += 1
        if seq.length % self.page_size == 0:
            keys = seq.tokens[: seq.length]
            seq.prefix = self.kv.commit(keys, seq.prefix, [seq.tail], hold=True)
            if seq.prefix.pages_from(len(seq.prefix) - 1) != (seq.tail,):  # the cache kept its twin: ours went back
                seq.fresh = min(seq.fresh, len(seq.prefix) - 1)
            seq.tail = None

    def finish(self, rid: Hashable) -> None:
        """``rid`` stops (done, cancelled or failed): its full pages stay cached, unheld; its tail page is freed."""
        seq = self.seqs.pop(rid)
        heapq.heappush(self._free, seq.slot)
        self.discard(seq.prefix, (seq.tail,) if seq.tail is not None else ())

    def discard(self, prefix: Prefix, tail: Sequence[Page]) -> None:
        """Undo what a kept last chunk holds (``Request.keep``) for a generation that never starts decoding."""
        self.kv.drop(prefix)
        self.kv.release(tail)

    def __len__(self) -> int:
        return len(self.seqs)
