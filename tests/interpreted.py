"""Running kernel code under Triton's interpreter on CPU tensors, in a subprocess (Triton reads TRITON_INTERPRET
when a kernel is defined, so it must be set before the kernel modules load)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
KERNEL_CASES = TESTS / "kernels"  # fused_cases.py / elem_cases.py: the cases and the interpreter patches


def run_interpreted(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python *args`` with TRITON_INTERPRET=1, no CUDA device, and src/ and tests/kernels on its path (the
    checkout's cpkv, and the interpreter patches of ``fused_cases``)."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    path = [str(TESTS.parent / "src"), str(KERNEL_CASES), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
