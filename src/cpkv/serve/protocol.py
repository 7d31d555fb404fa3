"""Request bodies of the HTTP API, parsed and validated into one ``GenRequest``; no engine, no HTTP.

Every error is a ``BadRequest`` naming the field (OpenAI's ``param``) with what was expected and what came:

    POST /v1/completions        model, prompt (text, token ids, or a list of either), max_tokens (16) /
                                max_completion_tokens, n (1), echo, logprobs (top N per token), stream,
                                stream_options {include_usage, continuous_usage_stats}, user, SAMPLING, STOPS
    POST /v1/chat/completions   model, messages [{role, content (text or [{type: text, text}]), name}], max_tokens /
                                max_completion_tokens (as much as the context leaves), n, logprobs (bool),
                                top_logprobs, stream, stream_options, user, SAMPLING, STOPS
    POST /generate              text or input_ids, sampling_params {max_new_tokens (128), n (1), SAMPLING, STOPS},
                                stream, rid, return_logprob, top_logprobs_num, return_text_in_logprobs
    SAMPLING  temperature (0: greedy), top_p, top_k, min_p, seed (``sampling_seed`` in sampling_params),
              presence_penalty, frequency_penalty, repetition_penalty  (``cpkv.engine.sampling``)
    STOPS     stop (a string or a list), stop_token_ids, ignore_eos, skip_special_tokens,
              include_stop_str_in_output / no_stop_trim

Field policy: every other field SGLang's or vLLM's servers accept is in a ``*_DEFAULTS`` table with the values
that ask nothing of cpkv (its defaults): at one of them it is accepted and does nothing, at any other value it is a
400 naming it ("not supported by this server"). Fields neither server knows are a 400 (``unknown field``), so a
typo never passes silently. Types are strict: a boolean is ``true`` / ``false`` (not 0 or 1), an integer is an
integer (not 1.0), a number is finite. Text must be encodable as UTF-8 (a lone surrogate such as ``"\ud800"`` is
a 400 naming its field); a chat role is one of ``ROLES``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from cpkv.engine.protocol import MAX_LOGPROBS, SamplingParams

INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
ROLES = ("system", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "name"}
MAX_N = 64          # choices per request
MAX_STOPS = 64      # stop strings per request


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
    """One request as the front end hands it on: ``prompts`` (token ids or text; one except for a completions
    list; none for chat, whose ``messages`` the template renders), each generated ``n`` times."""

    kind: str                       # "completions" | "chat" | "generate"
    prompts: list[list[int] | str]
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
    max_given: bool = True          # False: the default, capped to what the context leaves
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None         # None: the front end draws one per request
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    keep_stop: bool = False         # the matched stop string (or stop token's text) stays in the text
    echo: bool = False
    text_in_logprobs: bool = False  # /generate: token texts beside the ids in the log-probabilities

    @property
    def prompt(self) -> list[int] | str | None:
        return self.prompts[0] if self.prompts else None


# fields the engines accept that ask nothing of cpkv at these values (the first is each one's default)
OPENAI_DEFAULTS: dict[str, tuple] = {
    "best_of": (None, 1), "logit_bias": (None, {}), "use_beam_search": (None, False),
    "length_penalty": (None, 1.0, 1), "min_tokens": (None, 0), "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "prompt_logprobs": (None,), "response_format": (None, {"type": "text"}), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,), "structured_outputs": (None,),
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "priority": (None, 0),
    "logits_processors": (None,), "return_tokens_as_token_ids": (None, False), "cache_salt": (None,),
    "kv_transfer_params": (None,), "vllm_xargs": (None,), "return_hidden_states": (None, False),
    "lora_path": (None,), "session_params": (None,), "data_parallel_rank": (None,), "logprob_start_len": (None, -1),
    "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,), "custom_params": (None,),
    "request_id": (None,), "rid": (None,), "metadata": (None, {}), "store": (None, False),
    "service_tier": (None, "auto", "default"),
}
COMPLETION_DEFAULTS = {**OPENAI_DEFAULTS, "suffix": (None, ""), "add_special_tokens": (None, True)}
CHAT_DEFAULTS = {
    **OPENAI_DEFAULTS, "add_special_tokens": (None, False), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True), "functions": (None, []), "function_call": (None, "none", "auto"),
    "continue_final_message": (None, False), "add_generation_prompt": (None, True), "echo": (None, False),
    "separate_reasoning": (None, True, False), "stream_reasoning": (None, True, False),  # no reasoning parser here
    "chat_template_kwargs": (None, {}), "chat_template": (None,), "documents": (None,), "reasoning_effort": (None,),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "web_search_options": (None,),
    "mm_processor_kwargs": (None,),
}
GENERATE_DEFAULTS: dict[str, tuple] = {
    "input_embeds": (None,), "image_data": (None,), "audio_data": (None,), "video_data": (None,),
    "modalities": (None,), "session_params": (None,), "lora_path": (None,), "lora_id": (None,),
    "custom_logit_processor": (None,), "return_hidden_states": (None, False), "log_metrics": (None, True, False),
    "no_logs": (None, False, True), "background": (None, False), "return_bytes": (None, False),
    "return_entropy": (None, False), "token_ids_logprob": (None,), "logprob_start_len": (None, -1),
    "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,), "data_parallel_rank": (None,),
    "priority": (None, 0),
}
SAMPLING_DEFAULTS: dict[str, tuple] = {
    "min_new_tokens": (None, 0), "spaces_between_special_tokens": (None, True), "json_schema": (None,),
    "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "custom_params": (None,),
    "stream_interval": (None,), "logit_bias": (None, {}), "n": (None, 1),
}

SAMPLING_NAMES = {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"}
STOP_NAMES = {"stop", "stop_token_ids", "ignore_eos", "skip_special_tokens"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
                     "user", "seed", "echo", "logprobs", "include_stop_str_in_output", "no_stop_trim",
                     *SAMPLING_NAMES, *STOP_NAMES, *COMPLETION_DEFAULTS}
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "user",
               "seed", "logprobs", "top_logprobs", "include_stop_str_in_output", "no_stop_trim", *SAMPLING_NAMES,
               *STOP_NAMES, *CHAT_DEFAULTS}
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "rid", "model", "return_logprob", "top_logprobs_num",
                   "return_text_in_logprobs", *GENERATE_DEFAULTS}
SAMPLING_FIELDS = {"max_new_tokens", "sampling_seed", "seed", "no_stop_trim", *SAMPLING_NAMES, *STOP_NAMES,
                   *SAMPLING_DEFAULTS}


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
    _defaults(body, COMPLETION_DEFAULTS)
    _user(body)
    if "prompt" not in body:
        raise BadRequest("missing field 'prompt' (text or a list of token ids)", "prompt")
    logprobs = _int(body, "logprobs", None, 0, hi=MAX_LOGPROBS)
    echo = _bool(body, "echo")
    if echo and logprobs is not None:
        raise BadRequest("'echo' with 'logprobs' asks for the prompt's log-probabilities, which this server does "
                         "not compute: drop one of them", "echo")
    usage, continuous = _stream_options(body)
    field_ = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    g = GenRequest("completions", _prompts(body["prompt"], "prompt"), _int(body, field_, 16, 1),
                   stream=_bool(body, "stream"), include_usage=usage, continuous_usage=continuous,
                   model=_model(body), max_field=field_, max_given=body.get(field_) is not None, echo=echo)
    return _openai_sampling(body, g, logprobs)


def parse_chat(body: dict[str, Any]) -> GenRequest:
    _known(body, CHAT_FIELDS)
    _defaults(body, CHAT_DEFAULTS)
    _user(body)
    field_ = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"'messages' must be a non-empty list of {{role, content}} objects, got {_kind(messages)}",
                         "messages")
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    top = _int(body, "top_logprobs", None, 0, hi=MAX_LOGPROBS)
    want = _bool(body, "logprobs")
    if top is not None and not want:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    usage, continuous = _stream_options(body)
    max_given = body.get(field_) is not None
    g = GenRequest("chat", [], _int(body, field_, 128, 1), stream=_bool(body, "stream"), include_usage=usage,
                   continuous_usage=continuous, model=_model(body), messages=messages, prompt_field="messages",
                   max_field=field_, max_given=max_given)
    return _openai_sampling(body, g, (top or 0) if want else None)


def _openai_sampling(body: dict, g: GenRequest, logprobs: int | None) -> GenRequest:
    """The sampling, stop and choice fields shared by completions and chat, into ``g``."""
    g.sampling = _sampling(body, logprobs)
    g.seed = _seed(body, "seed")
    g.n = _int(body, "n", 1, 1, hi=MAX_N)
    _stops(body, g)
    g.keep_stop = _bool(body, "include_stop_str_in_output") or _bool(body, "no_stop_trim")
    return g


def _sampling(body: dict, logprobs: int | None, prefix: str = "") -> SamplingParams:
    """temperature >= 0, top_p in (0, 1], top_k -1 / 0 (off) or >= 1, min_p in [0, 1], presence and frequency
    penalties in [-2, 2], repetition_penalty > 0."""
    return SamplingParams(
        temperature=_float(body, "temperature", 0.0, 0.0, math.inf, prefix),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, prefix, low_open=True),
        top_k=_top_k(body, prefix),
        min_p=_float(body, "min_p", 0.0, 0.0, 1.0, prefix),
        presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0, prefix),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0, prefix),
        repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.0, math.inf, prefix, low_open=True),
        logprobs=logprobs)


def _stops(body: dict, g: GenRequest, prefix: str = "") -> None:
    """stop (a string or a list of non-empty strings), stop_token_ids, ignore_eos, skip_special_tokens."""
    stop = body.get("stop")
    name = prefix + "stop"
    if isinstance(stop, str):
        stop = [stop] if stop else []
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOPS
                             or not all(isinstance(s, str) and s for s in stop)):
        raise BadRequest(f"'{name}' must be a string or a list of at most {MAX_STOPS} non-empty strings, got "
                         f"{_short(stop)}", name)
    g.stop = tuple(_encodable(s, name) for s in stop or ())
    ids = body.get("stop_token_ids")
    g.stop_token_ids = frozenset(_token_ids(ids, prefix + "stop_token_ids", empty=True)) if ids is not None \
        else frozenset()
    g.ignore_eos = _bool(body, "ignore_eos", prefix)
    g.skip_special_tokens = _bool(body, "skip_special_tokens", prefix, default=True)


def _message(m: Any, where: str) -> dict[str, Any]:
    """One chat message: {role (one of ROLES), content (text, or a list of {type: "text", text} parts, joined with
    newlines as vLLM does), name (optional text)} -> the message with its content as text."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
        raise BadRequest(f"'{where}' must be an object with string 'role' and 'content'", where)
    _known(m, MESSAGE_FIELDS, f"{where}.")
    if m["role"] not in ROLES:
        raise BadRequest(f"'{where}.role' must be one of {', '.join(ROLES)}, got {_short(m['role'])}", f"{where}.role")
    content = _content(m["content"], f"{where}.content")
    if "name" in m:
        if not isinstance(m["name"], str):
            raise BadRequest(f"'{where}.name' must be a string, got {_kind(m['name'])}", f"{where}.name")
        _encodable(m["name"], f"{where}.name")
    return {**m, "content": content}


