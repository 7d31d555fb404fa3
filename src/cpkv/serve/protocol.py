"""Request bodies of the HTTP API, parsed and validated into one ``GenRequest``; no engine, no HTTP.

Every error is a ``BadRequest`` naming the field (OpenAI's ``param``) with what was expected and what came:

    POST /v1/completions        model, prompt (text or token ids), max_tokens (16), temperature (0 only),
                                top_p, n (1), stream, stream_options {include_usage, continuous_usage_stats},
                                user, seed, stop (null), echo (false), logprobs (null)
    POST /v1/chat/completions   model, messages [{role, content, name}], max_tokens / max_completion_tokens
                                (128), temperature, top_p, n, stream, stream_options, user, seed, stop (null)
    POST /generate              text or input_ids, sampling_params {max_new_tokens (128), temperature,
                                top_p, ignore_eos, skip_special_tokens (true)}, stream, rid, return_logprob (false)

SGLang's router adds its own fields at their defaults (``ROUTER_GENERATE``, ``ROUTER_OPENAI``): accepted at exactly
that value or null, a 400 naming the field at any other.

Greedy decoding only: ``temperature`` absent or 0 (any other value is a 400 naming it). Fields outside
these lists are a 400 (``unknown field``), so a typo never passes silently; a known field is honoured or, at
a value that asks for what cpkv does not do, refused. Types are strict: a boolean is ``true`` / ``false`` (not
0 or 1), an integer is an integer (not 1.0), a number is finite. Text must be encodable as UTF-8 (a lone
surrogate such as ``"\ud800"`` is a 400 naming its field); a chat role is one of ``ROLES``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

INT32_MAX = (1 << 31) - 1
ROLES = ("system", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "name"}


class BadRequest(Exception):
    """A 4xx answer: ``status``, the field at fault (``param``, may be None) and the message."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


@dataclass
class GenRequest:
    """One generation as the front end hands it on. ``prompt``: token ids or text (``messages`` for chat)."""

    kind: str                       # "completions" | "chat" | "generate"
    prompt: list[int] | str | None
    max_new_tokens: int
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage in every streamed chunk (stream_options.continuous_usage_stats)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    rid: str | None = None
    prompt_field: str = "prompt"    # the field a prompt error names
    max_field: str = "max_tokens"


COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                     "user", "seed", "stop", "echo", "logprobs"}
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
               "stream_options", "user", "seed", "stop"}
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "rid", "return_logprob"}
SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "ignore_eos", "skip_special_tokens"}
# SGLang's fields that its router (sglang-router) adds at their defaults: accepted at exactly that value (or null)
ROUTER_GENERATE = {"model": None, "background": False, "return_hidden_states": False, "log_metrics": True,
                   "return_text_in_logprobs": False, "no_logs": False, "return_bytes": False, "return_entropy": False}
ROUTER_OPENAI = {"ignore_eos": False, "no_stop_trim": False, "skip_special_tokens": True,
                 "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
                 "return_hidden_states": False}


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also bad UTF-8 and absurd numbers
        raise BadRequest(f"the body is not valid JSON ({str(exc).split(':')[0]})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {_kind(body)}")
    return body


def parse_completion(body: dict[str, Any]) -> GenRequest:
    _known(body, COMPLETION_FIELDS | set(ROUTER_OPENAI))
    _router_defaults(body, ROUTER_OPENAI)
    _greedy(body, "temperature")
    _common_openai(body)
    if _bool(body, "echo"):
        raise BadRequest("'echo' is not supported: expected false or absent", "echo")
    if body.get("logprobs") is not None:
        raise BadRequest("'logprobs' is not supported: expected null or absent", "logprobs")
    if "prompt" not in body:
        raise BadRequest("missing field 'prompt' (text or a list of token ids)", "prompt")
    usage, continuous = _stream_options(body)
    return GenRequest("completions", _prompt(body["prompt"], "prompt"), _int(body, "max_tokens", 16, 1),
                      stream=_bool(body, "stream"), include_usage=usage, continuous_usage=continuous,
                      model=_model(body))


def parse_chat(body: dict[str, Any]) -> GenRequest:
    _known(body, CHAT_FIELDS | set(ROUTER_OPENAI))
    _router_defaults(body, ROUTER_OPENAI)
    _greedy(body, "temperature")
    _common_openai(body)
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"'messages' must be a non-empty list of {{role, content}} objects, got {_kind(messages)}",
                         "messages")
    for i, m in enumerate(messages):
        _message(m, f"messages[{i}]")
    usage, continuous = _stream_options(body)
    return GenRequest("chat", None, _int(body, field, 128, 1), stream=_bool(body, "stream"),
                      include_usage=usage, continuous_usage=continuous, model=_model(body), messages=messages,
                      prompt_field="messages", max_field=field)


