"""Offline sm_90a compiles for the tests (no GPU): a Triton / Gluon kernel compiled from CPU stand-ins of its
arguments, as a launch would specialise it, and ptxas's report and the SASS of the result, with the tools Triton's
NVIDIA backend ships. Imported by the kernels' compile tests (tests/ is on the path: tests/conftest.py's folder)."""
from __future__ import annotations

import os
import subprocess

import pytest


def nvidia_tool(name: str) -> str:
    """Path of Triton's bundled ``name`` (ptxas, cuobjdump); skips the test when the backend ships none."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        pytest.skip(f"Triton's NVIDIA backend ships no {name} here")
    return path


def compile_sm90(fn, args: tuple, consts: dict, **options):
    """``fn`` (a Triton or Gluon JIT function) compiled for sm_90a from CPU stand-ins of its arguments: constexprs
    from ``consts``, the other arguments specialised as a launch would (16-byte divisibility included)."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    sig, cx, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name], cx[(i,)] = "constexpr", consts[name]
            continue
        ty, spec = native_specialize_impl(BaseBackend, args[i], False, True, True)
        sig[name] = ty
        if ty == "constexpr":
            cx[(i,)] = args[i]
        elif isinstance(spec, str) and "D" in spec:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource
    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
        if isinstance(fn, GluonJITFunction):
            source = GluonASTSource
    except ImportError:  # a Triton without Gluon: plain Triton kernels only
        pass
    return triton.compile(source(fn, sig, cx, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_and_sass(ck, tmp_path) -> tuple[str, str]:
    """(ptxas -v's report of the compiled kernel's PTX for sm_90a, the SASS of its cubin)."""
    ptxas, cuobjdump = nvidia_tool("ptxas"), nvidia_tool("cuobjdump")
    (tmp_path / "k.ptx").write_text(ck.asm["ptx"])
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (tmp_path / "k.cubin").write_bytes(ck.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                          timeout=300).stdout
    return out.stderr, sass
