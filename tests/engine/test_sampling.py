"""``cpkv.engine.sampling`` on hand-built logits: the masks of top_k / top_p / min_p exactly, the penalties exactly
as vLLM defines them, draws fixed by (seed, step) and distributed as the filtered probabilities, greedy paths."""
from __future__ import annotations

import math

import pytest
import torch

from cpkv.engine.protocol import SamplingParams
from cpkv.engine.sampling import draw, filtered_probs, logprobs, penalize, pick

LOGITS = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64))  # probs at temperature 1


def kept(p: SamplingParams) -> list[int]:
    return torch.nonzero(filtered_probs(LOGITS, p)).flatten().tolist()


@pytest.mark.parametrize("p,ids", [
    (SamplingParams(temperature=1.0), [0, 1, 2, 3, 4]),
    (SamplingParams(temperature=1.0, top_k=1), [1]),
    (SamplingParams(temperature=1.0, top_k=3), [1, 3, 4]),
    (SamplingParams(temperature=1.0, top_p=0.39), [1]),
    (SamplingParams(temperature=1.0, top_p=0.69), [1, 3]),
    (SamplingParams(temperature=1.0, top_p=0.71), [1, 3, 4]),
    (SamplingParams(temperature=1.0, min_p=0.5), [1, 3]),    # p >= 0.2
    (SamplingParams(temperature=1.0, min_p=0.25), [1, 3, 4, 2]),  # p >= 0.1
    (SamplingParams(temperature=1.0, top_k=3, min_p=0.5), [1, 3]),
])
def test_masks_are_exact(p, ids):
    probs = filtered_probs(LOGITS, p)
    assert sorted(kept(p)) == sorted(ids), (p, kept(p))
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-12)
    base = torch.softmax(LOGITS, -1)[ids]
    assert torch.allclose(probs[ids], base / base.sum(), rtol=1e-12, atol=0)


