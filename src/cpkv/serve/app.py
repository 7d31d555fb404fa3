"""The HTTP routes (Starlette): parse, validate, await the front end, shape the answer. Nothing else.

    GET  /health               200 {"status": "ok", "ranks": [...]} when every rank serves, else 503
    GET  /v1/models            the served model
    POST /v1/completions       OpenAI completions (text or token-id prompt; SSE with ``stream``)
    POST /v1/chat/completions  OpenAI chat, when the checkpoint has a tokenizer with a chat template
    POST /generate             SGLang-native: output_ids, text (with a tokenizer), meta_info
    GET  /metrics              Prometheus text
    ...                        the info, cache and tokenizer routes of ``cpkv.serve.info``

A client that disconnects cancels its request (non-streaming: a task waits for ``http.disconnect``; streaming:
the response listens for it beside the stream); one that goes away while sending its body is a quiet 499. Errors,
404 and 405 included, are JSON ``{"error": {message, type, param, code}}``.

Limits (``ServeState``): a body longer than ``max_body_bytes`` is a 413 as soon as its length is declared or
read (the rest is never read); one that does not arrive within ``body_timeout_s`` is a 408. A body over
``OFF_LOOP_BYTES`` is parsed, validated and tokenized on a worker thread, so /health keeps answering meanwhile.
With ``api_key`` set, every path but ``OPEN_PATHS`` needs ``Authorization: Bearer KEY`` (else 401).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cpkv.engine.protocol import mix_seed
from cpkv.serve import info
from cpkv.serve.frontend import Flight, Frontend, Refused
from cpkv.serve.output import ChoiceText, chat_logprobs, completion_logprobs, generate_logprobs
from cpkv.serve.protocol import BadRequest, GenRequest, load_json, parse_chat, parse_completion, parse_generate
from cpkv.serve.tokenizer import Tokenizer

log = logging.getLogger("cpkv.serve")

OFF_LOOP_BYTES = 64 << 10          # bodies longer than this are parsed on a worker thread
DEFAULT_MAX_BODY = 64 << 20
DEFAULT_BODY_TIMEOUT_S = 60.0
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key


class Disconnected(Exception):
    """The client went away before its answer (its request was cancelled in the engine)."""


@dataclass
class ServeState:
    fe: Frontend
    tok: Tokenizer | None
    name: str                       # the served model name (``model`` must match it when given)
    max_body_bytes: int = DEFAULT_MAX_BODY
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    api_key: str | None = None      # None: no authentication
    eos_ids: frozenset[int] = frozenset()  # the checkpoint's generation_config.json EOS ids (beside the tokenizer's)
    context_length: int = 0         # tokens a request may hold, prompt and generation (0: the model's)
    info: dict[str, Any] = field(default_factory=dict)  # the settings /get_server_info reports (``cmd.server_info``)

    def __post_init__(self) -> None:
        self.context_length = self.context_length or self.fe.client.model_cfg.max_context


@dataclass
class Choice:
    """One generated sequence of an answer: ``index`` in ``choices``, its flight, its text, its prompt."""

    index: int
    flight: Flight
    text: ChoiceText
    prompt: list[int]
    echo: str = ""                  # the prompt's text, with ``echo``
    first: bool = True              # the first choice of its prompt (its prompt counted once in usage)
    sent: int = 0                   # tokens streamed so far
    head: bool = False              # its first streamed chunk went out
    seen: int = 0                   # tokens the answer has taken in (usage so far)
    sent_text: str = ""             # text streamed so far


def build_app(st: ServeState) -> Starlette:
    api = _Api(st)
    middleware = [Middleware(ApiKey, key=st.api_key)] if st.api_key else []
    return Starlette(routes=[
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/completions", api.handler(parse_completion, api.completion), methods=["POST"]),
        Route("/v1/chat/completions", api.handler(parse_chat, api.chat), methods=["POST"]),
        Route("/generate", api.handler(parse_generate, api.generate), methods=["POST"]),
        *info.routes(st),
    ], middleware=middleware, exception_handlers={HTTPException: _http_error})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 in the JSON error shape of every other answer."""
    if exc.status_code == 404:
        message = f"no such path: {request.url.path}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path} (allowed: {allowed})"
    else:
        message = str(exc.detail)
    return JSONResponse(BadRequest(message, None, exc.status_code).body(), status_code=exc.status_code,
                        headers=exc.headers)


