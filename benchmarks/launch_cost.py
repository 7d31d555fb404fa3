"""Benchmark (GPU): host microseconds per launch of the kinds of op a forward issues (torch elementwise, allocation,
view, cuBLAS GEMM under each library torch can prefer, a Triton kernel through our wrapper and bare through Triton's
JIT launcher, Triton's argument binder alone, a prepared launch (the compiled kernel's C launcher on raw arguments,
what compose's gathers run), a CUDA graph replay of 50 kernels, an event record). A GPU spin holds the stream
meanwhile, so no launch waits for the GPU. Run from the repository root:

    PYTHONPATH=src python3 benchmarks/launch_cost.py
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from cpkv.kernels.add_norm import triton as add_norm_triton
from cpkv.kernels.add_norm.triton import add_rms_norm
from cpkv.kernels.rope.triton import rope_interleaved

REPEATS = 5


def timed(fn, n: int = 500) -> float:
    """Host µs per call of ``fn`` (warmed up; the GPU held busy by a spin, so launches never wait)."""
    for _ in range(50):
        fn()
    torch.cuda._sleep(int(3e8))  # ~0.15 s: longer than the n launches
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
    # the GEMM library torch picks and the two it can be told to prefer; F.linear as the model's Linear calls it
    mt = m.t().contiguous()
    before = torch.backends.cuda.preferred_blas_library()
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        res[f"torch.mm ({lib})"] = timed(lambda: torch.mm(a, m))
        res[f"F.linear ({lib})"] = timed(lambda: torch.nn.functional.linear(a, mt))
    torch.backends.cuda.preferred_blas_library(before)
    res["F.linear"] = timed(lambda: torch.nn.functional.linear(a, mt))
    q = torch.randn(64, 64, 64, device=dev, dtype=torch.bfloat16)
    cos, sin = torch.randn(64, 32, device=dev), torch.randn(64, 32, device=dev)
    qo = torch.empty_like(q)
    # one Triton kernel (add_rms_norm's) and the rope wrapper, interleaved over REPEATS rounds (medians): the public wrapper,
    # the bare kernel through Triton's JIT launcher, Triton's binder alone (the part of a launch that specialises
    # the arguments), and a prepared launch (the floor)
    kern = add_norm_triton._add_rms_norm
    args = (a, b, w, c, x, x, x, 1e-5, a.stride(0), b.stride(0), c.stride(0), x.stride(0), 0, 0, 0)
    kw = dict(D=6144, G_PAD=64, HAS_DELTA=True, QUANT=False, num_warps=8, enable_fp_fusion=False)
    compiled = kern[(64,)](*args, **kw)
    binder = kern.device_caches[torch.cuda.current_device()][4]
    raw = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in binder(*args, **kw)[0].values()]
    stream = torch._C._cuda_getCurrentRawStream

    def prepared():
        compiled.run(64, 1, 1, stream(0), compiled.function, compiled.packed_metadata, None, None, None, *raw)
    ways = {
        "add_rms_norm wrapper": lambda: add_rms_norm(a, b, w, 1e-5, c, x),
        "rope_interleaved wrapper": lambda: rope_interleaved(q, cos, sin, qo),
        "bare kernel, JIT launcher": lambda: kern[(64,)](*args, **kw),
        "binder alone": lambda: binder(*args, **kw),
        "prepared launch (C launcher, raw arguments)": prepared,
    }
    got: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        for name, fn in ways.items():
            got.setdefault(name, []).append(timed(fn))
    res.update({k: round(statistics.median(v), 2) for k, v in got.items()})
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
