"""Sampling, stops and output extras through a real ``cpkv serve`` (CPU, the tiny checkpoint with its word-level
tokenizer, cp 2), driven by the official ``openai`` client and raw HTTP: the same seed gives the same tokens, another
seed others, ``n`` choices differ, stop strings cut the text (streamed too), log-probabilities in OpenAI's and
SGLang's shapes, a list of prompts, echo, chat content parts. One server for the module."""
from __future__ import annotations

import json
import math

import pytest

openai = pytest.importorskip("openai")
from test_serve import Server, prompt, tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

HOT = {"temperature": 1.5, "top_p": 0.95}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(str(tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))))
    s.model = s.get("/v1/models").json()["data"][0]["id"]
    yield s
    s.close()


def complete(server: Server, **kw):
    return server.openai().completions.create(model=server.model, **kw)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(server):
    ids = prompt(21, 30)
    a = complete(server, prompt=ids, max_tokens=8, seed=7, extra_body={"ignore_eos": True}, **HOT)
    b = complete(server, prompt=ids, max_tokens=8, seed=7, extra_body={"ignore_eos": True}, **HOT)
    c = complete(server, prompt=ids, max_tokens=8, seed=8, extra_body={"ignore_eos": True}, **HOT)
    assert a.choices[0].token_ids == b.choices[0].token_ids and a.choices[0].text == b.choices[0].text
    assert c.choices[0].token_ids != a.choices[0].token_ids
    greedy = complete(server, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    top1 = complete(server, prompt=ids, max_tokens=8, seed=3, extra_body={"ignore_eos": True, "top_k": 1}, **HOT)
    assert top1.choices[0].token_ids == greedy.choices[0].token_ids


def test_n_choices_differ_and_repeat_with_the_seed(server):
    ids = prompt(22, 25)
    res = complete(server, prompt=ids, max_tokens=6, n=3, seed=5, extra_body={"ignore_eos": True}, **HOT)
    assert [c.index for c in res.choices] == [0, 1, 2]
    toks = [tuple(c.token_ids) for c in res.choices]
    assert len(set(toks)) == 3 and res.usage.completion_tokens == 18 and res.usage.prompt_tokens == 25
    one = complete(server, prompt=ids, max_tokens=6, seed=5, extra_body={"ignore_eos": True}, **HOT)
    assert tuple(one.choices[0].token_ids) == toks[0]  # choice 0 of seed s is the single answer of seed s
    chunks = list(complete(server, prompt=ids, max_tokens=6, n=3, seed=5, stream=True,
                           extra_body={"ignore_eos": True}, **HOT))
    streamed = {i: [t for ch in chunks for c in ch.choices if c.index == i for t in c.token_ids] for i in range(3)}
    assert [tuple(streamed[i]) for i in range(3)] == toks


def test_stop_strings_cut_the_text_streamed_or_not(server):
    ids = prompt(23, 20)
    full = complete(server, prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}).choices[0]
    words = full.text.split()
    stop = " " + words[3] + " "  # (a word inside the text: the first place it occurs)
    want = full.text[:full.text.find(stop)]
    res = complete(server, prompt=ids, max_tokens=10, temperature=0, stop=[stop, "never-there"],
                   extra_body={"ignore_eos": True}).choices[0]
    assert res.text == want and res.finish_reason == "stop" and stop not in res.text
    assert len(res.token_ids) < 10  # the generation ended at the stop, not at max_tokens
    chunks = list(complete(server, prompt=ids, max_tokens=10, temperature=0, stop=stop, stream=True,
                           extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want and chunks[-1].choices[0].finish_reason == "stop"
    kept = complete(server, prompt=ids, max_tokens=10, temperature=0, stop=stop,
                    extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert kept.text == want + stop


def test_stop_token_ids_end_the_generation(server):
    ids = prompt(24, 20)
    full = complete(server, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}).choices[0]
    at = full.token_ids[2]
    res = complete(server, prompt=ids, max_tokens=6, temperature=0,
                   extra_body={"ignore_eos": True, "stop_token_ids": [at]}).choices[0]
    first = full.token_ids.index(at)
    assert res.token_ids == full.token_ids[:first + 1] and res.finish_reason == "stop"


def test_completion_logprobs_are_top_n_per_token(server):
    res = complete(server, prompt=prompt(25, 20), max_tokens=4, logprobs=3, seed=1,
                   extra_body={"ignore_eos": True}, **HOT).choices[0]
    lp = res.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) == 3 and max(top.values()) >= v
        assert tok.startswith("w") or tok.startswith("<")
    probs = sum(math.exp(x) for x in lp.top_logprobs[0].values())
    assert 0 < probs <= 1 + 1e-6


def test_chat_logprobs_and_content_parts(server):
    client = server.openai()
    parts = [{"type": "text", "text": "w5 w6"}, {"type": "text", "text": "w7"}]
    res = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": parts}],
                                         max_tokens=3, logprobs=True, top_logprobs=2, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert res.usage.prompt_tokens == 5  # <user> w5 w6 \n w7 <assistant>: the parts joined by a newline
    content = res.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)  # greedy: the best one
    assert " ".join(c.token for c in content) == res.choices[0].message.content


def test_completions_take_a_list_of_prompts_and_echo(server):
    res = complete(server, prompt=["w7 w8 w9", "w10 w11"], max_tokens=2, temperature=0, echo=True, n=2,
                   extra_body={"ignore_eos": True})
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    assert res.choices[0].text.startswith("w7 w8 w9") and res.choices[2].text.startswith("w10 w11")
    assert res.choices[0].token_ids == res.choices[1].token_ids  # greedy: both samples of a prompt agree
    assert res.usage.prompt_tokens == 5 and res.usage.completion_tokens == 8


def test_generate_sampling_params_and_logprobs(server):
    body = {"input_ids": prompt(26, 30), "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 5, "temperature": 1.2,
                                                                 "top_k": 20, "min_p": 0.05, "sampling_seed": 4,
                                                                 "repetition_penalty": 1.3, "ignore_eos": True}}
    a, b = server.post("/generate", body), server.post("/generate", body)
    assert a.status_code == 200, a.text
    assert a.json()["output_ids"] == b.json()["output_ids"]
    meta = a.json()["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == a.json()["output_ids"]
    assert all(len(top) == 2 and isinstance(top[0][2], str) for top in meta["output_top_logprobs"])
    r = server.post("/generate", {**body, "stream": True})
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert events[-1]["output_ids"] == a.json()["output_ids"]


def test_unsupported_values_are_400s_naming_them(server):
    for body, param in [({"prompt": [1, 2], "best_of": 3}, "best_of"),
                        ({"prompt": [1, 2], "echo": True, "logprobs": 1}, "echo"),
                        ({"prompt": [1, 2], "n": 65}, "n")]:
        r = server.post("/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    defaults = {"prompt": [1, 2], "max_tokens": 1, "ignore_eos": False, "no_stop_trim": False,
                "skip_special_tokens": True, "return_hidden_states": False, "max_completion_tokens": 1}
    assert server.post("/v1/completions", defaults).status_code == 200