class ApiKey:
    """ASGI middleware: every HTTP path but ``OPEN_PATHS`` needs ``Authorization: Bearer KEY`` (compared in
    constant time); else 401 in the JSON error shape."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = BadRequest("missing or wrong API key: send the header 'Authorization: Bearer KEY'", None, 401).body()
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


class _Api:
    def __init__(self, st: ServeState) -> None:
        self.st, self.fe = st, st.fe
        self.created = int(time.time())

    # -- plain routes ------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        c = self.fe.client
        ranks = [{"rank": r, "pid": pid} for r, pid in enumerate(c.pids)]
        if c.healthy and not self.fe.draining:
            return JSONResponse({"status": "ok", "ranks": ranks})
        status = "stopping" if self.fe.draining else f"failed: {c.failure}" if c.failure else "not ready"
        return JSONResponse({"status": status, "ranks": ranks}, status_code=503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.st.name, "object": "model", "created": self.created, "owned_by": "cpkv",
            "root": self.st.name, "max_model_len": self.st.context_length}]})

    async def metrics(self, request: Request) -> Response:
        return Response(self.fe.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- generation routes -------------------------------------------------------------------------
    def handler(self, parse: Callable[[dict], GenRequest],
                answer: Callable[[Request, GenRequest, list[Choice]], Awaitable[Response]]):
        async def route(request: Request) -> Response:
            try:
                raw = await read_body(request, self.st.max_body_bytes, self.st.body_timeout_s)
                g, prompts = await self._prepare(parse, raw)
                return await answer(request, g, self._open(g, prompts))
            except Disconnected:
                return Response(status_code=499)  # nobody reads it: the client is gone
            except BadRequest as exc:
                reason = exc.reason if isinstance(exc, Refused) else "invalid"
                self.fe.metrics.rejected.labels(reason=reason).inc()
                return JSONResponse(exc.body(), status_code=exc.status, headers=_error_headers(exc.status))
            except Exception as exc:  # a bug: one 500 for this request, the server goes on
                log.exception("%s %s failed", request.method, request.url.path)
                return JSONResponse(BadRequest(f"internal error: {type(exc).__name__}: {exc}", None, 500).body(),
                                    status_code=500)
        return route

    async def _prepare(self, parse: Callable[[dict], GenRequest], raw: bytes) -> tuple[GenRequest, list[list[int]]]:
        """The request and its prompts' token ids. A long body, and any text to tokenize, on a worker thread: the
        event loop keeps serving every other request meanwhile (parsing a 10 MB body, or a long conversation's
        template and tokenization, take 0.1-2 s)."""
        if len(raw) > OFF_LOOP_BYTES:
            return await anyio.to_thread.run_sync(self._request, parse, raw)
        g = parse(load_json(raw))
        if g.kind == "chat" or any(isinstance(p, str) for p in g.prompts):
            return g, await anyio.to_thread.run_sync(self._all_tokens, g)
        return g, self._all_tokens(g)

    def _request(self, parse: Callable[[dict], GenRequest], raw: bytes) -> tuple[GenRequest, list[list[int]]]:
        g = parse(load_json(raw))
        return g, self._all_tokens(g)

    def _all_tokens(self, g: GenRequest) -> list[list[int]]:
        st = self.st
        if g.model is not None and g.model != st.name:
            raise BadRequest(f"model {g.model!r} is not served here; this server serves {st.name!r}", "model", 404)
        if g.stop and st.tok is None:
            raise BadRequest(f"'stop' strings need a tokenizer and model {st.name} has none: use 'stop_token_ids'",
                             "stop")
        if g.kind == "chat":
            return [self._tokens(g, None)]
        return [self._tokens(g, p) for p in g.prompts]

    def _tokens(self, g: GenRequest, prompt: list[int] | str | None) -> list[int]:
        """The prompt as token ids, checked against the vocabulary, the context and admission."""
        st, client = self.st, self.fe.client
        if g.kind == "chat":
            if st.tok is None or not st.tok.has_chat_template:
                raise BadRequest(f"model {st.name} has no tokenizer with a chat template: use /v1/completions or "
                                 "/generate with token ids", "messages")
            tokens = st.tok.chat(g.messages or [])
        elif isinstance(prompt, str):
            if st.tok is None:
                raise BadRequest(f"model {st.name} has no tokenizer: give the prompt as token ids", g.prompt_field)
            tokens = st.tok.text(prompt)
        else:
            tokens = list(prompt or [])
        _check_tokens(tokens, g, client.vocab_size, st.name)
        why = client.never_reason(len(tokens))
        if why is not None:
            raise BadRequest(f"the prompt of {len(tokens)} tokens can never be served: {why}", g.prompt_field)
        if len(tokens) >= st.context_length:
            raise BadRequest(f"the prompt of {len(tokens)} tokens leaves no room for a token within the context "
                             f"length {st.context_length}", g.prompt_field)
        return tokens

    def _room(self, g: GenRequest, prompt_len: int) -> int:
        """The tokens to generate after a prompt: ``max_new_tokens``, or when that was the default, as many of
        them as the context leaves; a given one past the context is a 400 naming it."""
        client, ctx, asked = self.fe.client, self.st.context_length, g.max_new_tokens
        if prompt_len + asked > ctx:
            if g.max_given:
                raise BadRequest(f"prompt ({prompt_len} tokens) + {g.max_field.split('.')[-1]} ({asked}) exceeds the "
                                 f"context length {ctx}", g.max_field)
            g = replace(g, max_new_tokens=ctx - prompt_len)  # the default: as many as the context leaves
        why = client.never_reason(prompt_len + g.max_new_tokens - 1)
        if why is None:
            return g.max_new_tokens
        if g.max_given:
            raise BadRequest(f"prompt ({prompt_len} tokens) + {g.max_field.split('.')[-1]} ({g.max_new_tokens}) "
                             f"can never be served: {why}", g.max_field)
        lo, hi = 1, g.max_new_tokens  # the prompt alone fits: the most that still does (the context's cap)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if client.never_reason(prompt_len + mid - 1) is None else (lo, mid - 1)
        return lo

    def _stop_ids(self, g: GenRequest) -> frozenset[int]:
        eos = frozenset() if g.ignore_eos else self.st.eos_ids | (self.st.tok.stop_ids if self.st.tok else frozenset())
        return eos | g.stop_token_ids

    def _open(self, g: GenRequest, prompts: list[list[int]]) -> list[Choice]:
        """Submit each prompt ``n`` times (choice i * n + j: prompt i, sample j; sample j > 0 with its own seed
        from the request's); a refusal cancels those already submitted."""
        base = g.seed if g.seed is not None else secrets.randbits(63)
        stop_ids, choices = self._stop_ids(g), []
        try:
            for i, tokens in enumerate(prompts):
                room = self._room(g, len(tokens))
                for j in range(g.n):
                    sampling = replace(g.sampling, seed=base if j == 0 else mix_seed(base, j))
                    flight = self.fe.open(tokens, room, stop_ids, sampling)
                    text = ChoiceText(self.st.tok, g.stop, g.keep_stop, g.skip_special_tokens, stop_ids)
                    choices.append(Choice(len(choices), flight, text, tokens, self._echo(g, i, tokens), j == 0))
        except BadRequest:
            for c in choices:
                c.flight.end("cancelled")
            raise
        return choices

    def _echo(self, g: GenRequest, i: int, tokens: list[int]) -> str:
        if not g.echo:
            return ""
        prompt = g.prompts[i]
        return prompt if isinstance(prompt, str) else self._text(tokens, g)

    # -- completions -------------------------------------------------------------------------------
    async def completion(self, request: Request, g: GenRequest, choices: list[Choice]) -> Response:
        rid = f"cmpl-{uuid.uuid4().hex}"
        if g.stream:
            return _sse(self._completion_chunks(choices, g, rid), request)
        await _until_done(request, _merged(choices))
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": self.st.name,
            "choices": [self._completion_choice(c, g) for c in choices], "usage": _usage(choices)})

    def _completion_choice(self, c: Choice, g: GenRequest) -> dict[str, Any]:
        out = c.flight.out
        lps = completion_logprobs(self.st.tok, out.tokens, out.logprobs, len(c.echo)) \
            if g.sampling.logprobs is not None else None
        return {"index": c.index, "text": c.echo + c.text.visible(True), "token_ids": out.tokens, "logprobs": lps,
                "finish_reason": out.finish_reason}

    async def _completion_chunks(self, choices: list[Choice], g: GenRequest, rid: str) -> AsyncIterator[dict]:
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.st.name}
        async for news in _merged(choices):  # after each token, and once more at the finish
            c, out, text = news.c, news.c.flight.out, news.delta()
            if not c.head:
                text, c.head = c.echo + text, True
            new = out.tokens[c.sent:news.n]
            lps = completion_logprobs(self.st.tok, new, out.logprobs[c.sent:news.n]) \
                if g.sampling.logprobs is not None else None
            c.sent = news.n
            choice = {"index": c.index, "text": text, "token_ids": new, "logprobs": lps,
                      "finish_reason": news.reason}
            yield _with_usage({**head, "choices": [choice]}, g, choices)
        if g.include_usage:
            yield {**head, "choices": [], "usage": _usage(choices)}

    # -- chat --------------------------------------------------------------------------------------
    async def chat(self, request: Request, g: GenRequest, choices: list[Choice]) -> Response:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if g.stream:
            return _sse(self._chat_chunks(choices, g, rid), request)
        await _until_done(request, _merged(choices))
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.st.name,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text.visible(True)},
                         "logprobs": self._chat_logprobs(c, g, 0), "finish_reason": c.flight.out.finish_reason}
                        for c in choices],
            "usage": _usage(choices)})

    def _chat_logprobs(self, c: Choice, g: GenRequest, start: int, end: int | None = None) -> dict[str, Any] | None:
        out = c.flight.out
        if g.sampling.logprobs is None:
            return None
        end = len(out.tokens) if end is None else end
        return chat_logprobs(self.st.tok, out.tokens[start:end], out.logprobs[start:end])

    async def _chat_chunks(self, choices: list[Choice], g: GenRequest, rid: str) -> AsyncIterator[dict]:
        head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.st.name}
        for c in choices:
            yield _with_usage({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]}, g, choices)
        async for news in _merged(choices):
            c = news.c
            lps = self._chat_logprobs(c, g, c.sent, news.n)
            c.sent = news.n
            yield _with_usage({**head, "choices": [{"index": c.index, "delta": {"content": news.delta()},
                                                    "logprobs": lps, "finish_reason": news.reason}]}, g, choices)
        if g.include_usage:
            yield {**head, "choices": [], "usage": _usage(choices)}

    # -- /generate ---------------------------------------------------------------------------------
    async def generate(self, request: Request, g: GenRequest, choices: list[Choice]) -> Response:
        rid = g.rid or uuid.uuid4().hex
        if g.stream:
            return _sse(self._generate_chunks(choices[0], g, rid), request)
        await _until_done(request, _merged(choices))
        return JSONResponse(self._generate_body(choices[0], g, rid))

    async def _generate_chunks(self, c: Choice, g: GenRequest, rid: str) -> AsyncIterator[dict]:
        async for news in _merged([c]):  # cumulative, as SGLang streams
            yield self._generate_body(c, g, rid, news)

    def _generate_body(self, c: Choice, g: GenRequest, rid: str, news: News | None = None) -> dict[str, Any]:
        """The answer so far (``news``: a streamed state; None: the finished one)."""
        out = c.flight.out
        tokens = out.tokens[:news.n] if news is not None else list(out.tokens)
        body: dict[str, Any] = {"output_ids": tokens}
        if self.st.tok is not None:
            body["text"] = news.visible if news is not None else c.text.visible(True)
        reason = news.reason if news is not None else out.finish_reason
        fin = None if reason is None else {"type": reason, "length": len(tokens)}
        body["meta_info"] = {"id": rid, "prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens,
                             "completion_tokens": len(tokens), "ttft_s": round(out.ttft_s, 6),
                             "e2e_latency_s": round(out.e2e_s, 6) if reason else None,
                             "finish_reason": fin}
        if g.sampling.logprobs is not None:
            body["meta_info"].update(generate_logprobs(self.st.tok, tokens, out.logprobs[:len(tokens)],
                                                       g.text_in_logprobs))
        return body

    def _text(self, tokens: list[int], g: GenRequest) -> str:
        return self.st.tok.decode(tokens, g.skip_special_tokens) if self.st.tok is not None else ""


