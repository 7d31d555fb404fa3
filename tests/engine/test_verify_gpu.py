"""GPU: verification at real shapes (GLM-5 and DeepSeek-V3.2, 4 layers, ranks sharing one GPU) passes under the
run's own decisions, and each planted fault fails it (docs/design.md, "Verification")."""
from __future__ import annotations

import dataclasses

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)


def _cfg(model: str, cp: int, **kw):
    from cpkv.engine.config import EngineConfig

    return EngineConfig(model=model, num_layers=4, cp=cp, device="cuda", record=True, **kw)


@pytest.mark.parametrize("model", ["glm5", "deepseek-v32"])
def test_real_shapes_verify_at_cp_1_and_2_with_both_weights(model):
    """The README's GPU run and its fp8-weight twin, cp 1 and 2: every request verifies (ties and flips
    explained), and the report counts the decisions it compared."""
    from cpkv.bench.verify_cmd import Case, run_matrix

    cases = [Case(model, w, "fp8", cp, 0) for cp in (1, 2) for w in ("bf16", "fp8")]
    rows = run_matrix(cases, device="cuda", timeout_s=900)
    for r in rows:
        assert r["ok"], (r["cp"], r["weights"], r["failures"])
        assert r["decisions"]["route"]["compared"] > 0 and r["decisions"]["route"]["unforced"] == 0


@pytest.mark.parametrize("plant", ["expert", "combine", "page"])
def test_planted_faults_fail_verification_at_glm5_shapes(plant):
    """One expert's weight dropped for one token, one MoE output row zeroed, one KV page stale: each fails, and
    the same run without the fault passes (cp 2, bf16 weights, eager)."""
    from cpkv.cli.traces import default_trace
    from cpkv.engine.engine import run_jobs, verify_run
    from cpkv.engine.instruments import MeasureConfig

    trace = default_trace(6)
    clean = _cfg("glm5", 2, graph_tokens=0)
    ok, bad = run_jobs([(clean, trace), (clean, trace, MeasureConfig(plant=plant))], timeout_s=900)
    assert verify_run(ok, trace).ok
    rep = verify_run(bad, trace)
    assert not rep.ok and rep.failures, plant


def test_planted_index_fault_fails_verification_on_the_gpu():
    """The tiny preset (top-k 64: the built-in trace runs sparse selection): one replaced selection fails."""
    from cpkv.cli.traces import default_trace
    from cpkv.engine.engine import run_jobs, verify_run
    from cpkv.engine.instruments import MeasureConfig

    trace = default_trace(6)
    clean = _cfg("tiny", 2, graph_tokens=0)
    ok, bad = run_jobs([(clean, trace), (clean, trace, MeasureConfig(plant="index"))], timeout_s=900)
    assert verify_run(ok, trace).ok
    rep = verify_run(bad, trace)
    assert not rep.ok and rep.decisions["index"].unexplained >= 1
