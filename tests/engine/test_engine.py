"""The CP engine across real rank processes (gloo on CPU), checked against a single-rank reference.

Each launch runs several jobs in one set of rank processes to keep CI time low.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cpkv.engine.config import MODES, EngineConfig
from cpkv.engine.engine import RunResult, run_jobs, verify_run
from cpkv.engine.instruments import MeasureConfig
from cpkv.cli.traces import default_trace
from cpkv.errors import ConfigError, RankFailure
from cpkv.model import load_model
from cpkv.scheduler.trace import TraceRequest, materialize_tokens

pytestmark = pytest.mark.slow

BASE = EngineConfig(page_size=16, pages_per_rank=128, chunk_size=256, max_requests=4)


def req(rid: str, n: int, parent: str | None = None, t: float = 0.0) -> TraceRequest:
    return TraceRequest(rid, t, n, None, parent)


# a conversation (hits), a fresh prompt, a prompt chunked at 256, a short one
TRACE = [req("a0", 150), req("b0", 90), req("a1", 170, "a0"), req("c0", 300), req("a2", 181, "a1"),
         req("d0", 40)]
# prompts no longer than the tiny top-k (64): every rank takes the dense short path
SHORT = [req("s0", 40), req("s1", 64), req("s2", 17)]


class MemoReference:
    """The single-rank reference model, each prompt computed once for the whole module."""

    def __init__(self) -> None:
        self.model = load_model("tiny", seed=0)
        self.cfg = self.model.cfg
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def reference_prefill(self, tokens, tap=None, cuts=()) -> torch.Tensor:
        if tap is not None or cuts:  # a run's own decisions, or the numerics floor: not memoised
            return self.model.reference_prefill(tokens, tap=tap, cuts=cuts)
        key = tuple(tokens)
        if key not in self.memo:
            self.memo[key] = self.model.reference_prefill(tokens)
        return self.memo[key]


@pytest.fixture(scope="module")
def reference():
    return MemoReference()


def assert_verified(res: RunResult, trace, reference) -> None:
    rep = verify_run(res, trace, model=reference)
    assert rep.checked == len(res.requests)
    assert rep.tokens_equal and rep.ok, rep


def logits(res: RunResult) -> dict:
    return {r.id: r.logits for r in res.requests}


@pytest.fixture(scope="module")
def cp2_runs():
    cold = [TraceRequest(r.id, 0.0, r.prompt_len, tuple(materialize_tokens(TRACE)[r.id]))
            for r in TRACE if r.parent is not None]
    oversized = [req("ok0", 100), req("huge", 70000), req("big", 2100), req("ok1", 120, "ok0")]
    jobs = [(dataclasses.replace(BASE, mode=m), TRACE) for m in MODES]
    jobs += [(BASE, [r]) for r in cold]
    jobs.append((dataclasses.replace(BASE, pages_per_rank=64), oversized))
    jobs.append((BASE, SHORT))
    return run_jobs(jobs, timeout_s=300)


# no parents: every batch after the first is formed and planned while the one before runs (look-ahead)
AHEAD = [req("x0", 700), req("y0", 300), req("z0", 90)]


@pytest.mark.parametrize("mode", MODES)
def test_cp2_every_mode_matches_single_rank(cp2_runs, reference, mode):
    res = cp2_runs[MODES.index(mode)]
    assert [r.id for r in res.requests] == [r.id for r in TRACE] and not res.rejected
    assert res.stats["mode"] == mode
    assert_verified(res, TRACE, reference)
    if mode == "prefetch":
        assert all(len(b) == 1 for b in res.stats["batch_log"])
        assert res.stats["prefetch_hits"] > 0
    else:
        assert any(len(b) > 1 for b in res.stats["batch_log"])


def test_modes_give_identical_logits(cp2_runs):
    """Compose is byte-exact whichever mode runs, so equal batches give bit-equal logits."""
    base = logits(cp2_runs[0])
    for res in cp2_runs[1:4]:  # legacy, fused, v2, symm share batch composition
        assert all(torch.equal(base[k], v) for k, v in logits(res).items())


def test_default_run_uses_sparse_selection_and_hits(cp2_runs):
    res = cp2_runs[MODES.index("symm")]
    att = res.stats["attention"]
    assert att["sparse"] > 0
    cached = {r.id: r.cached_len for r in res.requests}
    assert cached["a1"] == 144 and cached["a2"] == 160 and cached["b0"] == 0
    assert res.summary["cache_hit_ratio"] > 0.3
    chunked = [e for b in res.stats["batch_log"] for e in b if e[0] == "c0"]
    assert [(e[1], e[2]) for e in chunked] == [(0, 256), (256, 44)]


def test_prefix_hits_match_the_same_requests_run_cold(cp2_runs):
    hit, cold = cp2_runs[MODES.index("symm")], cp2_runs[len(MODES):-2]
    cold = [res.requests[0] for res in cold]
    assert [r.id for r in cold] == ["a1", "a2"] and all(r.cached_len == 0 for r in cold)
    hot = logits(hit)
    for r in cold:
        assert r.first_token == int(hot[r.id].argmax())
        assert torch.allclose(hot[r.id], r.logits, atol=1e-3, rtol=1e-3), r.id


def test_short_prompts_take_the_dense_path_on_every_rank(cp2_runs, reference):
    res = cp2_runs[-1]
    assert res.stats["attention"]["sparse"] == 0 and res.stats["attention"]["dense"] > 0
    assert_verified(res, SHORT, reference)


def test_oversized_requests_are_rejected_beside_completed_ones(cp2_runs, reference):
    res = cp2_runs[-2]
    assert [r.id for r in res.requests] == ["ok0", "ok1"]
    reasons = {x["id"]: x["reason"] for x in res.rejected}
    assert reasons["huge"].startswith("max_context") and "65536" in reasons["huge"]
    assert reasons["big"].startswith("pool_pages")
    assert res.requests[1].cached_len == 96
    assert_verified(res, [req("ok0", 100), req("ok1", 120, "ok0")], reference)
    assert res.summary["kv_pages_replicated"] == sum(res.summary["kv_pages_per_rank"])


# -- cp = 3: host tier, mixed chunk batches ------------------------------------------------------------
HOST_TRACE = [req("a0", 256), req("b0", 400), req("c0", 400), req("a1", 272, "a0")]
MIX_TRACE = [req("p0", 200), req("x0", 1100), req("p1", 216, "p0"), req("q0", 60)]


@pytest.fixture(scope="module")
def cp3_runs():
    base = dataclasses.replace(BASE, cp=3, chunk_size=512)
    return run_jobs([(dataclasses.replace(base, pages_per_rank=12, host_pages=48), HOST_TRACE),
                     (dataclasses.replace(base, policy="mix"), MIX_TRACE),
                     (base, TRACE),
                     (dataclasses.replace(base, pages_per_rank=40, host_pages=64, policy="mix", mode="v2"),
                      default_trace(12))], timeout_s=300)


def test_cp3_matches_single_rank(cp3_runs, reference):
    assert_verified(cp3_runs[2], TRACE, reference)


def test_host_tier_spills_and_reloads(cp3_runs, reference):
    res = cp3_runs[0]
    s = res.summary
    assert s["pages_spilled"] > 0 and s["pages_reloaded"] > 0
    assert {r.id: r.cached_len for r in res.requests}["a1"] == 256  # a0's pages came back from the host
    assert_verified(res, HOST_TRACE, reference)


def test_mix_policy_shares_batches_after_a_tail_chunk(cp3_runs, reference):
    res = cp3_runs[1]
    shared = [b for b in res.stats["batch_log"] if len(b) > 1 and any(e[3] and e[4] for e in b)]
    assert shared, res.stats["batch_log"]
    assert {r.id: r.cached_len for r in res.requests}["p1"] == 192
    assert_verified(res, MIX_TRACE, reference)


def test_host_tier_under_pressure_with_peer_gathers(cp3_runs, reference):
    """Reloaded pages are read by peers' v2 gathers before any collective: the engine syncs first.
    Pages inserted under a spilled parent leave device nodes after host nodes in a chain."""
    res = cp3_runs[3]
    assert res.summary["pages_reloaded"] > 0 and not res.rejected
    assert_verified(res, default_trace(12), reference)


# -- failures --------------------------------------------------------------------------------------
def test_a_dying_rank_is_named():
    with pytest.raises(RankFailure, match="rank 1 died"):
        run_jobs([(BASE, TRACE, MeasureConfig(fault=(1, 2)))], timeout_s=120, grace_s=1.0)


def test_bad_config():
    with pytest.raises(ConfigError, match="compose mode"):
        EngineConfig(mode="nope")
    with pytest.raises(ConfigError, match="multiple of page_size"):
        EngineConfig(chunk_size=100)


def test_look_ahead_plans_the_next_batch_without_changing_anything(reference):
    """The next batch formed and planned while the one before runs: the same batches, the same logits bytes."""
    ahead, plain = run_jobs([(BASE, AHEAD), (dataclasses.replace(BASE, look_ahead=False), AHEAD)], timeout_s=300)
    assert_verified(ahead, AHEAD, reference)
    assert ahead.stats["batch_log"] == plain.stats["batch_log"] and len(ahead.stats["batch_log"]) >= 3
    assert ahead.stats["planned_ahead"] == len(ahead.stats["batch_log"]) - 1 and plain.stats["planned_ahead"] == 0
    # every batch with a successor planned ahead is chained on (the next one launched without waiting for its
    # end), those finishing requests included (their results taken after the next launch): every batch still
    # has its time, every request its own
    finishing = sum(any(last for *_, last in b) for b in ahead.stats["batch_log"][:-1])
    assert finishing >= 1 and ahead.stats["chained"] == ahead.stats["planned_ahead"] and plain.stats["chained"] == 0
    assert [r.id for r in ahead.requests] == [r.id for r in plain.requests]
    assert all(r.ttft_s > 0 for r in ahead.requests)
    for res in (ahead, plain):
        assert len(res.stats["batch_s"]) == len(res.stats["batch_log"]) and all(t > 0 for t in res.stats["batch_s"])
    a, b = logits(ahead), logits(plain)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
