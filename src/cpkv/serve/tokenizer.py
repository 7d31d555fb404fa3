"""The checkpoint's tokenizer and chat template, when it ships them (transformers' ``AutoTokenizer``, whose
``apply_chat_template`` renders the template with jinja); the tiny preset ships its own (``tiny_tokenizer``),
the other presets have none and take token ids only.

A chat's turns arrive whole every time: turn n of a conversation resends turns 1 .. n - 1. Tokenizing the whole
conversation again costs ~1 s of host time at 200K tokens (BENCHMARKS.md), far more than the cached turn's
prefill. So a chat is rendered to text and its token ids are built segment by segment: the tokenizer splits its
input at its added tokens (the template's role markers, ``<|user|>`` and the like) before it normalises,
pre-tokenises and merges anything, so each stretch of text between two added tokens is tokenized on its own, and
the ids of a stretch seen before (the earlier turns) come from a cache. The ids are the tokenizer's own, exactly:

- only where every added token is matched on the raw text and keeps its neighbours' characters (no lstrip,
  rstrip or single_word; normalized off, or no normalizer), else the whole text is tokenized each time;
- the text is split at the added tokens as the tokenizer splits it (leftmost, longest first);
- a stretch after an added token is tokenized behind that token (its ids then dropped), so that a pre-tokenizer
  that treats a text's first piece differently (a prefix space) sees it as it does in the whole text;
- the first chat a Tokenizer serves is also tokenized whole (its first ``CHECK_MESSAGES`` messages) and
  compared; a difference turns the cache off.

Text prompts (``/generate``, ``/v1/completions``; often a chat the client rendered itself) go through the same
cache (``text``). The cache holds at most ``CACHE_CHARS`` characters of text (least recently used out first).
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
CACHE_CHARS = 64 << 20  # characters of text whose ids the segment cache keeps (~ 20 M tokens)
CHECK_MESSAGES = 4      # the first chat's messages also tokenized whole, to check the segments' ids
CHECK_CHARS = 20000     # and the first text prompt's first characters


class Tokenizer:
    """encode / decode / chat over a transformers tokenizer. ``stop_ids``: its end-of-sequence ids."""

    def __init__(self, tok: Any, cache_chars: int = CACHE_CHARS) -> None:
        self.tok = tok
        eos = tok.eos_token_id
        self.stop_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._added, self._split = _added_split(tok)  # None: the cache cannot be exact for this tokenizer
        self._cache: OrderedDict[tuple[str | None, str], list[int]] = OrderedDict()
        self._cache_chars, self._cache_limit = 0, cache_chars
        self._lock = threading.Lock()  # chats are tokenized on worker threads
        self._checked = self._text_checked = False
        self.stats = {"segments": 0, "cached": 0, "chars_tokenized": 0}

    @property
    def segment_cache(self) -> bool:
        """Whether chats are tokenized segment by segment through the cache (module docstring)."""
        return self._split is not None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The template applied to ``messages`` with the generation prompt, as token ids (the stretches between
        added tokens seen before from the cache: module docstring)."""
        if self._split is None:
            return self._chat_whole(messages)
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = self.encode_segments(text)
        if not self._checked:  # once: a short chat's ids both ways (this tokenizer might split otherwise)
            self._checked = True
            head = messages[:CHECK_MESSAGES]
            if self.encode_segments(self.tok.apply_chat_template(head, add_generation_prompt=True, tokenize=False)) \
                    != self._chat_whole(head):
                self._split = None  # tokenize whole from now on
                return self._chat_whole(messages)
        return ids

    def text(self, prompt: str) -> list[int]:
        """``encode(prompt)`` through the segment cache: a client that renders the chat template itself and sends
        each turn as text (``/generate``, ``/v1/completions``) gets the earlier turns' ids from the cache too. The
        first text a Tokenizer serves (its first ``CHECK_CHARS`` characters) is also tokenized whole and compared;
        a difference turns the cache off."""
        if self._split is None:
            return self.encode(prompt)
        if not self._text_checked:
            self._text_checked = True
            head = prompt[:CHECK_CHARS]
            if self.encode_segments(head) != self.encode(head):
                self._split = None
                return self.encode(prompt)
        return self.encode_segments(prompt)

    def _chat_whole(self, messages: list[dict[str, Any]]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding in recent transformers
            out = out["input_ids"]
        return list(out)

    def encode_segments(self, text: str) -> list[int]:
        """``encode(text)`` built stretch by stretch between the added tokens, each stretch through the cache."""
        if self._split is None:
            return self.encode(text)
        parts = self._split.split(text)  # text, added token, text, ... (the pattern captures the tokens)
        ids: list[int] = []
        prev = None
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._added[part])
                prev = part
            elif part:
                got = self._stretch(prev, part)
                if got is None:  # the tokenizer merged across an added token: whole texts from now on
                    self._split = None
                    return self.encode(text)
                ids.extend(got)
        return ids

    def _stretch(self, prev: str | None, text: str) -> list[int] | None:
        """The ids of ``text`` where it follows the added token ``prev`` (None: at the start); None when the
        tokenizer did not keep ``prev`` whole in front of it."""
        key = (prev, text)
        with self._lock:
            self.stats["segments"] += 1
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                self.stats["cached"] += 1
                return got
        if prev is None:
            got = self.encode(text)
        else:
            got = self.encode(prev + text)
            if not got or got[0] != self._added[prev]:
                return None
            got = got[1:]
        with self._lock:
            self.stats["chars_tokenized"] += len(text)
            if key not in self._cache and len(text) <= self._cache_limit:
                self._cache[key] = got
                self._cache_chars += len(text)
                while self._cache_chars > self._cache_limit:
                    (_, old), _ = self._cache.popitem(last=False)
                    self._cache_chars -= len(old)
        return got


