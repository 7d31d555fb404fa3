"""Non-finite logits fail a run, verified or not, and the error names the request and the first layer where
the hidden states went non-finite (a single-process rerun with a check after each layer).

NaN weights are refused at load now, so the engine path is fed a non-finite value in two other ways: NaN
weights injected in-process (a DSAModel built from a weights dict skips the checkpoint checks), and, through
the CLI, a checkpoint of finite weights that overflow float32 in its last layer (passes every load check)."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpkv.config import preset
from cpkv.engine.config import EngineConfig
from cpkv.engine.engine import (RequestResult, RunResult, first_nonfinite, nonfinite_failure, verify_run)
from cpkv.errors import NonFiniteError
from cpkv.model.model import DSAModel
from cpkv.model.weights import random_weights, save_checkpoint
from cpkv.scheduler.trace import TraceRequest, materialize_tokens

TINY = preset("tiny")
SRC = str(Path(__file__).resolve().parents[2] / "src")
TRACE = [TraceRequest("a0", 0.0, 90, None, None), TraceRequest("b0", 0.0, 70, None, None)]  # in-process tests
LAST = TINY.num_layers - 1
O_PROJ = f"model.layers.{LAST}.self_attn.o_proj.weight"


_MODELS: dict = {}


def model_with(edit=None) -> DSAModel:
    """The tiny model, its weights edited in-process (built once per edit for the module)."""
    if edit not in _MODELS:
        weights = random_weights(TINY, seed=0)
        if edit:
            edit(weights)
        _MODELS[edit] = DSAModel(TINY, weights)
    return _MODELS[edit]


def _nan_in(n: int):
    def edit(w):
        w[f"model.layers.{n}.self_attn.q_a_proj.weight"][0, 0] = math.nan
    return edit


_NAN_EDITS = {n: _nan_in(n) for n in range(TINY.num_layers)}


def nan_in_layer(n: int):
    return _NAN_EDITS[n]


def overflow_last_layer(w):
    w[O_PROJ].fill_(3e38)  # finite, but its products overflow float32


def result_of(model: DSAModel, logits_fn=None) -> RunResult:
    tokens = materialize_tokens(TRACE, vocab_size=TINY.vocab_size)
    reqs = []
    for r in TRACE:
        lg = model.reference_prefill(tokens[r.id]) if logits_fn is None else logits_fn(tokens[r.id])
        reqs.append(RequestResult(r.id, r.prompt_len, 0, 0.0, int(lg.argmax()), lg))
    return RunResult(EngineConfig(), reqs, [], 1.0, [0, 0], {})


@pytest.fixture(scope="module")
def clean():
    return model_with()


@pytest.mark.parametrize("layer", [1, LAST])
def test_first_nonfinite_names_the_layer_of_a_nan_weight(layer):
    model = model_with(nan_in_layer(layer))
    tokens = materialize_tokens(TRACE, vocab_size=TINY.vocab_size)[TRACE[0].id]
    assert not bool(torch.isfinite(model.reference_prefill(tokens)).all())
    assert first_nonfinite(model, tokens) == f"after layer {layer} (of {TINY.num_layers})"


def test_first_nonfinite_of_an_overflow_and_of_a_clean_model(clean):
    tokens = materialize_tokens(TRACE, vocab_size=TINY.vocab_size)[TRACE[0].id]
    assert first_nonfinite(model_with(overflow_last_layer), tokens) == f"after layer {LAST} (of {TINY.num_layers})"
    assert first_nonfinite(clean, tokens) is None


def test_verify_fails_nan_logits_of_the_run_never_diff_zero(clean):
    """The CP path's logits are NaN, the reference's finite: FAILED, the request listed, the diff of NaN never
    reported as 0, and the layer search says the reference stays finite."""
    res = result_of(clean, lambda toks: torch.full((TINY.vocab_size,), math.nan))
    rep = verify_run(res, TRACE, model=clean)
    assert not rep.ok and not rep.tokens_equal
    assert [e["id"] for e in rep.nonfinite] == [r.id for r in TRACE]
    assert rep.nonfinite[0]["run"] == f"{TINY.vocab_size} NaN of {TINY.vocab_size} logits"
    assert rep.nonfinite[0]["reference"] is None and rep.nonfinite[0]["where"] is None
    err = nonfinite_failure(res, TRACE, rep)
    assert isinstance(err, NonFiniteError)
    assert str(err) == (f"request {TRACE[0].id!r}: {TINY.vocab_size} NaN of {TINY.vocab_size} logits (its "
                        "single-process rerun stays finite: the CP path produced them); 2 of 2 requests have "
                        "non-finite logits")


def test_verify_names_the_layer_of_nan_weights():
    model = model_with(nan_in_layer(LAST))
    res = result_of(model)
    rep = verify_run(res, TRACE, model=model)
    assert not rep.ok and len(rep.nonfinite) == 2
    assert rep.nonfinite[0]["where"] == f"after layer {LAST} (of {TINY.num_layers})"
    assert math.isfinite(rep.max_logit_diff)
    assert f"first non-finite hidden state after layer {LAST} (of {TINY.num_layers})" in \
        str(nonfinite_failure(res, TRACE, rep))


def test_no_verify_path_reruns_the_first_bad_request():
    model = model_with(nan_in_layer(1))
    res = result_of(model)
    err = nonfinite_failure(res, TRACE, None, model=model)
    assert str(err).startswith(f"request {TRACE[0].id!r}: ") and "after layer 1 (of 3)" in str(err)


def test_finite_run_passes(clean):
    res = result_of(clean)
    assert nonfinite_failure(res, TRACE, None, model=clean) is None
    rep = verify_run(res, TRACE, model=clean)
    assert rep.ok and rep.nonfinite == [] and nonfinite_failure(res, TRACE, rep) is None


def test_run_report_says_failed_not_passed(clean, capsys):
    """``cpkv run``'s verification line for a run with NaN logits: FAILED, never PASSED, never "diff 0"."""
    from types import SimpleNamespace

    from cpkv.cli.run_cmd import show

    res = result_of(clean, lambda toks: torch.full((TINY.vocab_size,), math.nan))
    res.stats = {"mode": "symm", "attention": {"dense": 0, "sparse": 0}}
    show(res, verify_run(res, TRACE, model=clean), SimpleNamespace(allow_rejected=False),
         {"command_s": 1.0, "ranks_s": 1.0, "verify_s": 0.0})
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("verification against a single rank: FAILED (2 of 2 requests with non-finite logits")
    assert "PASSED" not in line


@pytest.mark.slow
def test_cli_run_with_overflowing_weights_fails(tmp_path):
    """The real engine (2 rank processes) on a checkpoint that passes every load check but overflows in its last
    layer: under --no-verify too, exit 2 and one line naming the request and the layer."""
    verify = "--no-verify"
    weights = random_weights(TINY, seed=0)
    overflow_last_layer(weights)
    save_checkpoint(tmp_path, TINY, weights)
    out = subprocess.run([sys.executable, "-m", "cpkv", "run", "--model", str(tmp_path), "--requests", "2",
                          "--precision", "exact", verify], capture_output=True, text=True,
                         env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=300)
    assert out.returncode == 2, out.stderr
    last = out.stderr.splitlines()[-1]  # before it: progress lines only (a loaded machine prints some)
    assert out.stderr.count("error") == 1 and last.startswith("cpkv run: error: request ")
    assert f"first non-finite hidden state after layer {LAST} (of {TINY.num_layers})" in last
    assert last.endswith("2 of 2 requests have non-finite logits")  # the CLI's built-in trace, --requests 2
