"""The load generator behind ``cpkv bench serve``: a trace's requests sent over HTTP at their arrival times.

Like SGLang's ``bench_serving``, open loop: a request is sent at its due time whether or not earlier ones
have answered. Due times are the trace's arrivals (shifted to start at 0), or a Poisson process at a rate
(``poisson_due``), or, closed loop, none: ``concurrency`` requests in flight, the next sent in trace order
as one finishes. A multi-turn follow-up (a trace request with a ``parent``) is sent at its due time but
never before its parent has finished, and its prompt is what a chat client would send::

    parent's prompt (as sent) + parent's output ids + the trace's new tokens of this turn

so a conversation's prompt ids are ``cpkv run``'s (``materialize_tokens``) plus the answers. A follow-up
whose parent failed is not sent (``skipped``). Prompts go as token ids (the default) or, with
``prompt_format="text"``, as text: each request's own tokens turned into text once before the load by the
server's ``POST /detokenize`` (``detokenize_plan``), a follow-up's prompt then being the parent's prompt text +
the parent's output text + its own text (the server tokenizes it; the prompt's token count is the server's).
Two endpoints: ``completions`` (``POST /v1/completions``,
streamed server-sent events; TTFT measured here, from sending to the first data chunk) and ``generate``
(``POST /generate``, one JSON answer; TTFT is the server's ``meta_info.ttft_s``). Every failure (refused
connection, timeout, HTTP 4xx/5xx, a malformed answer) is recorded on its request, never raised.

Times come from a ``Clock`` (seconds since the run started), so tests drive the sends with a fake one.
"""
from __future__ import annotations

import asyncio
import bisect
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

from cpkv.scheduler.trace import TraceRequest, materialize_tokens, synth_tokens

ENDPOINTS = ("completions", "generate")
PROMPT_FORMATS = ("ids", "text")
PATHS = {"completions": "/v1/completions", "generate": "/generate"}


@dataclass(frozen=True)
class Planned:
    """One request to send: its due time (s from the start; None: closed loop) and its own tokens
    (a follow-up: only the tokens after its parent's prompt; otherwise the whole prompt)."""

    id: Hashable
    due: float | None
    own_tokens: tuple[int, ...]
    parent: Hashable | None = None
    own_text: str | None = None  # prompt_format "text": own_tokens as the server detokenized them


@dataclass
class Record:
    """What happened to one request. Times in seconds from the run's start; ``None`` when not reached."""

    id: Hashable
    parent: Hashable | None
    due_s: float | None
    status: str = "not_sent"          # ok | error | not_sent (after --duration) | skipped (parent failed)
    sent_s: float | None = None
    first_s: float | None = None      # first streamed chunk (completions), else None
    token_s: list[float] = field(default_factory=list)  # each streamed chunk that carried output
    end_s: float | None = None
    prompt_tokens: int = 0            # as sent
    cached_tokens: int | None = None  # the server's count (usage / meta_info)
    completion_tokens: int = 0
    server_ttft_s: float | None = None
    output_ids: list[int] | None = None
    output_text: str | None = None    # the answer's text, when the server sent one
    error: str | None = None
    http_status: int | None = None
    parent_output_missing: bool = False  # a follow-up sent without its parent's output (no ids came back)

    @property
    def ttft_s(self) -> float | None:
        """Client TTFT (first streamed chunk), else the server's."""
        if self.first_s is not None and self.sent_s is not None:
            return self.first_s - self.sent_s
        return self.server_ttft_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (end - first chunk) / (tokens - 1); streamed, 2+ tokens."""
        if self.first_s is None or self.end_s is None or self.completion_tokens < 2:
            return None
        return (self.end_s - self.first_s) / (self.completion_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive streamed chunks that carried output."""
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None or self.sent_s is None else self.end_s - self.sent_s

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ttft_s"], out["e2e_s"], out["tpot_s"] = self.ttft_s, self.e2e_s, self.tpot_s
        return out


# -- the schedule ----------------------------------------------------------------------------------
def plan_requests(trace: Sequence[TraceRequest], vocab_size: int, due: Sequence[float] | None) -> list[Planned]:
    """The trace's requests with their own tokens (``materialize_tokens``) and due times (None: closed loop)."""
    toks = materialize_tokens(trace, vocab_size)
    out = []
    for i, r in enumerate(trace):
        start = len(toks[r.parent]) if r.parent is not None else 0
        out.append(Planned(r.id, None if due is None else due[i], tuple(toks[r.id][start:]), r.parent))
    return out


