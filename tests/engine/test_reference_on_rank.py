"""cp 1: verification's reference on rank 0's own model (``EngineConfig.reference = "rank"``: one copy of the
weights, as a full-depth GLM-5 rank needs on one GPU) makes the report the parent's second model makes."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from cpkv.engine.config import EngineConfig
from cpkv.engine.engine import run_engine, verify_run
from cpkv.errors import ConfigError
from cpkv.scheduler.trace import TraceRequest

BASE = EngineConfig(cp=1, num_layers=2, page_size=16, pages_per_rank=128, chunk_size=256, max_requests=4,
                    record=True)
# a conversation (a cached turn), a prompt past the tiny top-k (64) chunked at 256, a short one
TRACE = [TraceRequest("a0", 0.0, 150, None, None), TraceRequest("c0", 0.0, 300, None, None),
         TraceRequest("a1", 0.0, 170, None, "a0"), TraceRequest("d0", 0.0, 40, None, None)]


def test_the_ranks_reference_reports_what_the_parents_does():
    result = run_engine(dataclasses.replace(BASE, reference="rank"), TRACE)
    assert result.verify is not None and result.stats["verify_s"] > 0
    parent = verify_run(result, TRACE)  # a second model, loaded here
    assert result.verify.to_json() == parent.to_json()
    assert result.verify.ok and result.verify.decisions["route"].compared > 0
    assert result.stats["load_s_per_rank"][0] > 0


def test_a_reference_on_a_rank_needs_cp_1():
    with pytest.raises(ConfigError, match="reference 'rank' needs cp 1"):
        EngineConfig(cp=2, reference="rank")
    with pytest.raises(ConfigError, match="reference must be one of parent, rank"):
        EngineConfig(cp=1, reference="gpu")


@pytest.mark.slow
def test_run_says_where_its_reference_ran():
    import os

    env = {**os.environ, "CPKV_PROGRESS_S": "0"}  # every progress line, the rank's own included
    out = subprocess.run([sys.executable, "-m", "cpkv", "run", "--cp", "1", "--num-layers", "2", "--requests", "3",
                          "--reference", "rank", "--json"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    # the verification on rank 0 (invisible to the parent's bar) says how far it is, request by request
    assert [line for line in out.stderr.splitlines() if "verifying on rank 0" in line][-1].startswith(
        "cpkv run: verifying on rank 0: 3 of 3 requests"), out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["reference"] == "rank" and report["verify"]["ok"]
    assert report["summary"]["load_s_per_rank"][0] > 0 and report["plan_vs_peak"] is None  # CPU: nothing measured
