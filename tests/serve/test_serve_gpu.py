"""GPU: ``cpkv serve --device cuda`` (tiny, cp 2): /generate's greedy tokens equal ``cpkv run --device cuda``'s first
tokens for the prompt plus the tokens so far, and concurrent copies of a prompt get the same tokens."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from test_serve import ENV, OPTS, WAIT_S, Server, generate, httpx, prompt  # noqa: F401 (tests/serve on sys.path)

pytestmark = [pytest.mark.cuda, pytest.mark.triton, pytest.mark.slow]


def test_serve_on_cuda_equals_cpkv_run(tmp_path):
    s = Server("tiny", "--device", "cuda")
    try:
        prompts = [prompt(1, 40), prompt(2, 75), prompt(3, 150)]
        outs = [generate(s, p, 4)["output_ids"] for p in prompts]

        async def burst():
            async with httpx.AsyncClient(base_url=s.url, timeout=WAIT_S) as c:
                body = lambda p: {"input_ids": p, "sampling_params": {"max_new_tokens": 4}}  # noqa: E731
                return await asyncio.gather(*(c.post("/generate", json=body(prompts[i % 3])) for i in range(24)))

        for i, r in enumerate(asyncio.run(burst())):
            assert r.status_code == 200 and r.json()["output_ids"] == outs[i % 3], (i, r.text)
    finally:
        s.proc.send_signal(2)
        assert s.proc.wait(timeout=WAIT_S) == 0, s.stderr
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"id": f"p{i}.{k}", "arrival": 0, "tokens": p + o[:k]}) + "\n"
                             for i, (p, o) in enumerate(zip(prompts, outs)) for k in range(4)))
    run = subprocess.run([sys.executable, "-m", "cpkv", "run", "--device", "cuda", "--trace", str(trace), "--json",
                          *OPTS[:6]], env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    first = {r["id"]: r["first_token"] for r in json.loads(run.stdout)["requests"]}
    for i, o in enumerate(outs):
        assert [first[f"p{i}.{k}"] for k in range(4)] == o
