"""The shared layouts the Gluon launchers build once per shape (``key_layout``, ``smem_layout``) equal the ones
Gluon builds fresh, for every shape and dtype the launchers ask for. CPU only; skipped where Gluon's Hopper API
does not import."""
from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from triton.experimental.gluon import language as gl  # noqa: E402

from cpkv.kernels.fp8_gemm import gluon_ws  # noqa: E402
from cpkv.kernels.mqa_logits import gluon as logits_gluon  # noqa: E402


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rows", [64, 128])
def test_key_layout_is_gluons(d, rows):
    got = logits_gluon.key_layout(d, rows)
    assert got == gl.NVMMASharedLayout.get_default_for([rows, d], gl.float8e4nv)
    assert logits_gluon.key_layout(d, rows) is got  # built once


@pytest.mark.parametrize("dtype", sorted(set(gluon_ws._AB_TYPES.values()) | set(gluon_ws._C_TYPES.values())))
@pytest.mark.parametrize("shape", [(128, 128), (256, 128), (64, 128), (128, 64)])
def test_smem_layout_is_gluons(shape, dtype):
    got = gluon_ws.smem_layout(*shape, dtype)
    assert got == gl.NVMMASharedLayout.get_default_for(list(shape), getattr(gl, dtype))
    assert gluon_ws.smem_layout(*shape, dtype) is got
