"""What a choice's tokens become in an answer: its text with stop strings applied (held back while streaming where
the text might be the start of a stop string), and its log-probabilities in OpenAI's and SGLang's shapes.

    text = ChoiceText(tok, stop=("\\n\\n",), keep_stop=False, skip_special=True, stop_ids={eos})
    text.push(tokens, finish)   # after each token: True once a stop string ends the choice (text cut before it)
    text.visible(final)         # the text a stream may show now (stop-string prefixes and an incomplete UTF-8
                                # sequence at the end held back until the next token or the finish)

A choice that ends on a stop token (``stop_token_ids``, the model's EOS) loses that token's text unless
``keep_stop`` (vLLM's ``include_stop_str_in_output``, SGLang's ``no_stop_trim``); one that ends on a stop string
keeps the text before it (and the stop string with ``keep_stop``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from cpkv.serve.tokenizer import Tokenizer

TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]  # (log p(token), top (id, log p))


class ChoiceText:
    """One choice's text as its tokens arrive (module docstring)."""

    def __init__(self, tok: Tokenizer | None, stop: Sequence[str] = (), keep_stop: bool = False,
                 skip_special: bool = True, stop_ids: frozenset[int] = frozenset()) -> None:
        self.tok, self.stop, self.keep_stop = tok, tuple(stop), keep_stop
        self.skip, self.stop_ids = skip_special, stop_ids
        self.text, self.stopped = "", False

    def push(self, tokens: Sequence[int], finish: str | None = None) -> bool:
        """Decode ``tokens`` (all so far); True when the text now holds a stop string (the choice ends there)."""
        if self.tok is None or self.stopped:
            return self.stopped
        ids = list(tokens)
        if ids and ids[-1] in self.stop_ids and not self.keep_stop:  # the engine ends on it: never shown
            ids = ids[:-1]
        text = self.tok.decode(ids, self.skip)
        cut = self._stop_at(text)
        self.text, self.stopped = (text, False) if cut is None else (text[:cut], True)
        return self.stopped

    def _stop_at(self, text: str) -> int | None:
        """Where the text ends at the earliest stop string (after it with ``keep_stop``), or None."""
        best = None
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, len(s))
        if best is None:
            return None
        return best[0] + (best[1] if self.keep_stop else 0)

    def visible(self, final: bool) -> str:
        """The text a stream may show now."""
        if final or self.stopped:
            return self.text
        t = self.text.rstrip("\ufffd")
        return t[:len(t) - self._held(t)]

    def _held(self, t: str) -> int:
        """Characters at the end of ``t`` that could begin a stop string."""
        for k in range(min(len(t), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(t[-k:]) for s in self.stop):
                return k
        return 0


def generation_eos_ids(model: str) -> frozenset[int]:
    """The ``eos_token_id`` (an id or a list) of checkpoint directory ``model``'s ``generation_config.json``; empty
    for a preset or a checkpoint without one."""
    path = Path(model) / "generation_config.json"
    if not path.is_file():
        return frozenset()
    eos = json.loads(path.read_text()).get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def token_text(tok: Tokenizer | None, tid: int) -> str:
    """A token's own text (special tokens included); ``token_id:N`` without a tokenizer (vLLM's spelling)."""
    return tok.decode([tid], False) if tok is not None else f"token_id:{tid}"


def completion_logprobs(tok: Tokenizer | None, tokens: Sequence[int], lps: Sequence[TokenLogprob],
                        offset: int = 0) -> dict[str, Any]:
    """OpenAI completions' ``logprobs``: tokens, token_logprobs, top_logprobs ({text: log p}), text_offset."""
    texts = [token_text(tok, t) for t in tokens]
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{token_text(tok, i): v for i, v in top} for _, top in lps], "text_offset": offsets}


def chat_logprobs(tok: Tokenizer | None, tokens: Sequence[int], lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def entry(tid: int, lp: float) -> dict[str, Any]:
        text = token_text(tok, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, (lp, top) in zip(tokens, lps)]}


def generate_logprobs(tok: Tokenizer | None, tokens: Sequence[int], lps: Sequence[TokenLogprob],
                      with_text: bool) -> dict[str, Any]:
    """SGLang's meta_info fields: output_token_logprobs [[log p, id, text|None]], output_top_logprobs per token."""
    def entry(tid: int, lp: float) -> list:
        return [lp, tid, token_text(tok, tid) if with_text and tok is not None else None]
    return {"input_token_logprobs": [], "input_top_logprobs": [],
            "output_token_logprobs": [entry(t, lp) for t, (lp, _) in zip(tokens, lps)],
            "output_top_logprobs": [[entry(i, v) for i, v in top] for _, top in lps]}
