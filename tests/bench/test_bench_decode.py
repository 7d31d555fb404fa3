"""``cpkv bench decode`` on the CPU (tiny model): every case timed, its floor counted from the step it ran."""
from __future__ import annotations

import json

import pytest

from cpkv.cli import main

pytestmark = pytest.mark.slow


def test_cases_report_step_time_floor_and_ratio(capsys):
    rc = main(["bench", "decode", "--device", "cpu", "--cp", "2", "--page-size", "16", "--keys", "48,100",
               "--batches", "1,3", "--steps", "2", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    cases = rep["cases"]
    assert [(c["keys"], c["batch"]) for c in cases] == [(48, 1), (48, 3), (100, 1), (100, 3)]
    for c in cases:
        assert c["step_ms"] > 0 and c["floor_bytes"] > 0
        assert c["ratio_to_floor"] == pytest.approx(c["step_ms"] / c["floor_ms"], rel=1e-6)
    # the floor grows with the generations and the context a step reads
    by = {(c["keys"], c["batch"]): c["floor_bytes"] for c in cases}
    assert by[(48, 3)] > by[(48, 1)] and by[(100, 1)] > by[(48, 1)]


def test_bad_lists_are_one_line_naming_the_flag(capsys):
    assert main(["bench", "decode", "--keys", "12,x"]) == 2
    assert "--keys" in capsys.readouterr().err
