"""Benchmark (GPU): host microseconds per launch of the kinds of op a forward issues (torch elementwise, allocation,
view, cuBLAS GEMM under each library torch can prefer, Triton kernels through our wrappers, the page gather kernel
bare through Triton's JIT launcher, Triton's argument binder alone for it, and its prepared launch as compose runs it
(``gather_launcher``: the compiled kernel's C launcher on raw addresses), a CUDA graph replay of 50 kernels, an event
record). A GPU spin holds the stream meanwhile, so no launch waits for the GPU. Public names only. Run from the
repository root:

    PYTHONPATH=src python3 benchmarks/launch_cost.py
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from cpkv.kernels.add_norm.triton import add_rms_norm
from cpkv.kernels.page_gather.triton import DEFAULT_CONFIG, gather_launcher, launch_params, load
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
    # one Triton kernel (page gather's: 64 token pages of 41,984 B) three ways, beside the wrappers, interleaved
    # over REPEATS rounds (medians): bare through Triton's JIT launcher, Triton's binder alone (the part of a launch
    # that specialises the arguments), and compose's prepared launch (the floor). Session 17's call 2 timed
    # add_rms_norm's kernel the same three ways (the script at 2a9f805)
    pool = torch.randint(0, 255, (128, 64 * 656), dtype=torch.uint8, device=dev)
    out = torch.empty(64, 64 * 656, dtype=torch.uint8, device=dev)
    bases = torch.tensor([pool.data_ptr()], dtype=torch.int64, device=dev)
    dest, src, page = (torch.arange(64, dtype=torch.int32, device=dev), torch.zeros(64, dtype=torch.int32, device=dev),
                       torch.arange(0, 128, 2, dtype=torch.int32, device=dev))
    dtype, ebytes, vec, elems, block, nblocks = launch_params(out.shape[1], True, DEFAULT_CONFIG["block"])
    grid = (64 * nblocks,)
    args = (out.view(dtype), bases, dest, src, page, out.data_ptr(), 64, grid[0])
    kw = dict(PAGE_ELEMS=elems, ELEM_BYTES=ebytes, VEC=vec, BLOCK=block, num_warps=DEFAULT_CONFIG["num_warps"])
    kern = load()
    kern[grid](*args, **kw)
    assert torch.equal(out, pool[::2]), "page gather: wrong bytes"
    binder = kern.device_caches[torch.cuda.current_device()][4]  # Triton's own, made by its first launch
    prepared = gather_launcher(out, bases, dest, src, page)
    ways = {
        "add_rms_norm wrapper": lambda: add_rms_norm(a, b, w, 1e-5, c, x),
        "rope_interleaved wrapper": lambda: rope_interleaved(q, cos, sin, qo),
        "page gather kernel, bare, JIT launcher": lambda: kern[grid](*args, **kw),
        "page gather kernel, binder alone": lambda: binder(*args, **kw),
        "page gather kernel, prepared launch (gather_launcher)": prepared,
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