def _content(c: Any, where: str) -> str:
    if isinstance(c, str):
        return _encodable(c, where)
    if not isinstance(c, list):
        raise BadRequest(f"'{where}' must be a string or a list of text parts, got {_kind(c)}", where)
    texts = []
    for j, part in enumerate(c):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise BadRequest(f"'{at}' must be {{\"type\": \"text\", \"text\": string}}" +
                             (f": parts of type {_short(kind)} are not supported" if kind not in (None, "text")
                              else ""), at)
        _known(part, {"type", "text"}, f"{at}.")
        texts.append(_encodable(part["text"], f"{at}.text"))
    return "\n".join(texts)


def parse_generate(body: dict[str, Any]) -> GenRequest:
    _known(body, GENERATE_FIELDS)
    _defaults(body, GENERATE_DEFAULTS)
    sp = body.get("sampling_params", {})
    if not isinstance(sp, dict):
        raise BadRequest(f"'sampling_params' must be an object, got {_kind(sp)}", "sampling_params")
    _known(sp, SAMPLING_FIELDS, "sampling_params.")
    _defaults(sp, SAMPLING_DEFAULTS, "sampling_params.")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise BadRequest("give exactly one of 'text' or 'input_ids'" + (", not both" if has_text else ""),
                         "input_ids")
    field_ = "text" if has_text else "input_ids"
    if has_text and not isinstance(body["text"], str):
        raise BadRequest(f"'text' must be a string, got {_kind(body['text'])}", "text")
    prompt = _encodable(body["text"], "text") if has_text else _token_ids(body["input_ids"], "input_ids")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"'rid' must be a string, got {_kind(rid)}", "rid")
    top = _int(body, "top_logprobs_num", None, 0, hi=MAX_LOGPROBS)
    logprobs = (top or 0) if _bool(body, "return_logprob") else None
    g = GenRequest("generate", [prompt], _int(sp, "max_new_tokens", 128, 1, "sampling_params."),
                   stream=_bool(body, "stream"), rid=rid, model=_model(body), prompt_field=field_,
                   max_field="sampling_params.max_new_tokens", text_in_logprobs=_bool(body, "return_text_in_logprobs"))
    g.sampling = _sampling(sp, logprobs, "sampling_params.")
    g.seed = _seed(sp, "sampling_seed", "sampling_params.") if "sampling_seed" in sp else \
        _seed(sp, "seed", "sampling_params.")
    _stops(sp, g, "sampling_params.")
    g.keep_stop = _bool(sp, "no_stop_trim", "sampling_params.")
    return g