def test_top_p_boundary_follows_the_mass_before_a_token():
    """A token is kept while the mass of the tokens ranked before it is <= top_p (SGLang's reference)."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64))  # exact in binary
    assert kept_of(logits, 0.5) == [0, 1]        # mass before id 1 is 0.5 <= 0.5
    assert kept_of(logits, 0.4999) == [0]
    assert kept_of(logits, 0.75) == [0, 1, 2]
    assert kept_of(logits, 0.875) == [0, 1, 2, 3]


def kept_of(logits: torch.Tensor, top_p: float) -> list[int]:
    return torch.nonzero(filtered_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))).flatten().tolist()


def test_temperature_scales_the_logits():
    p = filtered_probs(LOGITS, SamplingParams(temperature=0.5))
    want = torch.softmax(LOGITS / 0.5, -1)
    assert torch.allclose(p, want, rtol=1e-12, atol=0)


def test_penalties_match_vllms_definition():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 0.0], dtype=torch.float64)
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    prompt, output = [0, 1], [2, 2, 3]
    got = penalize(logits, prompt, output, p)
    # repetition over prompt + output (positive / 2, else * 2); then -0.5 * count(output), -0.25 if in output
    want = torch.tensor([1.0, -2.0, 0.25 - 1.0 - 0.25, -6.0 - 0.5 - 0.25, 1.0, 0.0], dtype=torch.float64)
    assert torch.equal(got, want), got
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 0.0], dtype=torch.float64))  # a copy
    assert torch.equal(penalize(logits, prompt, output, SamplingParams(temperature=1.0)), logits)


def test_draws_are_fixed_by_seed_and_step_and_follow_the_probabilities():
    probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0))
    assert draw(probs, 7, 3) == draw(probs, 7, 3)
    seq = [draw(probs, 7, s) for s in range(40)]
    assert seq != [draw(probs, 8, s) for s in range(40)]
    counts = torch.bincount(torch.tensor([draw(probs, 1, s) for s in range(4000)]), minlength=5).double() / 4000
    assert torch.allclose(counts, probs, atol=0.03), counts  # 4000 draws: sd <= 0.008
    masked = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert {draw(masked, 1, s) for s in range(300)} == {1, 3}


def test_greedy_and_top_k_1_are_the_argmax():
    row = torch.randn(512, generator=torch.Generator().manual_seed(0))
    best = int(torch.argmax(row))
    assert pick(row, SamplingParams(), [1, 2], 2, 0) == best
    for seed in range(5):
        assert pick(row, SamplingParams(temperature=1.3, top_k=1, seed=seed), [1, 2], 2, seed) == best
    assert pick(row, SamplingParams(temperature=0.7, min_p=1.0, seed=3), [1], 1, 0) == best
    # temperature 0 with a penalty: the argmax of the penalized logits
    pen = SamplingParams(presence_penalty=1e6)
    assert pick(row, pen, [1, best], 1, 1) == int(torch.argmax(torch.where(torch.arange(512) == best, -1e9, row)))


def test_logprobs_are_the_raw_log_softmax():
    row = torch.tensor([1.0, 3.0, 2.0, 3.0])
    lp, top = logprobs(row, 2, 3)
    ref = torch.log_softmax(row.double(), -1)
    assert lp == pytest.approx(float(ref[2]), abs=1e-12)
    assert [i for i, _ in top] == [1, 3, 2]  # the tie (ids 1, 3) by id
    assert [v for _, v in top] == pytest.approx([float(ref[1]), float(ref[3]), float(ref[2])], abs=1e-12)
    assert logprobs(row, 0, 0)[1] == ()


def test_uniforms_are_fixed_by_key_spread_over_the_unit_interval_and_never_0_or_1():
    from cpkv.engine.protocol import mix_seed
    from cpkv.engine.sampling import uniforms

    keys = torch.tensor([mix_seed(7, 3), mix_seed(7, 4), 0, (1 << 63) - 1], dtype=torch.int64)
    u = uniforms(keys, 50_000)
    assert torch.equal(u, uniforms(keys, 50_000)) and torch.equal(u[0], uniforms(keys[:1], 50_000)[0])
    assert bool((u > 0).all() and (u < 1).all())
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[2], u[3])
    for row in u:  # uniform: mean 1/2 (sd 0.0013), each decile a tenth (sd 0.0013)
        assert abs(float(row.mean()) - 0.5) < 0.01
        deciles = torch.histc(row.float(), bins=10, min=0, max=1) / row.numel()
        assert float((deciles - 0.1).abs().max()) < 0.01, deciles
    assert len(set(u[0].tolist())) == 50_000


def test_batched_device_picks_are_the_host_picks():
    """``sample_rows`` (the graphed decode step's pick, batched in tensors) gives ``pick``'s token for every row:
    greedy, temperature alone, top_k, top_p, min_p and together, rows of one batch with different parameters."""
    from cpkv.engine.protocol import mix_seed
    from cpkv.engine.sampling import device_ok, sample_rows

    gen = torch.Generator().manual_seed(11)
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, top_k=5, seed=2),
              SamplingParams(temperature=0.9, top_p=0.8, seed=3), SamplingParams(temperature=1.3, min_p=0.05, seed=4),
              SamplingParams(temperature=0.6, top_k=40, top_p=0.95, min_p=0.01, seed=5),
              SamplingParams(temperature=2.0, top_k=1, seed=6)]
    assert all(device_ok(p) for p in params)
    assert not device_ok(SamplingParams(temperature=1.0, repetition_penalty=1.1))
    assert not device_ok(SamplingParams(temperature=1.0, logprobs=2))
    picked = 0
    for step in range(12):
        logits = torch.randn(len(params), 3000, generator=gen) * (1 + step % 4)
        got = sample_rows(logits, torch.tensor([p.temperature for p in params], dtype=torch.float64),
                          torch.tensor([p.top_k for p in params], dtype=torch.int64),
                          torch.tensor([p.top_p for p in params], dtype=torch.float64),
                          torch.tensor([p.min_p for p in params], dtype=torch.float64),
                          torch.tensor([mix_seed(p.seed, step) for p in params], dtype=torch.int64))
        want = [pick(row, p, [1, 2, 3], 2, step) for row, p in zip(logits, params)]
        assert got.tolist() == want, (step, got.tolist(), want)
        picked += len({t for t, p in zip(want, params) if p.temperature > 0} - {int(r.argmax()) for r in logits})
    assert picked > 10  # the draws are not the argmax mostly: the race ran


def test_a_steps_picks_are_each_rows_own():
    """``pick_rows`` (the server's pick for a step's rows): greedy, device-drawn and host-picked rows (penalties,
    log-probabilities) side by side, each the token ``pick`` gives that row alone."""
    from cpkv.engine.sampling import pick_rows

    gen = torch.Generator().manual_seed(5)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.2, seed=2),
              SamplingParams(temperature=1.1, top_k=30, seed=3, logprobs=2), SamplingParams(temperature=0.5, seed=4)]
    rows = [torch.randn(2000, generator=gen) * 2 for _ in params]
    tokens = [[1, 2, 3, 4 + i, 9] for i in range(len(params))]
    steps = [3, 0, 7, 2, 5]
    want = [pick(r, p, t, 3, s) for r, p, t, s in zip(rows, params, tokens, steps)]
    assert pick_rows(rows, params, tokens, [3] * len(params), steps) == want
