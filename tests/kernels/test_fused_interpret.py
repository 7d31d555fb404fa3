"""The fused elementwise kernels (kernels/add_norm, token_rows, rope, index_rows' head weights, swiglu, combine; the
index rows themselves are ``elem_cases.py``'s) under Triton's interpreter on CPU, against their pure-torch
references: each case of ``fused_cases.py`` in its own subprocess with TRITON_INTERPRET=1 (Triton reads it when a kernel is defined, so it must be set before the kernel modules load).
Skipped without Triton. Tolerances: in ``fused_cases.py`` (bytes exact given the kernel's normed values; the
normed values within one ulp of the reference).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from interpreted import run_interpreted

pytestmark = pytest.mark.triton  # skipped without Triton (tests/conftest.py)

HERE = Path(__file__).resolve().parent
CASES = re.findall(r"^def case_(\w+)\(", (HERE / "fused_cases.py").read_text(), re.M)  # every case there


def test_every_case_is_found():
    assert len(CASES) >= 8 and "dispatch" in CASES


@pytest.mark.parametrize("case", CASES)
def test_fused_kernel_under_the_interpreter(case):
    run = run_interpreted([str(HERE / "fused_cases.py"), case])
    if run.returncode == 77:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, f"{case}: {run.stdout[-2000:]}{run.stderr[-4000:]}"
    assert f"{case}: ok" in run.stdout
