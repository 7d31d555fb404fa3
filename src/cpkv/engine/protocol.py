"""The online engine's messages: what a front end sends the ranks and what comes back. No torch import.

    parent -> rank 0's inbox       Submit(rid, tokens, max_new_tokens, stop_ids, sampling) | Cancel(rid) | Flush(rid)
                                   | Stop()
    rank 0 -> parent (ctx.report)  Ready() once; then per loop step with news:
                                   Step(events: [Token | Finished | Flushed, ...], pages_used, live)

Rank 0 broadcasts each step's inbox messages to every rank, so every rank applies the same messages at the
same step and forms the same batches. Per request ``rid`` the events are: ``Token`` for each generated token
in order (``index`` 0 is the first token and carries ``cached``, the prompt tokens taken from the prefix
cache; with ``sampling.logprobs`` set it carries the token's log-probability and the top ones), then exactly one
``Finished`` (``reason``: ``length``, ``stop``, ``cancelled``, ``rejected`` with its admission reason in ``detail``;
the client adds ``failed`` when the ranks die). A ``Flush`` is answered by one ``Flushed`` with the same ``rid``.
"""
from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("length", "stop", "cancelled", "rejected", "failed")
MAX_LOGPROBS = 20  # the most top log-probabilities a token carries (vLLM's and OpenAI's chat limit)


@dataclass(frozen=True)
class SamplingParams:
    """How a generation picks each token (``cpkv.engine.sampling``). The defaults are greedy: the argmax of the
    logits, the path ``cpkv run`` checks. ``top_k`` <= 0 and ``top_p`` 1 and ``min_p`` 0 mask nothing;
    penalties at 0 (presence, frequency) and 1 (repetition) change nothing. ``seed``: the run-to-run key of the
    random draws (the front end picks one when the client gives none). ``logprobs``: None, or how many top
    log-probabilities each token carries besides its own (0..MAX_LOGPROBS)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """The exact argmax of the raw logits, no host work."""
        return self.temperature == 0 and not self.penalized


def mix_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys (splitmix64 steps): the same keys give the same seed on any machine."""
    x = 0x9E3779B97F4A7C15
    for k in keys:
        x = (x ^ (k & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x >> 1


@dataclass(frozen=True)
class Submit:
    """Generate up to ``max_new_tokens`` (>= 1) tokens after ``tokens`` as ``sampling`` says; a token in
    ``stop_ids`` ends the generation (it is sent, then ``Finished(reason="stop")``)."""

    rid: int
    tokens: tuple[int, ...]
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = SamplingParams()


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
    logprob: float | None = None            # with sampling.logprobs: log p(token) under the raw logits
    top: tuple[tuple[int, float], ...] = ()  # and the sampling.logprobs most likely (id, log p), best first
    prompt: int = 0  # index 0: the prompt's tokens (the request may be gone before its first token is logged)


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
