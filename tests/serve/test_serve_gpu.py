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


@pytest.mark.parametrize("decode", ["extend", "paged"])
def test_serve_on_cuda_equals_cpkv_run(tmp_path, decode):
    s = Server("tiny", "--device", "cuda", "--decode", decode)
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


@pytest.mark.parametrize("decode", ["extend", "paged"])
def test_serve_generate_equals_cpkv_run_at_glm5_shapes(tmp_path, decode):
    """GLM-5's shapes (4 layers, cp 2: expert parallelism over two ranks on the GPU): /generate's greedy tokens equal
    ``cpkv run``'s first tokens for the prompt plus the tokens so far (its verification passing), except where the
    run's own top two logits tie within its verification tolerance (either side may then break the tie: at most
    one such token is allowed, and it must be such a tie)."""
    from safetensors.torch import load_file

    geo = ["--page-size", "64", "--chunk-size", "512", "--pages-per-rank", "256", "--max-requests", "8",
           "--num-layers", "4", "--cp", "2"]
    s = Server("glm5", "--device", "cuda", "--decode", decode, *geo)
    try:
        prompts = [prompt(1, 300), prompt(2, 700)]
        outs = [generate(s, p, 4)["output_ids"] for p in prompts]
    finally:
        s.proc.send_signal(2)
        assert s.proc.wait(timeout=WAIT_S) == 0, s.stderr
    trace, logits = tmp_path / "t.jsonl", tmp_path / "l.safetensors"
    trace.write_text("".join(json.dumps({"id": f"p{i}.{k}", "arrival": 0, "tokens": p + o[:k]}) + "\n"
                             for i, (p, o) in enumerate(zip(prompts, outs)) for k in range(4)))
    run = subprocess.run([sys.executable, "-m", "cpkv", "run", "--model", "glm5", "--device", "cuda", "--trace",
                          str(trace), "--json", "--logits-out", str(logits), *geo], env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    first = {r["id"]: r["first_token"] for r in report["requests"]}
    tol = report["verify"]["tolerance"]
    lg = load_file(str(logits))
    differ = [(i, k) for i, o in enumerate(outs) for k in range(4) if first[f"p{i}.{k}"] != o[k]]
    assert len(differ) <= 1, (differ, outs, first)
    for i, k in differ:
        top2 = lg[f"p{i}.{k}"].topk(2).values
        assert float(top2[0] - top2[1]) <= tol, (i, k, top2, tol)


def _sampled(s: Server, ids: list[int], seed: int) -> list[int]:
    r = s.post("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "min_p": 0.01, "seed": seed,
        "repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.1, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.mark.parametrize("model,extra", [
    ("tiny", ("--cp", "2")),
    ("glm5", ("--page-size", "64", "--chunk-size", "512", "--pages-per-rank", "256", "--max-requests", "8",
              "--num-layers", "4", "--cp", "2")),
])
def test_sampling_same_seed_same_tokens_run_to_run(model, extra):
    """Sampled generations on the GPU (every sampling parameter on, cp 2 so the picking rank differs by request):
    a request with a seed gets the same tokens each time it is sent alone, and again from a second server process
    (run to run); other seeds give other tokens (a draw, not greedy in disguise).

    Same tokens need the same computation: a prompt's first send runs it cold, later sends hit its cached pages and
    run other row counts through the GEMMs, whose rounding moves the logits (at GLM-5 shapes with random weights the
    distribution is near-flat, so a seeded draw can move with it). Each prompt is therefore sent once (one greedy
    token) before the sampled requests, so that every sampled request finds the same cache."""
    prompts = [prompt(4, 90), prompt(5, 333)]
    runs = []
    for _ in range(2):  # two server processes: run to run
        s = Server(model, "--device", "cuda", *extra)
        try:
            for p in prompts:
                generate(s, p, 1)
            outs = {(i, seed): _sampled(s, p, seed) for i, p in enumerate(prompts) for seed in (1, 2, 3)}
            again = {k: _sampled(s, prompts[k[0]], k[1]) for k in outs}
        finally:
            s.proc.send_signal(2)
            assert s.proc.wait(timeout=WAIT_S) == 0, s.stderr
        assert again == outs
        runs.append(outs)
    assert runs[0] == runs[1]
    for i in range(len(prompts)):
        assert len({tuple(runs[0][(i, seed)]) for seed in (1, 2, 3)}) > 1, runs[0]
