"""The examples README points to keep working."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_compose_two_ranks_example_gives_the_same_dense_buffer_on_both_ranks():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "compose_two_ranks.py")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("rank 0") and lines[1].startswith("rank 1")
    assert lines[0].split(":", 1)[1] == lines[1].split(":", 1)[1]  # same shape, writers and byte sum
