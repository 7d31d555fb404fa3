"""Request traces: the JSONL format, its validation, the built-in trace, token synthesis. No torch import.

One JSON object per line (docs/trace-format.md)::

    {"id": "s3.t0", "arrival": 12.5, "prompt_len": 40960}
    {"id": "s3.t1", "arrival": 20.1, "prompt_len": 42113, "parent": "s3.t0"}
    {"id": 7, "arrival": 20.1, "tokens": [1, 2, 3]}

``id`` (string or integer, unique), ``arrival`` (seconds, non-decreasing), and either ``tokens`` (the
prompt) or ``prompt_len`` with an optional ``parent`` (an earlier request whose whole prompt starts this
one). A synthetic prompt's tokens are drawn deterministically from its id, after its parent's tokens.

Reading is bounded whatever the file holds: at most ``MAX_TRACE_BYTES`` in all and ``MAX_LINE_BYTES`` per
line, and every field has a range: ids (and parents) integers within int64 or strings of at most
``MAX_ID_CHARS`` characters, arrivals in 0..``MAX_ARRIVAL_S`` seconds, token ids within int64, prompts of at
most ``MAX_PROMPT_LEN`` tokens. A file beyond a bound, a value out of its range, deeply nested JSON or a huge
number is a ``TraceError`` naming the file, the line and the field, never a MemoryError, a RecursionError or a
wait of centuries in ``cpkv bench serve``.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Iterable, Sequence

from cpkv.errors import TraceError
from cpkv.files import atomic_output, input_problem

FIELDS = ("id", "arrival", "tokens", "prompt_len", "parent")
DEFAULT_VOCAB = 512  # the smallest preset vocabulary: synthetic tokens are valid for every preset
MAX_TRACE_BYTES = 256 << 20  # a trace file (10,000 requests by prompt_len take about 1 MiB)
MAX_LINE_BYTES = 32 << 20    # one line (a 2M-token prompt given as token ids)
MAX_PROMPT_LEN = 1 << 24     # tokens of one prompt (far above any model's context)
MAX_ARRIVAL_S = 1e7          # seconds from the trace's start to an arrival (116 days; bench serve waits for each)
MAX_ID_CHARS = 1024          # characters of a string id (ids are printed in tables and errors)
INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class TraceRequest:
    """One trace line. Exactly one of ``tokens`` / (``prompt_len`` without tokens) defines the prompt."""

    id: Hashable
    arrival: float
    prompt_len: int
    tokens: tuple[int, ...] | None = None
    parent: Hashable | None = None
    line: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "arrival": self.arrival}
        if self.tokens is not None:
            out["tokens"] = list(self.tokens)
        else:
            out["prompt_len"] = self.prompt_len
        if self.parent is not None:
            out["parent"] = self.parent
        return out


# -- parsing ---------------------------------------------------------------------------------------
def load_trace(path: str | Path) -> list[TraceRequest]:
    """Parse and validate a JSONL trace; the first bad line raises TraceError naming it and why."""
    return parse_trace(read_lines(path), source=str(path))


def read_lines(path: str | Path) -> list[str]:
    """The file's lines, read within MAX_TRACE_BYTES and MAX_LINE_BYTES (TraceError beyond either). A path that
    is not a regular file (a FIFO, a device, a directory) is refused before it is opened (``cpkv.files``)."""
    problem = input_problem(path)
    if problem:
        raise TraceError(f"{path}: {problem}")
    lines: list[str] = []
    total = 0
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    return lines
                total += len(raw)
                n = len(lines) + 1
                if len(raw) > MAX_LINE_BYTES:
                    raise TraceError(f"{path}:{n}: line longer than {MAX_LINE_BYTES >> 20} MiB (the most a trace "
                                     "line may hold)")
                if total > MAX_TRACE_BYTES:
                    raise TraceError(f"{path}: larger than {MAX_TRACE_BYTES >> 20} MiB (the most a trace may hold)")
                lines.append(_decode(raw, path, n, total - len(raw)))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror})") from None


def _decode(raw: bytes, path: str | Path, n: int, offset: int) -> str:
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}:{n}: expected a UTF-8 JSONL text file, got undecodable bytes at offset "
                         f"{offset + exc.start}") from None


def parse_trace(lines: Sequence[str], source: str = "<trace>") -> list[TraceRequest]:
    """Validate ``lines`` (blank lines allowed) into requests in file order."""
    out: list[TraceRequest] = []
    seen: dict[Hashable, TraceRequest] = {}
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            req = _parse_line(raw, n, seen, out[-1].arrival if out else 0.0)
        except _LineError as exc:
            raise TraceError(f"{source}:{n}: {_explain(exc, lines, n)}") from None
        seen[_key(req.id)] = req
        out.append(req)
    if not out:
        raise TraceError(f"{source}: the trace holds no requests")
    return out


class _LineError(Exception):
    def __init__(self, msg: str, parent: Hashable | None = None) -> None:
        super().__init__(msg)
        self.parent = parent


def _key(rid: Hashable) -> tuple[str, Hashable]:
    return (type(rid).__name__, rid)  # 1 and "1" are different ids


def _parse_line(raw: str, n: int, seen: dict, last_arrival: float) -> TraceRequest:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _LineError(f"bad JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # an integer of thousands of digits
        raise _LineError(f"bad JSON ({str(exc).split(';')[0]})") from None
    except RecursionError:
        raise _LineError("bad JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise _LineError(f"unknown field(s) {', '.join(map(repr, unknown))}; expected {', '.join(FIELDS)}")
    rid = _parse_id(obj, seen)
    arrival = _parse_arrival(obj, last_arrival)
    tokens, prompt_len = _parse_prompt(obj)
    parent = _parse_parent(obj, rid, prompt_len, seen)
    return TraceRequest(rid, arrival, prompt_len, tokens, parent, n)


def _parse_id(obj: dict, seen: dict) -> Hashable:
    if "id" not in obj:
        raise _LineError("missing field 'id'")
    rid = _check_id(obj["id"], "id")
    if _key(rid) in seen:
        raise _LineError(f"duplicate id {_name(rid)} (first on line {seen[_key(rid)].line})")
    return rid


def _parse_arrival(obj: dict, last: float) -> float:
    if "arrival" not in obj:
        raise _LineError("missing field 'arrival'")
    t = obj["arrival"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= MAX_ARRIVAL_S:
        raise _LineError(f"'arrival' must be a number of seconds in 0..{MAX_ARRIVAL_S:.0f} (about 116 days), "
                         f"got {_short(t)}")
    if t < last:
        raise _LineError(f"arrival {t} is earlier than the previous request's {last} (arrivals must not decrease)")
    return float(t)


def _parse_prompt(obj: dict) -> tuple[tuple[int, ...] | None, int]:
    has_t, has_n = "tokens" in obj, "prompt_len" in obj
    if has_t == has_n:
        raise _LineError("give exactly one of 'tokens' (the prompt) or 'prompt_len'"
                         + (", not both" if has_t else "; neither is present"))
    if has_n:
        n = obj["prompt_len"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PROMPT_LEN:
            raise _LineError(f"'prompt_len' must be an integer in 1..{MAX_PROMPT_LEN}, got {_short(n)}")
        return None, n
    toks = obj["tokens"]
    if not isinstance(toks, list) or not toks:
        raise _LineError("'tokens' must be a non-empty list of integers")
    if len(toks) > MAX_PROMPT_LEN:
        raise _LineError(f"'tokens' must hold at most {MAX_PROMPT_LEN} tokens, got {len(toks)}")
    for i, t in enumerate(toks):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX:
            raise _LineError(f"'tokens'[{i}] must be an integer in 0..2^63-1, got {_short(t)}")
    return tuple(toks), len(toks)


def _parse_parent(obj: dict, rid: Hashable, prompt_len: int, seen: dict) -> Hashable | None:
    if "parent" not in obj or obj["parent"] is None:
        return None
    parent = obj["parent"]
    if "tokens" in obj:
        raise _LineError("'parent' goes with 'prompt_len' only: a prompt given as 'tokens' shares its prefix "
                         "through the tokens themselves")
    _check_id(parent, "parent")
    if _key(parent) == _key(rid):
        raise _LineError(f"request {_name(rid)} names itself as its parent")
    if _key(parent) not in seen:
        raise _LineError(f"unknown parent {_name(parent)}", parent)
    plen = seen[_key(parent)].prompt_len
    if prompt_len < plen:
        raise _LineError(f"prompt_len {prompt_len} is shorter than its parent {_name(parent)}'s {plen} "
                         "(a parent's whole prompt must start this one)")
    return parent


def _check_id(value: Any, field: str) -> Hashable:
    """An id (or a parent's): an integer within int64 or a string of at most MAX_ID_CHARS characters."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or \
            (isinstance(value, int) and abs(value) > INT64_MAX):
        raise _LineError(f"'{field}' must be a string or an integer within int64, got {_short(value)}")
    if isinstance(value, str) and len(value) > MAX_ID_CHARS:
        raise _LineError(f"'{field}' must be a string of at most {MAX_ID_CHARS} characters, got one of "
                         f"{len(value)}")
    return value


def _short(value: Any) -> str:
    """A bad value as JSON, cut short (a line may hold megabytes)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _name(rid: Hashable) -> str:
    """An id as in a message: its repr, cut short."""
    text = repr(rid)
    return text if len(text) <= 60 else text[:57] + "..."


def check_vocab(requests: Sequence[TraceRequest], vocab_size: int, source: str, model: str) -> None:
    """Raise TraceError naming the first listed token id outside [0, vocab_size) (line and position)."""
    for r in requests:
        if r.tokens is None:
            continue
        top = max(r.tokens)
        if top >= vocab_size:
            i = r.tokens.index(top)
            raise TraceError(f"{source}:{r.line}: 'tokens'[{i}] = {top} is outside the vocabulary of model {model} "
                             f"(token ids 0..{vocab_size - 1})")


def _explain(exc: _LineError, lines: Sequence[str], n: int) -> str:
    """An unknown parent defined on a later line is named as such."""
    if exc.parent is None:
        return str(exc)
    for m in range(n, len(lines)):
        try:
            obj = json.loads(lines[m])
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and "id" in obj and not isinstance(obj["id"], (list, dict)) \
                and _key(obj["id"]) == _key(exc.parent):
            return f"parent {_name(exc.parent)} is defined later, on line {m + 1} (a parent must come first)"
    return f"{exc} (no earlier line has this id)"


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    """Write the JSONL trace; the file appears at ``path`` only once it is complete."""
    with atomic_output(path) as f:
        for r in requests:
            f.write(json.dumps(r.to_json()) + "\n")


# -- tokens ----------------------------------------------------------------------------------------
def synth_tokens(rid: Hashable, n: int, vocab_size: int = DEFAULT_VOCAB) -> list[int]:
    """``n`` token ids in [0, vocab_size), a deterministic function of (id, n, vocab_size)."""
    if n <= 0:
        return []
    seed = int.from_bytes(hashlib.sha256(repr(_key(rid)).encode()).digest()[:8], "little")
    raw = random.Random(seed).randbytes(4 * n)
    return [x % vocab_size for x in struct.unpack(f"<{n}I", raw)]


def materialize_tokens(requests: Sequence[TraceRequest], vocab_size: int = DEFAULT_VOCAB) -> dict[Hashable, list[int]]:
    """Token ids of every request: its own ``tokens``, or its parent's tokens + synthetic ones from its id."""
    out: dict[Hashable, list[int]] = {}
    for r in requests:
        if r.tokens is not None:
            out[r.id] = list(r.tokens)
            continue
        base = out[r.parent] if r.parent is not None else []
        out[r.id] = base + synth_tokens(r.id, r.prompt_len - len(base), vocab_size)
    return out


class PageKeys:
    """One key per full page for the replay's prefix cache (page_size 1, key unit = page size).

    Two requests get equal keys for a page exactly when ``materialize_tokens`` gives them equal tokens
    for it (up to the astronomically unlikely collision of random pages). A request's keys are kept
    only while a later request still names it as parent.
    """

    def __init__(self, requests: Sequence[TraceRequest], page_size: int) -> None:
        self.page_size = page_size
        self._pending: dict[Hashable, int] = {}
        for r in requests:
            if r.parent is not None:
                self._pending[r.parent] = self._pending.get(r.parent, 0) + 1
        self._kept: dict[Hashable, tuple[int, ...]] = {}
        self._intern: dict[tuple[int, ...], int] = {}
        self._next = 1

    def __call__(self, r: TraceRequest) -> tuple[int, ...]:
        P = self.page_size
        if r.tokens is not None:
            keys = tuple(self._interned(r.tokens[i:i + P]) for i in range(0, r.prompt_len - P + 1, P))
        else:
            base = self._parent_keys(r) if r.parent is not None else ()
            extra = r.prompt_len // P - len(base)
            keys = base + tuple(range(self._next, self._next + extra))
            self._next += extra
        if self._pending.get(r.id):
            self._kept[r.id] = keys
        return keys

    def _parent_keys(self, r: TraceRequest) -> tuple[int, ...]:
        keys = self._kept[r.parent]
        self._pending[r.parent] -= 1
        if self._pending[r.parent] == 0:
            del self._kept[r.parent]
        return keys

    def _interned(self, page: tuple[int, ...]) -> int:
        key = self._intern.get(page)
        if key is None:
            key = self._intern[page] = self._next
            self._next += 1
        return key


# -- the built-in trace ----------------------------------------------------------------------------
@dataclass(frozen=True)
class BuiltinShape:
    """Parameters of the built-in multi-turn long-context trace (token lengths before ``scale``).

    Tuned to a long multi-turn workload: prompts of tens of thousands of tokens, most of each prompt the
    previous turn's (the hit ratios it gives are in BENCHMARKS.md).
    """

    rate: float = 4.0                 # requests per second, on average
    fresh_share: float = 0.06         # share of sessions that are one fresh long prompt
    fresh_len: tuple[int, int] = (16384, 98304)
    root_len: tuple[int, int] = (12288, 65536)   # a conversation's first prompt (long shared history)
    turn_len: tuple[int, int] = (256, 3072)      # new tokens per turn (previous answer + new message)
    mean_turns: float = 16.0
    think_s: tuple[float, float] = (2.0, 12.0)   # gap between turns: min + exponential mean
    branch_p: float = 0.05            # a turn re-branches from the turn before its parent
    max_len: int = 196608


# The serving benchmark's trace (``cpkv bench serve``): the built-in workload's shape with conversations of
# 16K-128K tokens: a 16K-96K first prompt (every first prompt needs chunked prefill at chunk sizes <= 16K),
# short cache-hit continuations that resend the history, a few fresh 16K-128K prompts, nothing over 128K.
SERVE_SHAPE = BuiltinShape(rate=4.0, fresh_share=0.06, fresh_len=(16384, 131072), root_len=(16384, 98304),
                           turn_len=(256, 3072), mean_turns=16.0, think_s=(2.0, 12.0), branch_p=0.05,
                           max_len=131072)


def builtin_trace(n: int = 2000, seed: int = 0, scale: float = 1.0,
                  shape: BuiltinShape = BuiltinShape()) -> list[TraceRequest]:
    """A deterministic multi-turn long-context trace of ``n`` requests (prefix-cache hit ratio ≈ 0.9).

    Sessions start as a Poisson process. Most are conversations: a long first prompt (history,
    documents, code) then short new turns that resend the whole history (``parent`` = the previous
    turn); a few are one fresh long prompt. ``scale`` multiplies every length.
    """
    if n < 1 or scale <= 0:
        raise TraceError(f"builtin trace: need n >= 1 and scale > 0, got n={n}, scale={scale}")
    rng = random.Random(seed)
    per_session = shape.fresh_share + (1 - shape.fresh_share) * shape.mean_turns
    session_rate = shape.rate / per_session
    events: list[tuple[float, int, int, int, int]] = []  # (arrival, session, turn, prompt_len, parent turn)
    start, s, horizon = 0.0, 0, math.inf
    while start <= horizon:
        events.extend(_session(rng, s, start, scale, shape))
        s += 1
        start += rng.expovariate(session_rate)
        if horizon == math.inf and len(events) >= n:
            horizon = sorted(e[0] for e in events)[n - 1]
    events.sort()
    return [_event_request(e) for e in events[:n]]


def _session(rng: random.Random, s: int, t: float, scale: float, shape: BuiltinShape):
    cap = max(1, int(shape.max_len * scale))
    if rng.random() < shape.fresh_share:
        return [(round(t, 3), s, 0, min(cap, _loguniform(rng, shape.fresh_len, scale)), -1)]
    lens = [min(cap, _loguniform(rng, shape.root_len, scale))]
    out = [(round(t, 3), s, 0, lens[0], -1)]
    turns = 1 + int(rng.expovariate(1.0 / max(shape.mean_turns - 1, 1e-9)))
    for k in range(1, turns):
        parent = k - 2 if k >= 2 and rng.random() < shape.branch_p else k - 1
        new_len = lens[parent] + _loguniform(rng, shape.turn_len, scale)
        if new_len > cap:
            break
        t += shape.think_s[0] + rng.expovariate(1.0 / shape.think_s[1])
        lens.append(new_len)
        out.append((round(t, 3), s, k, new_len, parent))
    return out


def _loguniform(rng: random.Random, bounds: tuple[int, int], scale: float) -> int:
    lo, hi = bounds
    return max(1, int(math.exp(rng.uniform(math.log(lo), math.log(hi))) * scale))


def _event_request(e: tuple[float, int, int, int, int]) -> TraceRequest:
    t, s, k, n, parent = e
    return TraceRequest(f"s{s}.t{k}", t, n, None, f"s{s}.t{parent}" if parent >= 0 else None)


def ideal_hit_ratio(requests: Sequence[TraceRequest], page_size: int) -> float:
    """Cache-hit ratio (tokens) with an unbounded cache: each request hits its parent's full pages."""
    lens = {_key(r.id): r.prompt_len for r in requests}
    hit = sum(lens[_key(r.parent)] // page_size * page_size for r in requests if r.parent is not None)
    return hit / max(1, sum(lens.values()))
