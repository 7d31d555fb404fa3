"""Request bodies of the HTTP API, parsed and validated into one ``GenRequest``; no engine, no HTTP.

Every error is a ``BadRequest`` naming the field (OpenAI's ``param``) with what was expected and what came:

    POST /v1/completions        model, prompt (text or token ids), max_tokens (16), temperature (0 only),
                                top_p, n (1), stream, stream_options.include_usage, user, seed, stop (null),
                                echo (false), logprobs (null)
    POST /v1/chat/completions   model, messages, max_tokens / max_completion_tokens (128), temperature, top_p,
                                n, stream, stream_options, user, seed, stop (null)
    POST /generate              text or input_ids, sampling_params {max_new_tokens (128), temperature,
                                top_p, ignore_eos, skip_special_tokens}, stream, rid, return_logprob (false)

Greedy decoding only: ``temperature`` absent or 0 (any other value is a 400 naming it). Fields outside
these lists are a 400 (``unknown field``), so a typo never passes silently.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

INT32_MAX = (1 << 31) - 1


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
    ignore_eos: bool = False
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


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also bad UTF-8 and absurd numbers
        raise BadRequest(f"the body is not valid JSON ({str(exc).split(':')[0]})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {_kind(body)}")
    return body


def parse_completion(body: dict[str, Any]) -> GenRequest:
    _known(body, COMPLETION_FIELDS)
    _greedy(body, "temperature")
    _common_openai(body)
    if body.get("echo") not in (None, False):
        raise BadRequest("'echo' is not supported: expected false or absent", "echo")
    if body.get("logprobs") is not None:
        raise BadRequest("'logprobs' is not supported: expected null or absent", "logprobs")
    if "prompt" not in body:
        raise BadRequest("missing field 'prompt' (text or a list of token ids)", "prompt")
    return GenRequest("completions", _prompt(body["prompt"], "prompt"), _int(body, "max_tokens", 16, 1),
                      stream=_bool(body, "stream"), include_usage=_include_usage(body), model=_model(body))


def parse_chat(body: dict[str, Any]) -> GenRequest:
    _known(body, CHAT_FIELDS)
    _greedy(body, "temperature")
    _common_openai(body)
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"'messages' must be a non-empty list of {{role, content}} objects, got {_kind(messages)}",
                         "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest(f"'messages'[{i}] must be an object with string 'role' and 'content'", f"messages[{i}]")
    return GenRequest("chat", None, _int(body, field, 128, 1), stream=_bool(body, "stream"),
                      include_usage=_include_usage(body), model=_model(body), messages=messages,
                      prompt_field="messages", max_field=field)


def parse_generate(body: dict[str, Any]) -> GenRequest:
    _known(body, GENERATE_FIELDS)
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
    if body.get("return_logprob") not in (None, False):
        raise BadRequest("'return_logprob' is not supported: expected false or absent", "return_logprob")
    _bool(sp, "skip_special_tokens", "sampling_params.")
    field = "text" if has_text else "input_ids"
    if has_text and not isinstance(body["text"], str):
        raise BadRequest(f"'text' must be a string, got {_kind(body['text'])}", "text")
    prompt = body["text"] if has_text else _token_ids(body["input_ids"], "input_ids")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"'rid' must be a string, got {_kind(rid)}", "rid")
    return GenRequest("generate", prompt, _int(sp, "max_new_tokens", 128, 1, "sampling_params."),
                      stream=_bool(body, "stream"), ignore_eos=_bool(sp, "ignore_eos", "sampling_params."),
                      rid=rid, prompt_field=field, max_field="sampling_params.max_new_tokens")


# -- fields ----------------------------------------------------------------------------------------
def _known(body: dict, fields: set[str], prefix: str = "") -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"unknown field {prefix}{unknown[0]!s}; expected some of {', '.join(sorted(fields))}",
                         prefix + unknown[0])


def _greedy(body: dict, name: str, prefix: str = "") -> None:
    t = body.get(name)
    if t is None:
        return
    if not _is_number(t):
        raise BadRequest(f"'{prefix}{name}' must be a number, got {_kind(t)}", prefix + name)
    if t != 0:
        raise BadRequest(f"'{prefix}{name}' must be 0: this server decodes greedily (no sampling), got {t}",
                         prefix + name)


def _top_p(body: dict, prefix: str = "") -> None:
    p = body.get("top_p")
    if p is not None and (not _is_number(p) or not 0 < p <= 1):
        raise BadRequest(f"'{prefix}top_p' must be a number in (0, 1], got {json.dumps(p)}", prefix + "top_p")


def _common_openai(body: dict) -> None:
    _top_p(body)
    if body.get("n") not in (None, 1):
        raise BadRequest(f"'n' must be 1 (one choice per request), got {json.dumps(body.get('n'))}", "n")
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


def _include_usage(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("'stream_options' must be an object with 'include_usage'", "stream_options")
    return _bool(so, "include_usage", "stream_options.")


def _prompt(value: Any, name: str) -> list[int] | str:
    if isinstance(value, str):
        if not value:
            raise BadRequest(f"'{name}' must not be empty", name)
        return value
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
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= INT32_MAX:
        raise BadRequest(f"'{prefix}{name}' must be an integer >= {low}, got {_short(v)}", prefix + name)
    return v


def _bool(body: dict, name: str, prefix: str = "") -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{prefix}{name}' must be true or false, got {_kind(v)}", prefix + name)
    return v


def _is_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."
