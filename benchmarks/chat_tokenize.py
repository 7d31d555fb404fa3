"""Host ms to turn a long chat into token ids the way ``cpkv serve`` does (``serve.tokenizer.Tokenizer.chat``), with
a byte-level BPE of 32K tokens trained here on random words (no real checkpoint's tokenizer is on this machine:
treat the figures as an order of magnitude). CPU only. Two figures: the whole chat through transformers'
``apply_chat_template`` with tokenization (what ``chat`` did before its segment cache), and ``chat`` on the
conversation's next turn, the turns before it seen (the segment cache's case: each turn resends the ones before).

    PYTHONPATH=src python3 benchmarks/chat_tokenize.py [turns] [words per turn]
"""
from __future__ import annotations

import json
import random
import string
import sys
import tempfile
import time
from pathlib import Path


def _tokenizer_dir(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(20000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<unk>", "<eos>", "<|user|>", "<|assistant|>"])
    tok.train_from_iterator((" ".join(rng.choice(words) for _ in range(200)) for _ in range(2000)), trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<eos>",
        "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}"}))


def main(turns: int, words: int) -> None:
    from cpkv.serve.tokenizer import load_tokenizer

    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as d:
        _tokenizer_dir(Path(d))
        tok = load_tokenizer(d)
        msgs = [{"role": "user" if i % 2 == 0 else "assistant",
                 "content": " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
                                     for _ in range(words))} for i in range(turns)]
        tok.chat(msgs[:2])
        best, n = float("inf"), 0
        for _ in range(3):
            t0 = time.perf_counter()
            n = len(tok.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
            best = min(best, time.perf_counter() - t0)
        turn = float("inf")
        for k in range(3):  # the next turn of a conversation whose turns before were tokenized
            nxt = msgs[:-1] + [dict(msgs[-1], content=msgs[-1]["content"] + f" turn{k}")]
            tok.chat(nxt[:-1])
            t0 = time.perf_counter()
            ids = tok.chat(nxt)
            turn = min(turn, time.perf_counter() - t0)
        print(json.dumps({"turns": turns, "chars": sum(len(m["content"]) for m in msgs), "tokens": n,
                          "whole_ms": round(best * 1e3, 1), "tokens_per_s": round(n / best),
                          "next_turn_ms": round(turn * 1e3, 1), "next_turn_tokens": len(ids),
                          "segment_cache": tok.segment_cache}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 60, int(sys.argv[2]) if len(sys.argv) > 2 else 2000)