def warmup_plan(trace: Sequence[TraceRequest], n: int, vocab_size: int) -> list[Planned]:
    """``n`` requests of fresh tokens (ids ``warmup.i``), as long as the trace's first ``n`` prompts: they take
    the server's first-call costs (kernel compilation, autotuning) and share no prefix with the trace."""
    lens = [r.prompt_len for r in trace[:n]]
    return [Planned(f"warmup.{i}", None, tuple(synth_tokens(f"warmup.{i}", k, vocab_size))) for i, k in enumerate(lens)]


def trace_due(trace: Sequence[TraceRequest]) -> list[float]:
    """The trace's arrivals, shifted so that the first is 0."""
    t0 = trace[0].arrival if trace else 0.0
    return [r.arrival - t0 for r in trace]


def waiting_note(dues: Sequence[float], now: float) -> str:
    """What a load waits for at ``now`` (``dues``: the due times, ascending): the next arrival, or answers."""
    i = bisect.bisect_right(dues, now)
    if i < len(dues):
        return f"next request due in {dues[i] - now:.0f} s"
    return "waiting for answers"


def poisson_due(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times of a Poisson process at ``rate`` requests/s starting at 0 (deterministic in seed)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# -- clocks ----------------------------------------------------------------------------------------
class Clock:
    """Seconds since the run started (monotonic), and sleeping until such a time."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)


# -- one request over HTTP ---------------------------------------------------------------------------
def request_body(endpoint: str, model: str, prompt: Sequence[int] | str, max_tokens: int,
                 sampling: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The JSON body of one request (greedy, or ``sampling``'s fields: temperature, top_p, top_k, min_p, as the
    endpoint names them); ``prompt`` token ids, or text (a str)."""
    text = isinstance(prompt, str)
    fields = {"temperature": 0, **(sampling or {})}
    if endpoint == "generate":
        return {("text" if text else "input_ids"): prompt if text else list(prompt),
                "sampling_params": {"max_new_tokens": max_tokens, **fields}}
    return {"model": model, "prompt": prompt if text else list(prompt), "max_tokens": max_tokens, **fields,
            "stream": True, "stream_options": {"include_usage": True}}


async def send_one(client: Any, url: str, endpoint: str, model: str, prompt: list[int] | str, max_tokens: int,
                   rec: Record, clock: Clock, started: asyncio.Event | None = None,
                   sampling: Mapping[str, float] | None = None) -> None:
    """Send one request and fill ``rec`` (status ok or error); never raises for a failed request.
    ``started`` is set as soon as the send time is taken."""
    import httpx

    # a text prompt's token count is the server's (usage / meta_info), read with the answer
    rec.prompt_tokens, rec.sent_s = (0 if isinstance(prompt, str) else len(prompt)), clock.now()
    if started is not None:
        started.set()
    try:
        async with client.stream("POST", url + PATHS[endpoint],
                                 json=request_body(endpoint, model, prompt, max_tokens, sampling)) as resp:
            rec.http_status = resp.status_code
            if resp.status_code >= 400:
                body = (await resp.aread()).decode("utf-8", "replace")
                raise _Failed(f"HTTP {resp.status_code}: {_error_text(body)}")
            if endpoint == "generate":
                _read_generate(json.loads(await resp.aread()), rec)
            else:
                await _read_stream(resp, rec, clock)
        rec.status = "ok"
    except _Failed as exc:
        rec.status, rec.error = "error", str(exc)
    except httpx.TimeoutException as exc:
        rec.status, rec.error = "error", f"timeout ({type(exc).__name__})"
    except httpx.HTTPError as exc:
        rec.status, rec.error = "error", f"{type(exc).__name__}: {str(exc)[:200] or 'no detail'}"
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a malformed answer
        rec.status, rec.error = "error", f"malformed answer ({type(exc).__name__}: {str(exc)[:200]})"
    rec.end_s = clock.now()


class _Failed(Exception):
    pass


def _error_text(body: str) -> str:
    """An error body's message (``{"error": {"message": ...}}``, ``{"detail": ...}``), else its start."""
    try:
        obj = json.loads(body)
        err = obj.get("error", obj.get("detail", obj)) if isinstance(obj, dict) else obj
        text = err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)
    except ValueError:
        text = body
    return text.strip()[:200] or "empty body"


def _read_generate(obj: dict[str, Any], rec: Record) -> None:
    """``/generate``'s answer: output_ids and meta_info {prompt_tokens, cached_tokens, completion_tokens, ttft_s}."""
    rec.output_ids = [int(x) for x in obj["output_ids"]]
    rec.output_text = obj["text"] if isinstance(obj.get("text"), str) else None
    meta = obj.get("meta_info") or {}
    if meta.get("prompt_tokens") is not None:
        rec.prompt_tokens = int(meta["prompt_tokens"])
    rec.cached_tokens = _int_or_none(meta.get("cached_tokens"))
    rec.completion_tokens = int(meta.get("completion_tokens", len(rec.output_ids)))
    ttft = meta.get("ttft_s")
    rec.server_ttft_s = float(ttft) if ttft is not None else None


