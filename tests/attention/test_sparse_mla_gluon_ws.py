"""The warp-specialised Gluon sparse MLA kernel (cpkv.kernels.sparse_mla.gluon_ws) without a GPU.

Compiled offline for sm_90a, sparse and dense causal (Triton ships ptxas; skipped without Triton's NVIDIA tools
or Gluon): no spills, 168 registers re-split 240 / 208 / 56, no ptxas warning (a serialised wgmma is one), the
wgmma count of its schedule, plain 16-byte key gathers, at most the 232,448 B of shared memory.
Its outputs against the float64 reference: tests/attention/test_attention_gpu.py (CUDA).
"""
from __future__ import annotations

import re

import pytest
import torch
from offline_sm90 import compile_sm90, ptxas_and_sass

from cpkv.kernels.sparse_mla import gluon_ws

SMEM_DATA = 231_544  # Q 72 KB + 2 x 72 KB keys + P1 8 KB + row maxima (512 B) and sums by tile parity (1 KB) + staged
# indices (512 B, sparse only: unused in the dense kernel, Triton drops them) + 15 barriers
# what Triton adds (partition captures, scratch: about 456 B): SMEM_DATA <= shared <= SMEM_LIMIT
SMEM_LIMIT = 232_448  # sm_90's largest dynamic shared memory per block


def _compile_sm90(dense: bool):
    """The kernel compiled for sm_90a from CPU stand-ins of GLM-5 launch arguments (64 heads)."""
    q, kv = torch.empty(4, 64, 576, dtype=torch.bfloat16), torch.empty(100, 576, dtype=torch.bfloat16)
    idx, out, lse = torch.empty(4, 2048, dtype=torch.int32), torch.empty(4, 64, 512, dtype=torch.bfloat16), torch.empty(4, 64)
    args = (q, kv, idx, idx, idx, out, lse, 100, 64, 2048, 0.1, 36864, 576, 576, 2048, 32768, 512, 64, 8, dense)
    return compile_sm90(gluon_ws.load(), args, {"DENSE": dense}, num_warps=4, maxnreg=gluon_ws.MAX_REGS)


@pytest.mark.triton
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_kernel_compiles_for_sm90_without_spills(dense: bool, tmp_path) -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    ck = _compile_sm90(dense)
    ptx = ck.asm["ptx"]
    report, sass = ptxas_and_sass(ck, tmp_path)
    assert "warning" not in report.lower(), report  # a serialised wgmma is reported as one
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    # hardware barriers: Triton's 0..3 (CTA, partitions); the consumers sync on mbarriers
    assert f"Used {gluon_ws.MAX_REGS} registers, used 4 barriers" in report, report
    # the partitions' re-split of 168 x 3 warpgroups: consumer 0 240 (its look-ahead), consumer 1 208, producer 56
    assert {"240", "208", "56"} <= set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx))
    assert not re.search(r"\b(STL|LDL)\b", sass)
    assert SMEM_DATA - (512 if dense else 0) <= ck.metadata.shared <= SMEM_LIMIT
    # score wgmmas (n64, k16): 576 / 16 = 36 per consumer, 36 more for consumer 0's look-ahead (the peeled first
    # block's and the next pair's are two copies); value wgmmas (n256, k16): 64 keys / 16 = 4 per P x V product,
    # two products per consumer, 4 more for consumer 0 (its last pair's product has its own branch)
    assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16", sass)) == 108
    assert len(re.findall(r"HGMMA\.64x256x16\.F32\.BF16", sass)) == 20
    # 16-byte copies per producer thread: Q 36, keys 72 (2 blocks x 64 rows x 576 dims x 2 B / 16 B / 128)
    assert len(re.findall(r"LDGSTS\.E\.BYPASS\.128", sass)) == 108
    assert "LTC256B" not in sass and "createpolicy" not in ptx
    # the output leaves in 16-byte stores (64 x 256 bf16 / 128 threads / 8 = 16 per consumer), rearranged by warp
    # shuffles (no shared-memory scratch: the shared-memory bound above), and no 4-byte ones but the lse's
    assert len(re.findall(r"STG\.E\.128\b", sass)) == 32
    assert len(re.findall(r"STG\.E\s", sass)) <= 2
    assert "SHFL" in sass
    if not dense:  # global loads: the producer's index loads alone (2 blocks x 4 rows a thread); the consumers mask
        # from the indices the producer stages in shared memory by cp.async (4 bytes: LDGSTS without BYPASS)
        assert len(re.findall(r"\bLDG\.E\b", sass)) == 8
        assert len(re.findall(r"LDGSTS\.E\s", sass)) == 2
