"""The paged logits runs kernel (cpkv.kernels.mqa_logits.paged) compiled OFFLINE for sm_90a at GLM-5 shapes
(Triton's bundled ptxas / cuobjdump, no GPU): no spills, the default config within 64 registers (eight programs of
4 warps per SM), each thread's key loads 4-byte loads at constant offsets from one address per run, and the
table read per run (a fixed number of 64-bit loads, whatever the tile). Skipped without Triton or its tools."""
from __future__ import annotations

import re

import pytest
import torch
from offline_sm90 import compile_sm90, ptxas_and_sass

pytest.importorskip("triton")

from cpkv.kernels.mqa_logits import paged  # noqa: E402
from cpkv.kernels.mqa_logits.config import PagedLogitsConfig  # noqa: E402

B, H, D, P, L = 32, 32, 128, 64, 32768
CONFIGS = {"default": paged.DEFAULT_CONFIG, "s256_w8": PagedLogitsConfig(256, 1, 8, maxnreg=None)}


def _compile(cfg: PagedLogitsConfig):
    q = torch.zeros(B, H, D, dtype=torch.float8_e4m3fn)
    w, tab, one = torch.zeros(B, H), torch.zeros(B, L // P, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
    out = torch.zeros(B, L)
    args = (q, w, torch.zeros(2, dtype=torch.int64), tab, tab, one, one, out, 1 << 40, (1 << 40) + 4096, L,
            q.stride(0), w.stride(0), tab.stride(0), out.stride(0))
    run = min(P, cfg.block_s)
    consts = dict(H=H, HP=H, D=D, P=P, PK=run, NPG=cfg.block_s // run, SPAN=cfg.span, CAST_BF16=False)
    fn = paged.paged_logits_runs_kernel
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        options["maxnreg"] = cfg.maxnreg
    return compile_sm90(fn, args + (None,) * (len(fn.arg_names) - len(args)), consts, **options)


@pytest.mark.triton
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_runs_kernel_compiles_to_run_loads(name, tmp_path):
    cfg = CONFIGS[name]
    report, sass = ptxas_and_sass(_compile(cfg), tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    if cfg.maxnreg:
        assert int(re.search(r"Used (\d+) registers", report).group(1)) <= cfg.maxnreg, report
    threads = 32 * cfg.num_warps
    words = re.findall(r"LDG\.E R\d+, desc\[UR\d+\]\[(R\d+)\.64(?:\+0x[0-9a-f]+)?\]", sass)
    # the keys' 4-byte words, then the scales (one a key)
    assert len(words) == cfg.block_s * D // (4 * threads) + cfg.block_s // threads, sass
    assert len(set(words)) <= 2, f"key loads from {len(set(words))} addresses, expected one per run held"
    assert len(re.findall(r"\bLDG\.E\.64\b", sass)) <= 16  # ctx, slot, w, and per run: owner, page, base
    assert not re.search(r"\b(STL|LDL)\b", sass)