async def _read_stream(resp: Any, rec: Record, clock: Clock) -> None:
    """Server-sent events of ``/v1/completions``: ``data: {...}`` lines until ``data: [DONE]``. The first
    chunk carrying a choice ends TTFT; token ids come from ``choices[0].token_ids`` (when the server sends
    them); usage from the chunk that carries it."""
    ids: list[int] = []
    texts: list[str] = []
    has_ids = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise _Failed(f"stream error: {_error_text(json.dumps(chunk))}")
        for choice in chunk.get("choices") or []:
            if rec.first_s is None:
                rec.first_s = clock.now()
            if choice.get("token_ids") or choice.get("text"):
                rec.token_s.append(clock.now())
            if isinstance(choice.get("text"), str):
                texts.append(choice["text"])
            if choice.get("token_ids") is not None:
                has_ids = True
                ids.extend(int(x) for x in choice["token_ids"])
        if chunk.get("usage"):
            _read_usage(chunk["usage"], rec)
    if rec.first_s is None:
        raise _Failed("the stream ended without a completion chunk")
    rec.output_ids = ids if has_ids else None
    rec.output_text = "".join(texts)
    if not rec.completion_tokens:
        rec.completion_tokens = len(ids)


def _read_usage(usage: dict[str, Any], rec: Record) -> None:
    if usage.get("prompt_tokens"):
        rec.prompt_tokens = int(usage["prompt_tokens"])
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = _int_or_none(details.get("cached_tokens", usage.get("cached_tokens")))


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)


# -- the run ---------------------------------------------------------------------------------------
@dataclass
class LoadConfig:
    url: str                      # scheme://host:port, no trailing slash
    endpoint: str = "completions"
    model: str = "cpkv"
    max_tokens: int = 1
    duration_s: float | None = None  # no send after this many seconds
    concurrency: int | None = None   # closed loop: requests in flight (None: open loop)
    timeout_s: float = 600.0         # per request
    prompt_format: str = "ids"       # ids | text (the plan's own_text, see detokenize_plan)
    sampling: dict[str, float] = field(default_factory=dict)  # sent with every request (empty: greedy)


@dataclass
class _State:
    records: dict[Hashable, Record]
    prompts: dict[Hashable, list[int] | str] = field(default_factory=dict)
    done: dict[Hashable, asyncio.Event] = field(default_factory=dict)


async def run_load(plan: Sequence[Planned], cfg: LoadConfig, clock: Clock | None = None,
                   on_done: Callable[[Record], None] | None = None, client: Any = None) -> list[Record]:
    """Send ``plan``'s requests (open loop at their due times, or closed loop) and return one Record each,
    in plan order."""
    import httpx

    clock = clock or Clock()
    st = _State({p.id: Record(p.id, p.parent, p.due) for p in plan})
    st.done = {p.id: asyncio.Event() for p in plan}
    own = client is None
    if own:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), limits=limits)
    try:
        if cfg.concurrency is None:
            await _open_loop(plan, cfg, st, clock, client, on_done)
        else:
            await _closed_loop(plan, cfg, st, clock, client, on_done)
    finally:
        if own:
            await client.aclose()
    return [st.records[p.id] for p in plan]


async def _open_loop(plan: Sequence[Planned], cfg: LoadConfig, st: _State, clock: Clock, client: Any,
                     on_done) -> None:
    """First requests (no parent) sent by one dispatcher in due order, each send started before the clock
    moves on; a follow-up waits for its parent, then for its due time, in a task of its own."""
    tasks = [asyncio.ensure_future(_follow_up(p, cfg, st, clock, client, on_done))
             for p in plan if p.parent is not None]
    for p in sorted((p for p in plan if p.parent is None), key=lambda p: p.due or 0.0):
        if not _past_duration(p.due or 0.0, cfg):
            await clock.sleep_until(p.due or 0.0)
        started = asyncio.Event()
        tasks.append(asyncio.ensure_future(_send(p, cfg, st, clock, client, on_done, started)))
        await started.wait()
    await asyncio.gather(*tasks)


async def _follow_up(p: Planned, cfg: LoadConfig, st: _State, clock: Clock, client: Any, on_done) -> None:
    if not _past_duration(p.due or 0.0, cfg):  # due after --duration: marked not sent at once
        await st.done[p.parent].wait()
        await clock.sleep_until(p.due or 0.0)
    await _send(p, cfg, st, clock, client, on_done)


