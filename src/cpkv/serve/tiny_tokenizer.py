"""The tiny preset's tokenizer: byte-level BPE (GPT-2's byte alphabet, so any UTF-8 text round-trips) trained on
a few sentences to exactly the preset's 512 ids, with four special tokens and a chat template.

Shipped as package data (``cpkv/serve/data/tiny_tokenizer.json``, ``tiny_chat_template.jinja``) so the
quick-start ``cpkv serve`` takes text and chat; ``python -m cpkv.serve.tiny_tokenizer`` rebuilds the JSON.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

SPECIAL = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>")
EOS = SPECIAL[0]
VOCAB_SIZE = 512  # the tiny preset's (``cpkv.config.PRESETS["tiny"].vocab_size``)
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Context-parallel prefill splits a long prompt over ranks, ",
    "and every rank keeps its share of the KV cache. A request reuses the pages of a prefix cached before. ",
    "What is the capital of France? Paris is the capital of France. Hello, how are you today? I am fine, ",
    "thank you. Tell me a story about a model that serves long conversations on many GPUs at once.",
)


def data_path(name: str) -> Path:
    """A file of the package's ``serve/data`` folder."""
    return Path(str(resources.files("cpkv.serve") / "data" / name))


def build() -> Any:
    """The tokenizer (``tokenizers.Tokenizer``), deterministic: the same JSON every time."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    numbers = " ".join(str(i) for i in range(1000))  # enough pairs to fill every id
    tok.train_from_iterator([*CORPUS, numbers] * 4, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def load() -> Any:
    """The shipped tokenizer with its chat template (a transformers ``PreTrainedTokenizerFast``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(data_path("tiny_tokenizer.json")), eos_token=EOS,
                                   chat_template=data_path("tiny_chat_template.jinja").read_text(),
                                   clean_up_tokenization_spaces=False)


if __name__ == "__main__":
    build().save(str(data_path("tiny_tokenizer.json")), pretty=False)