@dataclass
class News:
    """A choice's state after one of its tokens (or its finish), taken when it came: the outcome's first ``n``
    tokens, whether it is final (``reason`` set) and the text a stream may show."""

    c: Choice
    n: int
    reason: str | None
    visible: str

    @property
    def final(self) -> bool:
        return self.reason is not None

    def delta(self) -> str:
        """The text since the choice's last streamed chunk."""
        c = self.c
        if not self.visible.startswith(c.sent_text):
            return ""  # the decoder changed text already sent (it cannot be taken back)
        new, c.sent_text = self.visible[len(c.sent_text):], self.visible
        return new


async def _merged(choices: list[Choice]) -> AsyncIterator[News]:
    """``News`` after each token of every choice, choices interleaved as their tokens come. A choice whose text
    reaches a stop string ends there (its flight finished as "stop"); a failure of any choice raises (the others
    are cancelled on the way out)."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async with aclosing(c.flight.events()) as events:
                async for out in events:
                    if c.text.push(out.tokens, out.finish_reason):
                        c.flight.end("stop")
                        out.finish_reason = "stop"
                    final = out.finish_reason is not None
                    q.put_nowait(News(c, len(out.tokens), out.finish_reason, c.text.visible(final)))
                    if final:
                        return
        except Exception as exc:  # Refused: the engine failed or rejected it
            q.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            news = await q.get()
            if isinstance(news, Exception):
                raise news
            left -= news.final
            news.c.seen = news.n
            yield news
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _check_tokens(tokens: list[int], g: GenRequest, vocab: int, model: str) -> None:
    if not tokens:
        raise BadRequest("the prompt holds no tokens", g.prompt_field)
    top = max(tokens)
    if top >= vocab:
        i = tokens.index(top)
        raise BadRequest(f"'{g.prompt_field}'[{i}] = {top} is outside the vocabulary of model {model} (token ids "
                         f"0..{vocab - 1})", g.prompt_field)


def _with_usage(chunk: dict[str, Any], g: GenRequest, choices: list[Choice]) -> dict[str, Any]:
    """A streamed chunk, with the usage so far when the client asked for it in every chunk."""
    if g.continuous_usage:
        chunk["usage"] = _usage(choices)
    return chunk


def _error_headers(status: int) -> dict[str, str] | None:
    return {"Retry-After": "1"} if status in (429, 503) else None


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request's body, read as it arrives: 413 once it is declared or grows past ``limit`` bytes, 408 when it
    is not complete within ``timeout_s``; Disconnected when the client goes away meanwhile."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise BadRequest(f"the request body did not arrive within {timeout_s:g} s", None, 408) from None
    except ClientDisconnect:
        raise Disconnected() from None
    return b"".join(chunks)


def _too_large(limit: int) -> BadRequest:
    return BadRequest(f"the request body is larger than this server's limit of {limit / (1 << 20):g} MiB "
                      "(--max-body-mb)", None, 413)


def _usage(choices: list[Choice]) -> dict[str, Any]:
    """Every prompt counted once (its first choice's cached tokens), every choice's generated tokens."""
    prompt = sum(len(c.prompt) for c in choices if c.first)
    made = sum(c.seen for c in choices)
    cached = sum(c.flight.out.cached_tokens for c in choices if c.first)
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _until_done(request: Request, events: AsyncIterator) -> None:
    """Run ``events`` to its end; a disconnect first cancels the requests (the answer goes nowhere)."""
    async def run() -> None:
        async with aclosing(events) as it:
            async for _ in it:
                pass

    task = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Disconnected()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(chunks: AsyncIterator[dict], request: Request) -> Response:
    async def lines() -> AsyncIterator[str]:
        try:
            async with aclosing(chunks) as it:
                async for chunk in it:
                    yield f"data: {json.dumps(chunk)}\n\n"
        except BadRequest as exc:  # after the 200 went out: the error is the stream's last event
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"
    return _EventStream(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _EventStream(StreamingResponse):
    """A streaming response that always listens for the client's disconnect beside the stream (Starlette does
    so only under ASGI < 2.4), so a client that goes away cancels the generation at once."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass
                tg.cancel_scope.cancel()
            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
