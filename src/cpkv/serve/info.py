"""The routes beside generation: what the server is, its cache, its tokenizer (SGLang's and vLLM's shapes).

    GET  /get_model_info      SGLang: model_path, tokenizer_path, is_generation, ... (also /model_info)
    GET  /get_server_info     SGLang: the server's settings (cp, chunk size, page size, pool, caps, policy,
                              weights, precision, graphs, ...), version, internal_states (also /server_info)
    GET|POST /flush_cache     empty the prefix cache: 200 when nothing runs, else 409
    POST /tokenize            vLLM: {prompt | messages, add_special_tokens, add_generation_prompt,
                              return_token_strs} -> {count, max_model_len, tokens, token_strs}
    POST /detokenize          vLLM: {tokens} -> {prompt}
    GET  /health_generate     one token generated end to end: 200, else 503
    GET  /version             {"version": cpkv's}

Registered by ``cpkv.serve.app.build_app``; answers and errors in the same JSON shapes as the rest.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import cpkv
from cpkv.engine.protocol import Finished, Flushed
from cpkv.serve.protocol import BadRequest, _bool, _kind, _known, _message, _model, _token_ids, load_json

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}
HEALTH_PROMPT = (1, 2, 3, 4)  # /health_generate's prompt: token ids every vocabulary holds


def routes(st: Any) -> list[Route]:
    """The routes, over ``st``: the app's ``ServeState`` (not imported: ``app`` imports this module)."""
    i = _Info(st)
    return [Route("/get_model_info", i.model_info, methods=["GET"]),
            Route("/model_info", i.model_info, methods=["GET"]),
            Route("/get_server_info", i.server_info, methods=["GET"]),
            Route("/server_info", i.server_info, methods=["GET"]),
            Route("/flush_cache", i.flush_cache, methods=["GET", "POST"]),
            Route("/tokenize", _errors(i.tokenize), methods=["POST"]),
            Route("/detokenize", _errors(i.detokenize), methods=["POST"]),
            Route("/health_generate", i.health_generate, methods=["GET"]),
            Route("/version", i.version, methods=["GET"])]


def _errors(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        try:
            return await route(request)
        except BadRequest as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
    return wrapped


class _Info:
    def __init__(self, st: Any) -> None:
        self.st, self.fe = st, st.fe

    async def model_info(self, request: Request) -> Response:
        cfg = self.fe.client.model_cfg
        return JSONResponse({"model_path": self.st.info.get("model_path", self.st.name),
                             "tokenizer_path": self.st.info.get("tokenizer_path"), "is_generation": True,
                             "served_model_name": self.st.name, "model_type": cfg.model_type,
                             "context_length": self.st.context_length, "vocab_size": cfg.vocab_size,
                             "has_tokenizer": self.st.tok is not None, "preferred_sampling_params": None,
                             "weight_version": "default", "has_image_understanding": False,
                             "has_audio_understanding": False})

    async def server_info(self, request: Request) -> Response:
        c = self.fe.client
        running, waiting = self.fe.counts()
        state = {"num_running_reqs": running, "num_waiting_reqs": waiting, "engine_requests": c.in_flight,
                 "pool_pages": c.cfg.cp * (c.cfg.pages_per_rank - 1)}
        return JSONResponse({**self.st.info, "context_length": self.st.context_length,
                             "version": cpkv.__version__, "internal_states": [state]})

    async def flush_cache(self, request: Request) -> Response:
        if self.fe.flights:
            return _busy(len(self.fe.flights))
        ev = await _engine_answer(self.fe.client.flush)
        if isinstance(ev, Finished):
            return JSONResponse(BadRequest(f"the engine is not serving: {ev.detail}", None, 503).body(), 503)
        if ev.pages < 0:
            return _busy(0)
        return JSONResponse({"flushed": True, "pages_freed": ev.pages})

    async def tokenize(self, request: Request) -> Response:
        body = load_json(await request.body())
        _known(body, TOKENIZE_FIELDS)
        self._check_model(body)
        tok = self._tokenizer()
        if ("prompt" in body) == ("messages" in body):
            raise BadRequest("give exactly one of 'prompt' or 'messages'", "prompt")
        ids = _chat_ids(tok, body) if "messages" in body else _prompt_ids(tok, body)
        strs = tok.tok.convert_ids_to_tokens(ids) if _bool(body, "return_token_strs") else None
        return JSONResponse({"count": len(ids), "max_model_len": self.st.context_length, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        body = load_json(await request.body())
        _known(body, DETOKENIZE_FIELDS)
        self._check_model(body)
        tok = self._tokenizer()
        ids = _token_ids(body.get("tokens"), "tokens")
        vocab = self.fe.client.vocab_size
        bad = next((i for i, t in enumerate(ids) if t >= vocab), None)
        if bad is not None:
            raise BadRequest(f"'tokens'[{bad}] = {ids[bad]} is outside the vocabulary (0..{vocab - 1})", "tokens")
        return JSONResponse({"prompt": tok.decode(ids, skip_special_tokens=False)})

    async def health_generate(self, request: Request) -> Response:
        try:
            flight = self.fe.open(list(HEALTH_PROMPT), 1)
            async for out in flight.events():
                if out.finish_reason is not None:
                    return JSONResponse({"status": "ok", "token": out.tokens[0]})
        except BadRequest as exc:
            return JSONResponse({"status": "unhealthy", "error": exc.message}, status_code=503)
        return JSONResponse({"status": "unhealthy", "error": "no token"}, status_code=503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": cpkv.__version__})

    def _tokenizer(self):
        if self.st.tok is None:
            raise BadRequest(f"model {self.st.name} has no tokenizer (start the server with --tokenizer)", "model")
        return self.st.tok

    def _check_model(self, body: dict[str, Any]) -> None:
        model = _model(body)
        if model is not None and model != self.st.name:
            raise BadRequest(f"model {model!r} is not served here; this server serves {self.st.name!r}", "model", 404)


def _prompt_ids(tok, body: dict[str, Any]) -> list[int]:
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise BadRequest(f"'prompt' must be a string, got {_kind(prompt)}", "prompt")
    return list(tok.tok.encode(prompt, add_special_tokens=_bool(body, "add_special_tokens", default=True)))


def _chat_ids(tok, body: dict[str, Any]) -> list[int]:
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"'messages' must be a non-empty list of {{role, content}} objects, got {_kind(messages)}",
                         "messages")
    for i, m in enumerate(messages):
        _message(m, f"messages[{i}]")
    if not tok.has_chat_template:
        raise BadRequest("this server's tokenizer has no chat template (start it with --chat-template)", "messages")
    if _bool(body, "add_special_tokens") or _bool(body, "continue_final_message"):
        field = "add_special_tokens" if _bool(body, "add_special_tokens") else "continue_final_message"
        raise BadRequest(f"'{field}' is not supported for messages: expected false or absent", field)
    gen = _bool(body, "add_generation_prompt", default=True)
    text = tok.tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    return tok.encode(text)


def _busy(n: int) -> Response:
    what = f"{n} requests are in flight" if n else "the engine holds generations"
    return JSONResponse(BadRequest(f"cannot flush the cache while requests run ({what}); retry when idle", None,
                                   409).body(), status_code=409)


async def _engine_answer(send: Callable[[Callable[[Any], None]], int]) -> Flushed | Finished:
    """Send a message through ``send(on_event)`` and await its one answer (delivered on the watch thread)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def done(ev: Any) -> None:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(ev))
    send(done)
    return await fut
