"""Experiment (GPU, Hopper): a TMA (bulk tensor copy) page gather against a device copy.

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/tma_copy.py``; results in BENCHMARKS.md
(compose, 2026-12-01). Not part of the package."""
import json
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from cpkv.bench.timing import event_median_s as _bench  # median seconds over CUDA-event-timed runs


@gluon.jit
def tma_gather(src_desc, dst_desc, PAGE, n, NBOX: gl.constexpr, SLOTS: gl.constexpr, BOXR: gl.constexpr,
               STAGES: gl.constexpr):
    # a page = NBOX boxes of [BOXR, 256] bytes; stage s uses smem boxes [s * SLOTS, s * SLOTS + NBOX)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    bufs = gl.allocate_shared_memory(gl.uint8, [STAGES * SLOTS, BOXR, 256], src_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s2 in gl.static_range(STAGES):
        mbarrier.init(bars.index(s2), count=1)
    count = (n - pid + nprog - 1) // nprog
    for s0 in gl.static_range(STAGES):
        ok = s0 < count
        p = gl.load(PAGE + gl.minimum(pid + s0 * nprog, n - 1))
        mbarrier.expect(bars.index(s0), NBOX * BOXR * 256, pred=ok)
        for j in gl.static_range(NBOX):
            tma.async_copy_global_to_shared(src_desc, [(p * NBOX + j) * BOXR, 0], bars.index(s0),
                                            bufs.index(s0 * SLOTS + j), pred=ok)
    for k in range(count):
        s = k % STAGES
        mbarrier.wait(bars.index(s), (k // STAGES) & 1)
        d = pid + k * nprog
        for j in gl.static_range(NBOX):
            tma.async_copy_shared_to_global(dst_desc, [(d * NBOX + j) * BOXR, 0], bufs.index(s * SLOTS + j))
        tma.store_wait(0)
        nxt = k + STAGES
        ok = nxt < count
        p = gl.load(PAGE + gl.minimum(pid + nxt * nprog, n - 1))
        mbarrier.expect(bars.index(s), NBOX * BOXR * 256, pred=ok)
        for j in gl.static_range(NBOX):
            tma.async_copy_global_to_shared(src_desc, [(p * NBOX + j) * BOXR, 0], bars.index(s),
                                            bufs.index(s * SLOTS + j), pred=ok)
    for s1 in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s1))


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for page_bytes, pool_pages, gather_pages in ((64 * 656, 16384, 8192), (64 * 132, 65536, 32768)):
        rows = page_bytes // 256
        if page_bytes % 256:
            continue
        boxr = 4 if rows % 4 == 0 else 1
        nbox = rows // boxr
        slots = 1 << (nbox - 1).bit_length()
        pool = torch.randint(0, 256, (pool_pages * rows, 256), dtype=torch.uint8, device=dev)
        out = torch.empty((gather_pages * rows, 256), dtype=torch.uint8, device=dev)
        flat = torch.empty_like(out)
        idx = torch.randperm(pool_pages, device=dev)[:gather_pages].to(torch.int32)
        want = pool.view(pool_pages, -1).index_select(0, idx.long()).view(-1, 256)
        lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        sd = TensorDescriptor.from_tensor(pool, [boxr, 256], lay)
        dd = TensorDescriptor.from_tensor(out, [boxr, 256], lay)
        nbytes = 2 * gather_pages * page_bytes
        copy = nbytes / _bench(lambda: flat.copy_(pool[: gather_pages * rows])) / 1e9
        ar = torch.arange(gather_pages, device=dev, dtype=torch.int32)
        for stages in (1, 2, 3):
            smem = stages * slots * boxr * 256
            if smem > 220 * 1024:
                continue
            per_sm = max(1, (220 * 1024) // smem)
            for ctas in sorted({1, min(per_sm, 2), per_sm}):
                grid = (min(gather_pages, ctas * sms),)
                for name, index in (("gather", idx), ("contig", ar)):
                    out.zero_()
                    try:
                        t = _bench(lambda: tma_gather[grid](sd, dd, index, gather_pages, NBOX=nbox, SLOTS=slots, BOXR=boxr, STAGES=stages, num_warps=1))
                    except Exception as e:  # noqa
                        print("fail", stages, ctas, repr(e)[:400], flush=True)
                        continue
                    ok = bool(torch.equal(out, want)) if name == "gather" else bool(torch.equal(out, pool[: gather_pages * rows]))
                    g = nbytes / t / 1e9
                    print(json.dumps({"page_bytes": page_bytes, "kind": name, "stages": stages, "ctas_per_sm": ctas,
                                      "GBps": round(g), "ratio": round(g / copy, 4), "ok": ok}), flush=True)
        del pool, out, flat
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
