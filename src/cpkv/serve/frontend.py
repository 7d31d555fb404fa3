"""Between the HTTP handlers and the engine client: the one place a request is admitted, submitted, awaited,
timed, counted and cancelled.

    flight = frontend.open(tokens, max_new_tokens, stop_ids, sampling)   # 429 / 503 (BadRequest) or submitted
    async with aclosing(flight.events()) as events:
        async for out in events:        # an Outcome after each token; the last has finish_reason set
            ...                         # flight.end("stop") when the text holds a stop string
    # leaving early (client gone, shutdown) cancels the request in the engine

The engine client calls back on its watch thread; events reach the request's asyncio queue through
``call_soon_threadsafe``. TTFT and end-to-end latency run from ``open`` (the request's arrival).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from cpkv.engine.client import EngineClient
from cpkv.engine.protocol import Finished, SamplingParams, Token
from cpkv.serve.metrics import Metrics
from cpkv.serve.protocol import BadRequest


class Refused(BadRequest):
    """A request the server cannot take now (429 queue full, 503 unavailable); ``reason`` labels the metric."""

    def __init__(self, message: str, status: int, reason: str) -> None:
        super().__init__(message, None, status)
        self.reason = reason


@dataclass
class Outcome:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    finish_reason: str | None = None   # length | stop, once finished
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)  # per token, if asked


class Frontend:
    """Admission to the engine (queue bound, health, drain) and the per-request bookkeeping."""

    def __init__(self, client: EngineClient, metrics: Metrics, max_waiting: int) -> None:
        self.client, self.metrics, self.max_waiting = client, metrics, max_waiting
        self.flights: dict[int, Flight] = {}
        self.draining = False

    @property
    def waiting(self) -> int:
        return sum(1 for f in self.flights.values() if not f.out.tokens)

    def counts(self) -> tuple[int, int]:
        """(running, waiting): requests past their first token, and those waiting for it."""
        waiting = self.waiting
        return len(self.flights) - waiting, waiting

    def prompt_len(self, rid: int) -> int:
        """The prompt tokens of request ``rid`` in flight (0 once it is gone)."""
        flight = self.flights.get(rid)
        return flight.out.prompt_tokens if flight is not None else 0

    def open(self, tokens: Sequence[int], max_new_tokens: int, stop_ids: frozenset[int] = frozenset(),
             sampling: SamplingParams = SamplingParams()) -> "Flight":
        if self.draining:
            raise Refused("the server is shutting down", 503, "unavailable")
        if not self.client.healthy:
            raise Refused(f"the engine is not serving ({self.client.failure or 'not ready'})", 503, "unavailable")
        if self.waiting >= self.max_waiting:
            raise Refused(f"the waiting queue is full ({self.max_waiting} requests wait for a first token); retry "
                          "later", 429, "queue_full")
        flight = Flight(self, len(tokens))
        flight.rid = self.client.submit(tokens, max_new_tokens, flight.push, stop_ids, sampling)
        self.flights[flight.rid] = flight
        self.metrics.waiting.inc()
        return flight

    def fail_all(self, why: str) -> None:
        """Every request in flight ends with a 503 (shutdown past its deadline)."""
        for f in list(self.flights.values()):
            self.client.cancel(f.rid)
            f.push(Finished(f.rid, "failed", why))

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests; wait up to ``timeout_s`` for those in flight, then fail the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.fail_all(f"the server is shutting down (in-flight requests get {timeout_s:g} s to finish)")
        while self.flights and time.monotonic() < deadline + 5.0:
            await asyncio.sleep(0.05)


class Flight:
    """One request in the engine: its event queue, outcome so far and timers."""

    def __init__(self, fe: Frontend, prompt_tokens: int) -> None:
        self.fe, self.rid = fe, -1
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.t0 = self.t_last = time.perf_counter()
        self.out = Outcome(prompt_tokens)
        self.closed = False

    def push(self, ev: Token | Finished) -> None:
        """From any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the event loop has closed (the server is gone)
            pass

    async def events(self) -> AsyncIterator[Outcome]:
        """The outcome after each token, the last one finished; a failure raises Refused (503)."""
        try:
            while True:
                ev = await self.queue.get()
                if isinstance(ev, Token):
                    self._token(ev)
                    yield self.out
                    continue
                self._finish(ev)
                if ev.reason not in ("length", "stop"):
                    raise Refused(f"the request could not be served: {ev.detail or ev.reason}", 503,
                                  "admission" if ev.reason == "rejected" else "unavailable")
                yield self.out
                return
        finally:
            if not self.closed:  # left early: the client went away or the server is stopping
                self.fe.client.cancel(self.rid)
                self._finish(Finished(self.rid, "cancelled"))

    def end(self, reason: str) -> None:
        """Finish here (a stop string in the text): cancel the request in the engine, count it as ``reason``."""
        if not self.closed:
            self.fe.client.cancel(self.rid)
            self._finish(Finished(self.rid, reason))

    def _token(self, ev: Token) -> None:
        m, out, now = self.fe.metrics, self.out, time.perf_counter()
        if ev.index > 0:
            m.itl.observe(now - self.t_last)
        self.t_last = now
        if ev.index == 0:
            out.ttft_s, out.cached_tokens = time.perf_counter() - self.t0, ev.cached
            m.waiting.dec()
            m.running.inc()
            m.first_token(out.ttft_s, out.prompt_tokens, out.cached_tokens)
        out.tokens.append(ev.token)
        if ev.logprob is not None:
            out.logprobs.append((ev.logprob, ev.top))
        m.generation_tokens.inc()

    def _finish(self, ev: Finished) -> None:
        if self.closed:
            return
        self.closed = True
        m, out = self.fe.metrics, self.out
        (m.running if out.tokens else m.waiting).dec()
        m.finished.labels(reason=ev.reason).inc()
        out.e2e_s = time.perf_counter() - self.t0
        if ev.reason in ("length", "stop"):
            out.finish_reason = ev.reason
            m.e2e.observe(out.e2e_s)
            if len(out.tokens) > 1:
                m.tpot.observe((out.e2e_s - out.ttft_s) / (len(out.tokens) - 1))
        self.fe.flights.pop(self.rid, None)
