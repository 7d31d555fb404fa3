"""The sparse decode kernel compiled OFFLINE for sm_90a (Triton's bundled ptxas, no GPU), as a launch at GLM-5's
shapes specialises it (64 heads, 512 + 64 dims, K = 2048, two pools, 132 SMs):

  * every launch shape ``cpkv bench attention --decode --sweep`` times at B 1, 8, 32 and 64 or 128 heads asks at
    most 200 KB of shared memory (Hopper gives a program 227 KB; a swept shape that asked 319 KB failed on the GPU);
  * the defaults (``decode.DEFAULTS``) spill nothing, and the 64-head one keeps its rows double-buffered (two
    shared-memory slots of the fp8 tile: one tile in flight while the other is computed), its one-split form too.

Skipped without Triton or its NVIDIA tools.
"""
from __future__ import annotations

import pytest
import torch
from offline_sm90 import compile_sm90, ptxas_and_sass

pytest.importorskip("triton")

from cpkv.attention.ref import GLM5_TOKEN  # noqa: E402
from cpkv.bench.attention_decode import sweep_configs  # noqa: E402
from cpkv.config import RowFormat  # noqa: E402
from cpkv.kernels.sparse_mla import decode as dk  # noqa: E402

pytestmark = pytest.mark.triton
SMS, K, SMEM_CAP = 132, 2048, 200 * 1024
TINY = RowFormat(128, 1, 32)


def _shape_key(cfg: dk.DecodeConfig) -> tuple:
    """What the split kernel's code depends on (splits, per_sm and the combine only change the launch)."""
    return cfg.block_h, cfg.block_k, cfg.block_v, cfg.num_warps, cfg.num_stages, cfg.scale_gather, cfg.chained


def _swept() -> list[dk.DecodeConfig]:
    seen: dict[tuple, dk.DecodeConfig] = {}
    for h in (64, 128):
        for b in (1, 8, 32):
            for cfg in sweep_configs(b, h, K, SMS):
                seen.setdefault(_shape_key(cfg), cfg)
    return list(seen.values())


def compile_split(cfg: dk.DecodeConfig, fmt: RowFormat = GLM5_TOKEN, h: int = 64, b: int = 32, splits: int = 4):
    """The split kernel of a launch of ``cfg`` over CPU stand-ins of its arguments, compiled for sm_90a."""
    d = fmt.fp8_bytes + fmt.rope_dims
    q = torch.empty(b, h, d, dtype=torch.bfloat16)
    bases = torch.zeros(2, dtype=torch.int64)
    owner, row = torch.zeros(b, K, dtype=torch.int32), torch.zeros(b, K, dtype=torch.int32)
    wo, wl = torch.empty(b, splits, h, fmt.fp8_bytes), torch.empty(b, splits, h)
    out, lse = torch.empty(b, h, fmt.fp8_bytes, dtype=torch.bfloat16), torch.empty(b, h)
    block_v = dk.check_config(cfg, fmt.fp8_bytes)
    _, args, consts = dk.split_launch(q, bases, owner, row, wo, wl, out, lse, 0.07, fmt, cfg, block_v,
                                      (splits, dk.cdiv(K, splits)), True)
    options = {name: consts.pop(name) for name in ("num_warps", "num_stages")}
    return compile_sm90(dk.load()[0], args, consts, **options)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", _swept(), ids=lambda c: c.tag().replace(" ", "-"))
def test_every_swept_shape_fits_hoppers_shared_memory(cfg):
    ck = compile_split(cfg)
    assert ck.metadata.shared <= SMEM_CAP, f"{cfg.tag()}: {ck.metadata.shared} bytes of shared memory"


@pytest.mark.parametrize("fmt,h,splits", [(GLM5_TOKEN, 64, 4), (GLM5_TOKEN, 64, 1), (GLM5_TOKEN, 128, 2),
                                          (TINY, 4, 4)], ids=["glm5", "glm5-direct", "v32", "tiny"])
def test_the_default_spills_nothing_and_double_buffers_its_rows(fmt, h, splits, tmp_path):
    cfg = dk.default_config(h, 32)
    ck = compile_split(cfg, fmt, h, splits=splits)
    report, _ = ptxas_and_sass(ck, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert ck.metadata.shared <= SMEM_CAP
    g = fmt.scale_count
    assert f"!ttg.memdesc<2x{cfg.block_k}x{g}x128xf8E4M3FN" in ck.asm["ttgir"], "the fp8 tile is not double-buffered"