# -- fields ----------------------------------------------------------------------------------------
def _known(body: dict, fields: set[str], prefix: str = "") -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"unknown field {prefix}{unknown[0]!s}; expected some of {', '.join(sorted(fields))}",
                         prefix + unknown[0])


def _defaults(body: dict, table: dict[str, tuple], prefix: str = "") -> None:
    """Each field of ``table`` present in ``body`` at one of its listed values (which ask nothing of cpkv);
    else a 400 naming it."""
    for name, ok in table.items():
        if name in body and not any(_same(body[name], v) for v in ok):
            shown = " or ".join(json.dumps(v) for v in ok)
            raise BadRequest(f"'{prefix}{name}' = {_short(body[name])} is not supported by this server (accepted "
                             f"only at {shown})", prefix + name)


def _same(a: Any, b: Any) -> bool:
    """JSON equality with strict types (true is not 1, 1 is 1.0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _user(body: dict) -> None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"'user' must be a string, got {_kind(user)}", "user")


def _seed(body: dict, name: str, prefix: str = "") -> int | None:
    seed = body.get(name)
    if seed is None:
        return None
    if type(seed) is not int or not -INT64_MAX - 1 <= seed <= (1 << 64) - 1:
        raise BadRequest(f"'{prefix}{name}' must be an integer, got {_short(seed)}", prefix + name)
    return seed


def _top_k(body: dict, prefix: str = "") -> int:
    k = body.get("top_k")
    if k is None:
        return -1
    if type(k) is not int or not -1 <= k <= INT32_MAX:
        raise BadRequest(f"'{prefix}top_k' must be an integer: -1 or 0 (all tokens) or >= 1, got {_short(k)}",
                         prefix + "top_k")
    return k


def _float(body: dict, name: str, default: float, low: float, high: float, prefix: str = "",
           low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    _number(v, prefix + name)
    if v < low or (low_open and v == low) or v > high:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high != math.inf else \
            f"{'>' if low_open else '>='} {low:g}"
        raise BadRequest(f"'{prefix}{name}' must be a number {'in ' if high != math.inf else ''}{span}, got "
                         f"{json.dumps(v)}", prefix + name)
    return float(v)


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


def _prompts(value: Any, name: str) -> list[list[int] | str]:
    """One prompt (text or token ids) or a non-empty list of them (a list of strings or of token-id lists)."""
    if isinstance(value, str):
        if not value:
            raise BadRequest(f"'{name}' must not be empty", name)
        return [_encodable(value, name)]
    if isinstance(value, list) and value and all(isinstance(x, (list, str)) for x in value):
        if len(value) > MAX_N:
            raise BadRequest(f"'{name}' holds {len(value)} prompts; at most {MAX_N}", name)
        return [_prompts(x, f"{name}[{i}]")[0] for i, x in enumerate(value)]
    return [_token_ids(value, name)]


def _token_ids(value: Any, name: str, empty: bool = False) -> list[int]:
    if not isinstance(value, list) or (not value and not empty):
        raise BadRequest(f"'{name}' must be a non-empty list of token ids, got {_kind(value)}", name)
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX:
            raise BadRequest(f"'{name}'[{i}] must be a token id (an integer >= 0), got {_short(t)}", name)
    return value


def _int(body: dict, name: str, default: int | None, low: int, prefix: str = "", hi: int = INT32_MAX) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if type(v) is not int or not low <= v <= hi:
        raise BadRequest(f"'{prefix}{name}' must be an integer in {low}..{hi}, got {_short(v)}", prefix + name)
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
