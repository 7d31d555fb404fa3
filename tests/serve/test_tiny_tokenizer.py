"""The tiny preset's shipped tokenizer: every id inside the preset's vocabulary, any UTF-8 text round-trips, the
chat template renders, and the shipped JSON is what the builder makes."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
from hypothesis import given, settings, strategies as st  # noqa: E402

from cpkv.config import preset  # noqa: E402
from cpkv.serve import tiny_tokenizer  # noqa: E402
from cpkv.serve.tokenizer import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def test_every_id_fits_the_preset_vocabulary(tok):
    assert len(tok.tok) == preset("tiny").vocab_size == tiny_tokenizer.VOCAB_SIZE
    assert tok.stop_ids == {tok.tok.convert_tokens_to_ids(tiny_tokenizer.EOS)}


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_detokenize_tokenize_is_the_identity(tok, text):
    ids = tok.text(text)
    assert all(0 <= i < preset("tiny").vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_the_chat_template_renders_roles_and_the_generation_prompt(tok):
    ids = tok.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}])
    assert tok.decode(ids, skip_special_tokens=False) == "<|system|>be brief\n<|user|>héllo\n<|assistant|>"
    assert tok.decode(ids) == "be brief\nhéllo\n"  # role markers are special tokens


def test_the_shipped_json_is_the_builders():
    shipped = json.loads(tiny_tokenizer.data_path("tiny_tokenizer.json").read_text())
    assert json.loads(tiny_tokenizer.build().to_str()) == shipped


def test_flags_override_the_tokenizer_and_the_template(tmp_path):
    from cpkv.errors import ConfigError

    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = load_tokenizer("glm5", tokenizer="tiny", chat_template=str(tmp_path / "t.jinja"))
    assert tok.decode(tok.chat([{"role": "user", "content": "x"}])) == "[x]"
    assert load_tokenizer("glm5") is None
    with pytest.raises(ConfigError, match="--tokenizer"):
        load_tokenizer("tiny", tokenizer=str(tmp_path))
