from __future__ import annotations

import json

import pytest

from cpkv.errors import TraceError
from cpkv.scheduler.trace import (MAX_ARRIVAL_S, MAX_ID_CHARS, PageKeys, TraceRequest, builtin_trace, ideal_hit_ratio,
                                  load_trace, materialize_tokens, parse_trace, synth_tokens, write_trace)


def lines(*objs):
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def test_parse_valid_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines(
        {"id": "a", "arrival": 0, "prompt_len": 100},
        "",
        {"id": 7, "arrival": 0.5, "tokens": [3, 1, 2]},
        {"id": "b", "arrival": 0.5, "prompt_len": 130, "parent": "a"},
    )) + "\n")
    reqs = load_trace(path)
    assert [(r.id, r.arrival, r.prompt_len, r.parent, r.line) for r in reqs] == [
        ("a", 0.0, 100, None, 1), (7, 0.5, 3, None, 3), ("b", 0.5, 130, "a", 4)]
    assert reqs[1].tokens == (3, 1, 2)
    out = tmp_path / "u.jsonl"
    write_trace(reqs, out)
    assert [(r.id, r.prompt_len, r.parent, r.tokens) for r in load_trace(out)] == \
        [(r.id, r.prompt_len, r.parent, r.tokens) for r in reqs]


GOOD = {"id": "a", "arrival": 1.0, "prompt_len": 10}


@pytest.mark.parametrize("bad, line, why", [
    ('{"id": "x", "arrival": 2', 2, "bad JSON"),
    ("[1, 2]", 2, "expected a JSON object"),
    ({"arrival": 2, "prompt_len": 5}, 2, "missing field 'id'"),
    ({"id": "b", "prompt_len": 5}, 2, "missing field 'arrival'"),
    ({"id": "b", "arrival": 2}, 2, "neither is present"),
    ({"id": "b", "arrival": 2, "prompt_len": 5, "tokens": [1]}, 2, "not both"),
    ({"id": "a", "arrival": 2, "prompt_len": 5}, 2, "duplicate id 'a' (first on line 1)"),
    ({"id": "b", "arrival": 0.5, "prompt_len": 5}, 2, "earlier than the previous"),
    ({"id": "b", "arrival": -1, "prompt_len": 5}, 2, "'arrival' must be"),
    ({"id": "b", "arrival": "soon", "prompt_len": 5}, 2, "'arrival' must be"),
    ({"id": "b", "arrival": 2, "prompt_len": 0}, 2, "'prompt_len' must be an integer in 1.."),
    ({"id": "b", "arrival": 2, "prompt_len": 5.5}, 2, "'prompt_len' must be an integer in 1.."),
    ({"id": "b", "arrival": 2, "tokens": []}, 2, "non-empty list"),
    ({"id": "b", "arrival": 2, "tokens": [1, -2]}, 2, "'tokens'[1]"),
    ({"id": [1], "arrival": 2, "prompt_len": 5}, 2, "'id' must be a string or an integer"),
    ({"id": "b", "arrival": 2, "prompt_len": 5, "parent": "zz"}, 2, "unknown parent 'zz'"),
    ({"id": "b", "arrival": 2, "prompt_len": 5, "parent": "a"}, 2, "shorter than its parent 'a'"),
    ({"id": "b", "arrival": 2, "prompt_len": 15, "parent": "b"}, 2, "names itself"),
    ({"id": "b", "arrival": 2, "tokens": [1], "parent": "a"}, 2, "'parent' goes with 'prompt_len' only"),
    ({"id": "b", "arrival": 2, "prompt_len": 5, "output_len": 9}, 2, "unknown field(s) 'output_len'"),
])
def test_malformed_line_names_line_and_reason(bad, line, why):
    with pytest.raises(TraceError) as exc:
        parse_trace(lines(GOOD, bad, {"id": "z", "arrival": 9, "prompt_len": 1}), source="t.jsonl")
    assert f"t.jsonl:{line}:" in str(exc.value)
    assert why in str(exc.value)


# every field's range, checked when the trace is read: one line naming the file, the line and the field
RANGES = [
    ({"id": "b", "arrival": 1e308, "prompt_len": 5}, "'arrival' must be a number of seconds in 0..10000000 (about "
                                                     "116 days), got 1e+308"),
    ({"id": "b", "arrival": MAX_ARRIVAL_S + 1, "prompt_len": 5}, "'arrival' must be a number of seconds in 0.."),
    ({"id": "b", "arrival": True, "prompt_len": 5}, "'arrival' must be a number of seconds"),
    ('{"id": "b", "arrival": NaN, "prompt_len": 5}', "'arrival' must be a number of seconds in 0..10000000 (about "
                                                     "116 days), got NaN"),
    ('{"id": "b", "arrival": Infinity, "prompt_len": 5}', "'arrival' must be a number of seconds"),
    ({"id": "b" * (MAX_ID_CHARS + 1), "arrival": 2, "prompt_len": 5},
     f"'id' must be a string of at most {MAX_ID_CHARS} characters, got one of {MAX_ID_CHARS + 1}"),
    ({"id": -2 ** 63 - 1, "arrival": 2, "prompt_len": 5}, "'id' must be a string or an integer within int64"),
    ({"id": "b", "arrival": 2, "prompt_len": 5, "parent": "p" * (MAX_ID_CHARS + 1)},
     f"'parent' must be a string of at most {MAX_ID_CHARS} characters"),
    ({"id": "b", "arrival": 2, "prompt_len": 5, "parent": 2 ** 64}, "'parent' must be a string or an integer within "
                                                                    "int64, got 18446744073709551616"),
    ({"id": "b", "arrival": 2, "prompt_len": 5, "parent": 1.5}, "'parent' must be a string or an integer"),
    ({"id": "b", "arrival": 2, "prompt_len": 2 ** 24 + 1}, "'prompt_len' must be an integer in 1..16777216"),
    ({"id": "b", "arrival": 2, "tokens": [2 ** 63]}, "'tokens'[0] must be an integer in 0..2^63-1"),
]


