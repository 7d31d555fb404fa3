"""``serve.output`` alone: stop strings cut the text and streamed text never shows a stop's first characters;
stop tokens drop their text; generation_config.json's EOS ids; the EOS and stop ids a request submits."""
from __future__ import annotations

import asyncio
import json

import pytest

from cpkv.serve.output import ChoiceText, generation_eos_ids


class Words:
    """Decodes id i as 'w<i>' joined by spaces; id 1 as '<eos>' (special)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join("<eos>" if i == 1 else f"w{i}" for i in ids if i != 1 or not skip_special_tokens)


def test_a_stop_string_cuts_the_text_and_streaming_holds_back_its_start():
    t = ChoiceText(Words(), stop=("w3 w4",))
    shown = []
    for ids in ([2], [2, 3], [2, 3, 5], [2, 3, 5, 3], [2, 3, 5, 3, 4]):
        stopped = t.push(ids)
        shown.append(t.visible(False))
    assert shown == ["w2", "w2 ", "w2 w3 w5", "w2 w3 w5 ", "w2 w3 w5 "]  # "w3" held until "w5" shows it is no stop
    assert stopped and t.text == "w2 w3 w5 " and all(shown[-1].startswith(s) for s in shown)
    keep = ChoiceText(Words(), stop=("w3",), keep_stop=True)
    assert keep.push([2, 3, 4]) and keep.text == "w2 w3"


def test_the_earliest_stop_wins_and_stop_tokens_lose_their_text():
    t = ChoiceText(Words(), stop=("w9", "w4"))
    assert t.push([4, 5, 9]) and t.text == ""
    eos = ChoiceText(Words(), stop_ids=frozenset({7}))
    assert not eos.push([5, 7], "stop") and eos.text == "w5"
    kept = ChoiceText(Words(), keep_stop=True, stop_ids=frozenset({7}))
    kept.push([5, 7], "stop")
    assert kept.text == "w5 w7"


def test_generation_config_eos_ids(tmp_path):
    assert generation_eos_ids(str(tmp_path)) == frozenset() and generation_eos_ids("tiny") == frozenset()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    assert generation_eos_ids(str(tmp_path)) == {3, 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert generation_eos_ids(str(tmp_path)) == {4}


@pytest.mark.parametrize("extra,want", [({}, {9}), ({"ignore_eos": True}, set()),
                                        ({"stop_token_ids": [5], "ignore_eos": True}, {5})])
def test_requests_submit_the_eos_and_stop_ids(extra, want):
    httpx = pytest.importorskip("httpx")
    from test_app import ScriptedClient

    from cpkv.serve.app import ServeState, build_app
    from cpkv.serve.frontend import Frontend
    from cpkv.serve.metrics import Metrics

    client = ScriptedClient()
    seen = []
    client.submit = lambda tokens, n, f, stop_ids=frozenset(), sampling=None: (seen.append((stop_ids, sampling)), 1)[1]
    app = build_app(ServeState(Frontend(client, Metrics(), 8), None, "tiny", eos_ids=frozenset({9})))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            task = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": [1, 2], "seed": 3, **extra}))
            for _ in range(1000):
                if seen:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
    asyncio.run(go())
    assert seen[0][0] == want and seen[0][1].seed == 3