def _message(m: Any, where: str) -> None:
    """One chat message: {role (one of ROLES), content (text), name (optional text)}."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise BadRequest(f"'{where}' must be an object with string 'role' and 'content'", where)
    _known(m, MESSAGE_FIELDS, f"{where}.")
    if m["role"] not in ROLES:
        raise BadRequest(f"'{where}.role' must be one of {', '.join(ROLES)}, got {_short(m['role'])}", f"{where}.role")
    _encodable(m["content"], f"{where}.content")
    if "name" in m:
        if not isinstance(m["name"], str):
            raise BadRequest(f"'{where}.name' must be a string, got {_kind(m['name'])}", f"{where}.name")
        _encodable(m["name"], f"{where}.name")


def parse_generate(body: dict[str, Any]) -> GenRequest:
    _known(body, GENERATE_FIELDS | set(ROUTER_GENERATE))
    _router_defaults(body, ROUTER_GENERATE)
    sp = body.get("sampling_params", {})
    if not isinstance(sp, dict):
        raise BadRequest(f"'sampling_params' must be an object, got {_kind(sp)}", "sampling_params")
    _known(sp, SAMPLING_FIELDS, "sampling_params.")
    _greedy(sp, "temperature", "sampling_params.")
    _top_p(sp, "sampling_params.")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise BadRequest("give exactly one of 'text' or 'input_ids'" + (", not both" if has_text else ""),
                         "input_ids")
    if _bool(body, "return_logprob"):
        raise BadRequest("'return_logprob' is not supported: expected false or absent", "return_logprob")
    skip = _bool(sp, "skip_special_tokens", "sampling_params.", default=True)
    field = "text" if has_text else "input_ids"
    if has_text and not isinstance(body["text"], str):
        raise BadRequest(f"'text' must be a string, got {_kind(body['text'])}", "text")
    prompt = _encodable(body["text"], "text") if has_text else _token_ids(body["input_ids"], "input_ids")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"'rid' must be a string, got {_kind(rid)}", "rid")
    return GenRequest("generate", prompt, _int(sp, "max_new_tokens", 128, 1, "sampling_params."),
                      stream=_bool(body, "stream"), ignore_eos=_bool(sp, "ignore_eos", "sampling_params."),
                      skip_special_tokens=skip, rid=rid, prompt_field=field,
                      max_field="sampling_params.max_new_tokens")


# -- fields ----------------------------------------------------------------------------------------
def _known(body: dict, fields: set[str], prefix: str = "") -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"unknown field {prefix}{unknown[0]!s}; expected some of {', '.join(sorted(fields))}",
                         prefix + unknown[0])


def _router_defaults(body: dict, defaults: dict[str, Any]) -> None:
    """SGLang's fields at their default value (or null) pass; any other value asks for what cpkv does not do."""
    for name, default in defaults.items():
        v = body.get(name)
        if v is not None and (type(v) is not type(default) or v != default):
            raise BadRequest(f"'{name}' is not supported: expected {json.dumps(default)}, null or absent, got "
                             f"{_short(v)}", name)


def _greedy(body: dict, name: str, prefix: str = "") -> None:
    t = body.get(name)
    if t is None:
        return
    _number(t, prefix + name)
    if t != 0:
        raise BadRequest(f"'{prefix}{name}' must be 0: this server decodes greedily (no sampling), got {t}",
                         prefix + name)


def _top_p(body: dict, prefix: str = "") -> None:
    p = body.get("top_p")
    if p is None:
        return
    _number(p, prefix + "top_p")
    if not 0 < p <= 1:
        raise BadRequest(f"'{prefix}top_p' must be a number in (0, 1], got {json.dumps(p)}", prefix + "top_p")


def _common_openai(body: dict) -> None:
    _top_p(body)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise BadRequest(f"'n' must be the integer 1 (one choice per request), got {_short(n)}", "n")
    if body.get("stop") not in (None, [], ""):
        raise BadRequest("'stop' is not supported: expected null or absent (generation ends at max_tokens or the "
                         "tokenizer's end-of-sequence token)", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer, got {_kind(seed)}", "seed")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"'user' must be a string, got {_kind(user)}", "user")


def _model(body: dict) -> str | None:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise BadRequest(f"'model' must be a string, got {_kind(m)}", "model")
    return m


def _stream_options(body: dict) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): usage after the last chunk, and in every chunk as well."""
    so = body.get("stream_options")
    if so is None:
        return False, False
    if not isinstance(so, dict):
        raise BadRequest(f"'stream_options' must be an object, got {_kind(so)}", "stream_options")
    _known(so, {"include_usage", "continuous_usage_stats"}, "stream_options.")
    usage = _bool(so, "include_usage", "stream_options.")
    continuous = _bool(so, "continuous_usage_stats", "stream_options.")
    if continuous and not usage:
        raise BadRequest("'stream_options.continuous_usage_stats' needs 'stream_options.include_usage': true",
                         "stream_options.continuous_usage_stats")
    return usage, continuous


def _prompt(value: Any, name: str) -> list[int] | str:
    if isinstance(value, str):
        if not value:
            raise BadRequest(f"'{name}' must not be empty", name)
        return _encodable(value, name)
    if isinstance(value, list) and value and all(isinstance(x, (list, str)) for x in value):
        raise BadRequest(f"'{name}' must be one prompt (a string or a list of token ids): batches are not "
                         "supported", name)
    return _token_ids(value, name)


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{name}' must be a non-empty list of token ids, got {_kind(value)}", name)
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX:
            raise BadRequest(f"'{name}'[{i}] must be a token id (an integer >= 0), got {_short(t)}", name)
    return value


def _int(body: dict, name: str, default: int, low: int, prefix: str = "") -> int:
    v = body.get(name)
    if v is None:
        return default
    if type(v) is not int or not low <= v <= INT32_MAX:
        raise BadRequest(f"'{prefix}{name}' must be an integer in {low}..{INT32_MAX}, got {_short(v)}", prefix + name)
    return v


def _bool(body: dict, name: str, prefix: str = "", default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{prefix}{name}' must be true or false, got {_kind(v)}", prefix + name)
    return v


def _number(v: Any, name: str) -> None:
    """A finite JSON number (not a boolean); a 400 naming ``name`` otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{name}' must be a number, got {_kind(v)}", name)
    if not math.isfinite(v):
        raise BadRequest(f"'{name}' must be a finite number, got {v}", name)


def _encodable(text: str, name: str) -> str:
    """``text`` when it encodes as UTF-8; a 400 naming ``name`` where it holds a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"'{name}' is not valid Unicode text: {exc.object[exc.start]!r} at character {exc.start} "
                         "is a lone surrogate (it has no UTF-8 encoding)", name) from None
    return text


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."
