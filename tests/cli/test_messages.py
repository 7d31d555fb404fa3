"""Messages a user reads: strict JSON (no NaN), tables that control characters cannot garble, the right flag
blamed for a logits budget, symlink loops named as such."""
from __future__ import annotations

import json
import os

import pytest

from cpkv.cli import main
from cpkv.cli.fmt import emit_json, printable, table
from cpkv.errors import CheckpointError, ConfigError


def test_json_output_has_no_nan(capsys):
    emit_json({"p50": float("nan"), "max": float("inf"), "runs": [{"x": -float("inf"), "y": 1.5}], "n": 3})
    out = capsys.readouterr().out
    assert json.loads(out) == {"p50": None, "max": None, "runs": [{"x": None, "y": 1.5}], "n": 3}
    assert "NaN" not in out and "Infinity" not in out


def test_replay_refuses_a_cost_that_would_overflow_and_its_largest_cost_gives_strict_json(tmp_path, capsys):
    """A --costs figure of 1e308 s per token (times would overflow to inf, percentiles to NaN) is refused when the
    file is read, naming the file and the field; at the largest figure accepted the report is strict JSON with
    finite times."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"linear_s_per_token": 1e308}))
    assert main(["replay", "--requests", "5", "--scale", "0.01", "--costs", str(costs), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (f"cpkv replay: error: {costs}: linear_s_per_token must be a finite "
                                                   "number >= 0 and <= 1e+06, got 1e+308\n")
    costs.write_text(json.dumps({"linear_s_per_token": 1e6, "attention_s_per_pair": 1e6}))
    assert main(["replay", "--requests", "5", "--scale", "0.01", "--costs", str(costs), "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    ttft = report["runs"][0]["ttft_s"]
    assert ttft["max"] is not None and ttft["max"] > 1e6


def test_control_characters_are_escaped_in_tables(capsys):
    assert printable("a\x1b[2Jb\nc\td\x7f") == "a\\x1b[2Jb\\nc\\td\\x7f"
    assert printable("plain é ✓") == "plain é ✓"
    table(("id", "what"), [("r\x1b[31m1", "x\ry")])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "r\\x1b[31m1" in out


def test_a_request_id_with_control_characters_prints_escaped(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"id": "a\u001b[2J", "arrival": 0, "prompt_len": 70000}) + "\n")
    assert main(["run", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "a\\x1b[2J" in err, err


def test_a_logits_budget_rejection_blames_the_variable_not_chunk_size(monkeypatch, capsys):
    monkeypatch.setenv("CPKV_MQA_LOGITS_CHUNK_MAX_GB", "0.000001")  # 1073 B: a row of 269 keys is too wide
    assert main(["run"]) == 2
    err = capsys.readouterr().err
    assert "logits_budget" in err and "raise CPKV_MQA_LOGITS_CHUNK_MAX_GB" in err, err
    assert "lower --chunk-size" not in err


def test_symlink_loops_are_named_as_loops(tmp_path, capsys):
    from cpkv.model.checkpoint import checkpoint_files
    from cpkv.model.config import load_model_config

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shard.safetensors"}}))
    os.symlink("shard.safetensors", ck / "shard.safetensors")  # points at itself
    with pytest.raises(CheckpointError, match="names shard shard.safetensors, which .* holds only as a symlink loop"):
        checkpoint_files(ck)
    os.symlink("config.json", ck / "config.json")
    with pytest.raises(ConfigError, match="config.json: the directory holds only as a symlink loop"):
        load_model_config(str(ck))
