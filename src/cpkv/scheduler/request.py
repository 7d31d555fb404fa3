"""A prefill request and its progress. No torch import.

``keys`` is what the prefix cache hashes: the prompt's token ids (``key_unit`` 1, the engine) or one
id per full page (``key_unit`` = page size, the replay, so that a 10,000-request trace of long prompts
stays fast). Token ranges of a request while it runs (P = page size)::

    0                 cached            done         done+extend                prompt_len
    | cached prefix   | earlier chunks  | this chunk  | rest (later chunks)      |
    |<--------- carried prefix -------->|
      (prefix-cache hit,  (computed by     (computed now: the entry's extend_len)
       page-aligned)       this request)

``done`` is the carried prefix of the next chunk: tokens already in KV (cache hit + earlier chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Hashable, Sequence

from cpkv.kvcache.manager import EMPTY, Prefix


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"      # a chunk is in flight, or earlier chunks ran and more follow
    FINISHED = "finished"
    REJECTED = "rejected"
    CANCELLED = "cancelled"  # taken out by Scheduler.cancel (a client went away)


@dataclass(eq=False)
class Request:
    """One prompt to prefill.

    ``rid``: the trace id (any hashable). ``keys``: token ids, or page ids when the scheduler's
    ``key_unit`` is the page size (``len(keys) == prompt_len // key_unit`` then). ``arrival``: seconds.
    """

    rid: Hashable
    keys: Sequence[int]
    prompt_len: int
    arrival: float = 0.0
    status: Status = Status.WAITING
    cached: int = -1               # tokens taken from the prefix cache at the first chunk (-1: not yet)
    done: int = 0                  # tokens in KV: cached + earlier chunks
    chunks: int = 0                # chunks finished
    prefix: Prefix = EMPTY         # the carried prefix's cached pages, held in the KV-cache manager
    reason: str = ""               # why it was rejected
    keep: bool = False             # a generation decoding on (cpkv.scheduler.decode): its last chunk keeps its
    #                                full pages held (``prefix``) and its partial tail page (``tail``)
    tail: tuple = ()               # with ``keep``, once finished: (owner, page id) of the partial tail page, if any
    meta: dict = field(default_factory=dict)

    @property
    def remaining(self) -> int:
        return self.prompt_len - self.done

    @property
    def started(self) -> bool:
        return self.cached >= 0

    def __repr__(self) -> str:
        return (f"Request({self.rid!r}, prompt_len={self.prompt_len}, status={self.status.value}, "
                f"cached={self.cached}, done={self.done})")