def _past_duration(t: float, cfg: LoadConfig) -> bool:
    return cfg.duration_s is not None and t > cfg.duration_s


async def _closed_loop(plan: Sequence[Planned], cfg: LoadConfig, st: _State, clock: Clock, client: Any,
                       on_done) -> None:
    """``cfg.concurrency`` requests in flight; the next in plan order goes when one finishes (a follow-up
    also waits for its parent)."""
    slots = asyncio.Semaphore(cfg.concurrency)
    tasks = []

    async def go(p: Planned) -> None:
        try:
            await _send(p, cfg, st, clock, client, on_done)
        finally:
            slots.release()

    for p in plan:
        if p.parent is not None:
            await st.done[p.parent].wait()
        await slots.acquire()
        tasks.append(asyncio.ensure_future(go(p)))
    await asyncio.gather(*tasks)


async def _send(p: Planned, cfg: LoadConfig, st: _State, clock: Clock, client: Any, on_done,
                started: asyncio.Event | None = None) -> None:
    """Send ``p`` (or record why not); ``started`` is set once its send time is taken."""
    rec = st.records[p.id]
    try:
        rec.status = _blocked(p, cfg, st, clock)
        if rec.status == "ready":
            prompt = _prompt_text(p, st, rec) if cfg.prompt_format == "text" else _prompt(p, st, rec)
            st.prompts[p.id] = prompt
            await send_one(client, cfg.url, cfg.endpoint, cfg.model, prompt, cfg.max_tokens, rec, clock, started,
                           cfg.sampling)
    finally:
        if started is not None:
            started.set()
        st.done[p.id].set()
        if on_done is not None:
            on_done(rec)


def _blocked(p: Planned, cfg: LoadConfig, st: _State, clock: Clock) -> str:
    """``ready``, or why not: ``not_sent`` (past --duration, or the parent was not sent), ``skipped`` (the
    parent failed or was skipped)."""
    if _past_duration(p.due or 0.0, cfg) or _past_duration(clock.now(), cfg):
        return "not_sent"
    if p.parent is None:
        return "ready"
    parent = st.records[p.parent].status
    return "ready" if parent == "ok" else "not_sent" if parent == "not_sent" else "skipped"


def _prompt(p: Planned, st: _State, rec: Record) -> list[int]:
    """parent's prompt (as sent) + parent's output ids + own tokens."""
    if p.parent is None:
        return list(p.own_tokens)
    out = st.records[p.parent].output_ids
    rec.parent_output_missing = out is None
    return st.prompts[p.parent] + list(out or []) + list(p.own_tokens)


def _prompt_text(p: Planned, st: _State, rec: Record) -> str:
    """Text prompts: parent's prompt text (as sent) + parent's output text + own text."""
    if p.own_text is None:
        raise ValueError(f"request {p.id!r}: prompt_format 'text' needs the plan's text (detokenize_plan)")
    if p.parent is None:
        return p.own_text
    out = st.records[p.parent].output_text
    rec.parent_output_missing = out is None
    return str(st.prompts[p.parent]) + (out or "") + p.own_text


def detokenize_plan(plan: Sequence[Planned], url: str, model: str, timeout_s: float = 60.0,
                    client: Any = None) -> list[Planned]:
    """``plan`` with each request's ``own_text``: its own tokens as the server's ``POST /detokenize`` turns them
    into text (vLLM's shape: ``{"model", "tokens"}`` -> ``{"prompt"}``). Raises ``ConfigError`` when the server
    cannot (no tokenizer, no such endpoint)."""
    import httpx

    from dataclasses import replace

    from cpkv.errors import ConfigError

    own = client is None
    client = client or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0))
    out = []
    try:
        for p in plan:
            try:
                resp = client.post(url + "/detokenize", json={"model": model, "tokens": list(p.own_tokens)})
            except httpx.HTTPError as exc:
                raise ConfigError(f"--prompt-format text: POST {url}/detokenize failed: {type(exc).__name__}: "
                                  f"{str(exc)[:200]}") from None
            if resp.status_code != 200:
                raise ConfigError(f"--prompt-format text: the server cannot turn token ids into text (POST "
                                  f"/detokenize: HTTP {resp.status_code}: {_error_text(resp.text)})")
            text = resp.json().get("prompt") if resp.headers.get("content-type", "").startswith("application/json") \
                else None
            if not isinstance(text, str):
                raise ConfigError(f"--prompt-format text: POST /detokenize answered no 'prompt' text: {resp.text[:200]}")
            out.append(replace(p, own_text=text))
    finally:
        if own:
            client.close()
    return out
