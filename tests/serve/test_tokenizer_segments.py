"""A chat's token ids built stretch by stretch between added tokens, through the segment cache
(``cpkv.serve.tokenizer``), equal transformers' own ``apply_chat_template(tokenize=True)`` exactly, turn after turn
of growing conversations; tokenizers where that cannot hold tokenize whole.

Tokenizers trained here with the ``tokenizers`` library: byte-level BPE (GPT-style, no prefix space), and a
Metaspace unigram-free BPE whose pre-tokenizer prepends "▁" to a text's first piece only (SentencePiece-style:
the stretch after an added token must be tokenized behind it to come out as in the whole text).
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SPECIAL = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(string.ascii_lowercase + "éü") for _ in range(rng.randint(1, 9))) for _ in range(n)]


def _save(tok, path: Path, normalized_added: bool = False, lstrip: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<eos>",
           "chat_template": TEMPLATE}
    if normalized_added or lstrip:  # the role markers as added tokens with those flags
        cfg["added_tokens_decoder"] = {
            str(i): {"content": s, "lstrip": lstrip, "rstrip": False, "single_word": False,
                     "normalized": normalized_added, "special": True} for i, s in enumerate(SPECIAL)}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def _bpe(path: Path, kind: str, **flags) -> Path:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    rng = random.Random(0)
    words = _words(rng, 3000)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    if kind == "lowercase":
        tok.normalizer = normalizers.Lowercase()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIAL)
    tok.train_from_iterator((" ".join(rng.choice(words) for _ in range(50)) for _ in range(300)), trainer)
    return _save(tok, path, **flags)


def _chat(rng: random.Random, turns: int) -> list[dict]:
    out = []
    for i in range(turns):
        text = " ".join(_words(rng, rng.randint(0, 40)))
        if rng.random() < 0.2:
            text = rng.choice(["", " ", "\n\n", "  lead and trail  "]) + text
        if rng.random() < 0.1:  # a message that itself contains a role marker, as a user may type one
            text += " <|user|>x<|assistant|> y"
        out.append({"role": "system" if i == 0 else "user" if i % 2 else "assistant", "content": text})
    return out


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_segment_ids_equal_the_whole_tokenization_turn_after_turn(tmp_path, kind):
    from cpkv.serve.tokenizer import load_tokenizer

    tok = load_tokenizer(str(_bpe(tmp_path / kind, kind)))
    assert tok.segment_cache
    rng = random.Random(1)
    for conv in range(6):
        msgs = _chat(rng, 12)
        for n in range(1, len(msgs) + 1):
            before = tok.stats["chars_tokenized"]
            got = tok.chat(msgs[:n])
            assert got == tok._chat_whole(msgs[:n]), (kind, conv, n)
            if n > 2 and tok.segment_cache:
                # only the last message's text is new (the generation marker's place aside)
                assert tok.stats["chars_tokenized"] - before <= len(msgs[n - 1]["content"]) + 8
    assert tok.segment_cache  # the first chat's whole-text check kept the cache on
    assert tok.stats["cached"] > tok.stats["segments"] // 2


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_text_prompts_through_the_cache_equal_the_whole_encoding(tmp_path, kind):
    """A client that renders the template itself and sends each turn as text (``/generate``): ``text`` gives
    ``encode``'s ids and tokenizes only the new turn's text."""
    from cpkv.serve.tokenizer import load_tokenizer

    tok = load_tokenizer(str(_bpe(tmp_path / kind, kind)))
    rng = random.Random(4)
    msgs = _chat(rng, 14)
    for n in range(1, len(msgs) + 1):
        prompt = tok.tok.apply_chat_template(msgs[:n], add_generation_prompt=True, tokenize=False)
        before = tok.stats["chars_tokenized"]
        assert tok.text(prompt) == tok.encode(prompt), (kind, n)
        if n > 2:
            assert tok.stats["chars_tokenized"] - before <= len(msgs[n - 1]["content"]) + 8
    for cut in (1, 7, 30, 100):  # any text at all, role markers cut in half included
        assert tok.text(prompt[:-cut]) == tok.encode(prompt[:-cut])
    assert tok.segment_cache


def test_added_tokens_the_cache_cannot_follow_tokenize_whole(tmp_path):
    """Added tokens matched on normalised text (with a normaliser), or that strip their neighbours' spaces: the
    cache is off and chats are the whole tokenization."""
    from cpkv.serve.tokenizer import load_tokenizer

    rng = random.Random(2)
    for name, kind, flags in (("norm", "lowercase", {"normalized_added": True}),
                              ("strip", "bytelevel", {"lstrip": True})):
        tok = load_tokenizer(str(_bpe(tmp_path / name, kind, **flags)))
        assert not tok.segment_cache, name
        msgs = _chat(rng, 6)
        assert tok.chat(msgs) == tok._chat_whole(msgs)
        text = tok.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert tok.text(text) == tok.encode(text)
        assert tok.stats["segments"] == 0


def test_the_cache_stays_within_its_characters(tmp_path):
    from cpkv.serve.tokenizer import Tokenizer, load_tokenizer

    whole = load_tokenizer(str(_bpe(tmp_path / "b", "bytelevel")))
    tok = Tokenizer(whole.tok, cache_chars=2000)
    rng = random.Random(3)
    for _ in range(20):
        msgs = _chat(rng, 8)
        assert tok.chat(msgs) == whole._chat_whole(msgs)
        assert tok._cache_chars <= 2000 and tok._cache_chars == sum(len(t) for _, t in tok._cache)


def test_a_stretch_whose_marker_the_tokenizer_merges_falls_back_to_the_whole_text(tmp_path):
    """Should a stretch come back without its added token in front (a tokenizer merging across it), the text is
    tokenized whole, and from then on every text: the right ids, no error."""
    from cpkv.serve.tokenizer import load_tokenizer

    tok = load_tokenizer(str(_bpe(tmp_path / "b", "bytelevel")))
    rng = random.Random(5)
    msgs = _chat(rng, 6)
    assert tok.chat(msgs[:2]) == tok._chat_whole(msgs[:2]) and tok.segment_cache
    whole = tok.encode
    tok.encode = lambda text: whole(text)[1:] if text.startswith("<|") else whole(text)  # the marker swallowed
    prompt = tok.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.encode_segments(prompt) == tok.encode(prompt)  # the (patched) whole encoding: was a RuntimeError
    assert not tok.segment_cache
    tok.encode = whole
    assert tok.text(prompt) == whole(prompt) and tok.chat(msgs) == tok._chat_whole(msgs)
