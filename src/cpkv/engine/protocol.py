"""The online engine's messages: what a front end sends the ranks and what comes back. No torch import.

    parent -> rank 0's inbox       Submit(rid, tokens, max_new_tokens, stop_ids) | Cancel(rid) | Flush(rid) | Stop()
    rank 0 -> parent (ctx.report)  Ready() once; then per loop step with news:
                                   Step(events: [Token | Finished | Flushed, ...], pages_used, live)

Rank 0 broadcasts each step's inbox messages to every rank, so every rank applies the same messages at the
same step and forms the same batches. Per request ``rid`` the events are: ``Token`` for each generated token
in order (``index`` 0 is the first token and carries ``cached``, the prompt tokens taken from the prefix
cache), then exactly one ``Finished`` (``reason``: ``length``, ``stop``, ``cancelled``, ``rejected`` with
its admission reason in ``detail``; the client adds ``failed`` when the ranks die). A ``Flush`` is answered by
one ``Flushed`` with the same ``rid``.
"""
from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("length", "stop", "cancelled", "rejected", "failed")


@dataclass(frozen=True)
class Submit:
    """Generate up to ``max_new_tokens`` (>= 1) greedy tokens after ``tokens``; a token in ``stop_ids`` ends
    the generation (it is sent, then ``Finished(reason="stop")``)."""

    rid: int
    tokens: tuple[int, ...]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Cancel:
    rid: int


@dataclass(frozen=True)
class Flush:
    """Empty the prefix cache (its device pages) if the ranks hold no generation; else change nothing."""

    rid: int


@dataclass(frozen=True)
class Stop:
    """End the rank loop (the parent sends it once nothing is in flight)."""


@dataclass(frozen=True)
class Ready:
    """Every rank has loaded the model and entered the loop."""


@dataclass(frozen=True)
class Token:
    rid: int
    token: int
    index: int
    cached: int = -1  # index 0: prompt tokens from the prefix cache; -1 after


@dataclass(frozen=True)
class Finished:
    rid: int
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Flushed:
    """A Flush's answer: ``pages`` freed on every pool together, or -1 when generations were held (refused)."""

    rid: int
    pages: int


@dataclass(frozen=True)
class Step:
    """One loop step's news from rank 0: events in order, every pool's used pages (cached + in flight), and the
    generations the ranks hold (queued, running or between decode steps)."""

    events: tuple[Token | Finished | Flushed, ...]
    pages_used: tuple[int, ...]
    live: int = 0