@pytest.mark.parametrize("bad, why", RANGES, ids=[f"range{i}" for i in range(len(RANGES))])
def test_every_field_has_a_range_named_with_file_and_line(bad, why, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines(GOOD, bad)) + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(path)
    text = str(exc.value)
    assert text.startswith(f"{path}:2: ") and why in text, text
    assert "\n" not in text and len(text) < 400


def test_range_edges_are_accepted():
    ok = parse_trace(lines({"id": "x" * MAX_ID_CHARS, "arrival": 0, "prompt_len": 1},
                           {"id": 2 ** 63 - 1, "arrival": MAX_ARRIVAL_S, "prompt_len": 2 ** 24},
                           {"id": -2 ** 63 + 1, "arrival": MAX_ARRIVAL_S, "prompt_len": 2 ** 24, "parent": 2 ** 63 - 1}))
    assert [r.arrival for r in ok] == [0.0, MAX_ARRIVAL_S, MAX_ARRIVAL_S] and ok[2].parent == 2 ** 63 - 1


def test_later_parent_is_named():
    with pytest.raises(TraceError, match=r"t:1: parent 'b' is defined later, on line 3"):
        parse_trace(lines({"id": "a", "arrival": 0, "prompt_len": 9, "parent": "b"}, "",
                          {"id": "b", "arrival": 1, "prompt_len": 4}), source="t")


def test_int_and_string_ids_differ():
    reqs = parse_trace(lines({"id": 1, "arrival": 0, "prompt_len": 4}, {"id": "1", "arrival": 0, "prompt_len": 4}))
    assert [r.id for r in reqs] == [1, "1"]
    with pytest.raises(TraceError, match="unknown parent '1'"):
        parse_trace(lines({"id": 1, "arrival": 0, "prompt_len": 4},
                          {"id": 2, "arrival": 0, "prompt_len": 8, "parent": "1"}))


def test_empty_trace_and_missing_file(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "  "])
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")


def test_materialize_continues_parent_tokens_deterministically():
    reqs = [TraceRequest("a", 0, 70), TraceRequest("b", 1, 100, parent="a"), TraceRequest("c", 2, 100, parent="b"),
            TraceRequest("d", 3, 3, tokens=(5, 6, 7))]
    toks = materialize_tokens(reqs, vocab_size=1000)
    assert toks["b"][:70] == toks["a"] and toks["c"] == toks["b"] and toks["d"] == [5, 6, 7]
    assert len(toks["b"]) == 100 and all(0 <= t < 1000 for t in toks["b"])
    assert toks == materialize_tokens(reqs, vocab_size=1000)
    assert synth_tokens("a", 70, 1000) == toks["a"] and synth_tokens("a", 70, 1000) != synth_tokens("x", 70, 1000)
    assert synth_tokens(1, 20) != synth_tokens("1", 20)


def test_page_keys_match_exactly_when_materialized_pages_match():
    P = 8
    reqs = [TraceRequest("a", 0, 30), TraceRequest("b", 1, 45, parent="a"), TraceRequest("c", 2, 40, parent="a"),
            TraceRequest("d", 3, 20, tokens=tuple(range(20))), TraceRequest("e", 4, 17, tokens=tuple(range(17)))]
    toks = materialize_tokens(reqs)
    keys = PageKeys(reqs, P)
    got = {r.id: keys(r) for r in reqs}
    for x in reqs:
        assert len(got[x.id]) == x.prompt_len // P
        for y in reqs:
            for k in range(min(len(got[x.id]), len(got[y.id]))):
                same_tokens = toks[x.id][:(k + 1) * P] == toks[y.id][:(k + 1) * P]
                assert (got[x.id][:k + 1] == got[y.id][:k + 1]) == same_tokens
    assert keys._kept == {}   # nothing kept once every child has been served


def test_builtin_trace_is_deterministic_valid_and_hits_about_ninety_percent():
    a = builtin_trace(800, seed=3)
    assert a == builtin_trace(800, seed=3) and a != builtin_trace(800, seed=4)
    assert len(a) == 800
    text = [json.dumps(r.to_json()) for r in a]
    assert [(r.id, r.prompt_len, r.parent) for r in parse_trace(text)] == [(r.id, r.prompt_len, r.parent) for r in a]
    assert 0.85 <= ideal_hit_ratio(builtin_trace(3000), 64) <= 0.95
    assert sum(r.parent is None and r.prompt_len > 16384 for r in a) > 10     # fresh long prompts that chunk
    small = builtin_trace(200, scale=0.01)
    assert max(r.prompt_len for r in small) <= 1966 + 1
