"""Benchmark (GPU): host microseconds per launch of the kinds of op a forward issues (torch elementwise, allocation,
view, cuBLAS GEMM, Triton kernels through our wrappers with direct launches (``cpkv.kernels.launch.fast``) and
through Triton's JIT launcher, a CUDA graph replay of 50 kernels, an event record). A 2 s spin holds the stream
meanwhile, so no launch waits for the GPU. Run from the repository root:

    PYTHONPATH=src python3 benchmarks/launch_cost.py
"""
from __future__ import annotations

import json
import time

import torch

from cpkv.kernels import launch
from cpkv.kernels.add_norm.triton import add_rms_norm
from cpkv.kernels.rope.triton import rope_interleaved


def timed(fn, n: int = 500) -> float:
    """Host µs per call of ``fn`` (warmed up; the GPU held busy by a spin, so launches never wait)."""
    for _ in range(50):
        fn()
    torch.cuda._sleep(int(2e9))
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(us, 2)


def main() -> None:
    dev = torch.device("cuda")
    a = torch.randn(64, 6144, device=dev, dtype=torch.bfloat16)
    b, c, x = torch.randn_like(a), torch.empty_like(a), torch.empty_like(a)
    w = torch.randn(6144, device=dev, dtype=torch.bfloat16)
    m = torch.randn(6144, 2048, device=dev, dtype=torch.bfloat16)
    res = {
        "torch.add(out=)": timed(lambda: torch.add(a, b, out=c)),
        "torch.empty": timed(lambda: torch.empty(64, 6144, device=dev, dtype=torch.bfloat16)),
        "a[:, :128] view": timed(lambda: a[:, :128]),
        "torch.mm": timed(lambda: torch.mm(a, m)),
    }
    q = torch.randn(64, 64, 64, device=dev, dtype=torch.bfloat16)
    cos, sin = torch.randn(64, 32, device=dev), torch.randn(64, 32, device=dev)
    qo = torch.empty_like(q)
    for name, fn in (("add_rms_norm", lambda: add_rms_norm(a, b, w, 1e-5, c, x)),
                     ("rope_interleaved", lambda: rope_interleaved(q, cos, sin, qo))):
        res[f"{name} wrapper, direct launch"] = timed(fn)
        launch.ENABLED[0] = False  # every launch through Triton's JIT launcher
        res[f"{name} wrapper, JIT launcher"] = timed(fn)
        launch.ENABLED[0] = True
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        add_rms_norm(a, b, w, 1e-5, c, x)
        with torch.cuda.graph(g, stream=s):
            for _ in range(50):
                add_rms_norm(a, b, w, 1e-5, c, x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    res["graph replay (50 kernels)"] = timed(g.replay, 200)
    ev = torch.cuda.Event(enable_timing=True)
    res["event record"] = timed(ev.record)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