def _added_split(tok: Any) -> tuple[dict[str, int], "re.Pattern[str] | None"]:
    """({added token: id}, a pattern splitting text at them as the tokenizer does), or (.., None) when a stretch
    between them cannot be tokenized on its own exactly (module docstring)."""
    decoder = getattr(tok, "added_tokens_decoder", None)
    backend = getattr(tok, "backend_tokenizer", None)
    if not decoder or backend is None:
        return {}, None
    added: dict[str, int] = {}
    normalizer = backend.normalizer is not None
    for i, t in decoder.items():
        if getattr(t, "lstrip", True) or getattr(t, "rstrip", True) or getattr(t, "single_word", True):
            return {}, None
        if getattr(t, "normalized", True) and normalizer:
            return {}, None
        added[str(t.content)] = int(i)
    if not added or any(not s for s in added):
        return {}, None
    alternatives = sorted(added, key=len, reverse=True)  # at one position, the longest first
    return added, re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")


def load_tokenizer(model: str, tokenizer: str | None = None, chat_template: str | None = None) -> Tokenizer | None:
    """The tokenizer of ``tokenizer`` (a checkpoint directory or ``tiny``), else of ``model``: the tiny preset's
    shipped one (``cpkv.serve.tiny_tokenizer``), a checkpoint directory's own, or None (other presets, a directory
    without one). ``chat_template``: a jinja file, or the template's text, replacing the tokenizer's."""
    from cpkv.errors import ConfigError

    source = tokenizer or model
    tok = _load(source)
    if tok is None and tokenizer is not None:
        raise ConfigError(f"--tokenizer {tokenizer}: expected a directory holding one of {', '.join(TOKENIZER_FILES)}"
                          " or 'tiny'")
    if tok is not None and chat_template is not None:
        path = Path(chat_template)
        tok.chat_template = path.read_text() if path.is_file() else chat_template
    return None if tok is None else Tokenizer(tok)


def _load(source: str) -> Any:
    if source in ("tiny", "preset:tiny"):
        from cpkv.serve import tiny_tokenizer
        return tiny_tokenizer.load()
    path = Path(source)
    if not path.is_dir() or not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class TextStream:
    """Incremental detokenisation: ``push(ids so far)`` -> the new text since the last call (text that ends in
    an incomplete UTF-8 sequence is held back until the next token completes it)."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok, self.skip, self.sent = tok, skip_special_tokens, ""

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        text = self.tok.decode(ids, self.skip)
        if text.endswith("\ufffd") and not final:
            return ""
        new = text[len(self.sent):] if text.startswith(self.sent) else text
        self.sent = text
        return new
