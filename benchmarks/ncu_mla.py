"""Nsight Compute target (GPU): cpkv's sparse MLA kernel and FlashMLA's ``flash_mla_sparse_fwd`` on the same inputs,
each called twice (a warm-up, then the call to profile), for a side-by-side profile of where the two differ.
Run from the repository root with FlashMLA importable (``../shared/peers``' build script):

    PYTHONPATH=src:/tmp/peers/FlashMLA ncu --clock-control none --kernel-name regex:sparse --launch-skip 2 \
        --launch-count 2 --set full --import-source no --print-details all \
        python3 benchmarks/ncu_mla.py [--heads 128] [--tokens 4096] [--kv 32768] [--topk 2048]

(``benchmarks/h200_round.sh mla_ncu``.) Inputs as ``cpkv bench attention``'s random pattern: distinct uniform
top-k rows per query. Both kernels' outputs are compared once (cosine difference, as the bench does), so a profile
is never of a kernel giving wrong results; exit 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys

import torch

from cpkv.attention import sparse_mla
from cpkv.attention.flashmla import load, sparse_fwd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    a = ap.parse_args()
    fn = load()
    if not torch.cuda.is_available() or fn is None:
        print("ncu_mla: needs a CUDA GPU and an importable flash_mla", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(a.tokens, a.heads, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(a.kv, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.empty(a.tokens, a.topk, device="cuda", dtype=torch.int32)
    for r0 in range(0, a.tokens, 512):
        keys = torch.rand(min(512, a.tokens - r0), a.kv, device="cuda", generator=g)
        idx[r0 : r0 + 512] = keys.topk(a.topk, dim=1).indices.to(torch.int32)
    scale = 576 ** -0.5
    outs = []
    for _ in range(2):
        ours = sparse_mla(q, kv, idx, scale, d_v=512, backend="cpkv")
        peer = sparse_fwd(fn, q, kv, idx, scale, 512)
        outs = [ours[0].double().flatten(), peer[0].double().flatten()]  # float64: 1e-10-level differences
    torch.cuda.synchronize()
    cos = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=0).item()
    print(f"ncu_mla: cosine difference {1 - cos:.3g}")
    return 0 if 1 - cos < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
