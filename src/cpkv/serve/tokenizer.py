"""The checkpoint's tokenizer and chat template, when it ships them (transformers' ``AutoTokenizer``, whose
``apply_chat_template`` renders the template with jinja); presets have none and take token ids only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class Tokenizer:
    """encode / decode / chat over a transformers tokenizer. ``stop_ids``: its end-of-sequence ids."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        eos = tok.eos_token_id
        self.stop_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The template applied to ``messages`` with the generation prompt, as token ids."""
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding in recent transformers
            out = out["input_ids"]
        return list(out)


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer of checkpoint directory ``model`` (None for a preset or a directory without one)."""
    path = Path(model)
    if not path.is_dir() or not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(str(path)))


class TextStream:
    """Incremental detokenisation: ``push(ids so far)`` -> the new text since the last call (text that ends in
    an incomplete UTF-8 sequence is held back until the next token completes it)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.sent = tok, ""

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        text = self.tok.decode(ids)
        if text.endswith("\ufffd") and not final:
            return ""
        new = text[len(self.sent):] if text.startswith(self.sent) else text
        self.sent = text
        return new
