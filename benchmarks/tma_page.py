"""Experiment (GPU, Hopper): a page gather with one TMA box per whole page (load into shared memory,
store from it), against a device copy in the same run. Follows benchmarks/tma_copy.py (1 KB boxes, 0.85
of a copy); here each page is one box, stores are waited on only when their buffer is reused, and the
page is three boxes of 1 KB rows (box sides must be powers of two: 41 KB = 32 + 8 + 1).

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/tma_page.py``; results in BENCHMARKS.md.
Not part of the package."""
import json
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from cpkv.bench.timing import event_median_s as _bench  # median seconds over CUDA-event-timed runs


@gluon.jit
def _load(sa, sb, sc, PAGE, pid, nprog, n, k, count, ba, bb, bc, bars, ROWS: gl.constexpr, RA: gl.constexpr,
          RB: gl.constexpr, STAGES: gl.constexpr):
    s = k % STAGES
    ok = k < count
    r = gl.load(PAGE + gl.minimum(pid + k * nprog, n - 1)) * ROWS
    mbarrier.expect(bars.index(s), sa.block_type.nbytes + sb.block_type.nbytes + sc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(sa, [r, 0], bars.index(s), ba.index(s), pred=ok)
    tma.async_copy_global_to_shared(sb, [r + RA, 0], bars.index(s), bb.index(s), pred=ok)
    tma.async_copy_global_to_shared(sc, [r + RA + RB, 0], bars.index(s), bc.index(s), pred=ok)


@gluon.jit
def tma_page_gather(sa, sb, sc, da, db, dc, PAGE, n, ROWS: gl.constexpr, RA: gl.constexpr, RB: gl.constexpr,
                    STAGES: gl.constexpr):
    """out page d = pool page PAGE[d] for pages d = pid, pid + nprog, ... (persistent grid). A page is
    ROWS rows of 1 KB = three boxes of RA, RB and ROWS - RA - RB rows (box sides must be powers of two)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ba = gl.allocate_shared_memory(sa.dtype, [STAGES] + sa.block_type.shape, sa.layout)
    bb = gl.allocate_shared_memory(sb.dtype, [STAGES] + sb.block_type.shape, sb.layout)
    bc = gl.allocate_shared_memory(sc.dtype, [STAGES] + sc.block_type.shape, sc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s0 in gl.static_range(STAGES):
        mbarrier.init(bars.index(s0), count=1)
    count = (n - pid + nprog - 1) // nprog
    for s1 in gl.static_range(STAGES):
        _load(sa, sb, sc, PAGE, pid, nprog, n, s1, count, ba, bb, bc, bars, ROWS, RA, RB, STAGES)
    for k in range(count):
        s = k % STAGES
        mbarrier.wait(bars.index(s), (k // STAGES) & 1)
        r = (pid + k * nprog) * ROWS
        tma.async_copy_shared_to_global(da, [r, 0], ba.index(s))
        tma.async_copy_shared_to_global(db, [r + RA, 0], bb.index(s))
        tma.async_copy_shared_to_global(dc, [r + RA + RB, 0], bc.index(s))
        if k > 0:  # page k - 1's buffers: reuse them once their stores have read them (page k's may still run)
            tma.store_wait(3)
            _load(sa, sb, sc, PAGE, pid, nprog, n, k - 1 + STAGES, count, ba, bb, bc, bars, ROWS, RA, RB, STAGES)
    tma.store_wait(0)
    for s2 in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s2))


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for page_bytes, pool_pages, gather_pages in ((64 * 656, 16384, 8192), (64 * 656 * 2, 8192, 4096)):
        nbytes = 2 * gather_pages * page_bytes
        pool8 = torch.randint(0, 256, (pool_pages, page_bytes), dtype=torch.uint8, device=dev)
        out8 = torch.empty((gather_pages, page_bytes), dtype=torch.uint8, device=dev)
        flat = torch.empty_like(out8)
        idx = torch.randperm(pool_pages, device=dev)[:gather_pages].to(torch.int32)
        want = pool8.index_select(0, idx.long())
        copy = nbytes / _bench(lambda: flat.copy_(pool8[:gather_pages])) / 1e9
        from cpkv.kernels.page_gather.triton import page_gather_triton
        dest = torch.arange(gather_pages, dtype=torch.int32, device=dev)
        src = torch.zeros(gather_pages, dtype=torch.int32, device=dev)
        bases = torch.tensor([pool8.data_ptr()], dtype=torch.int64, device=dev)
        tri = nbytes / _bench(lambda: page_gather_triton(out8, bases, dest, src, idx)) / 1e9
        print(json.dumps({"page_bytes": page_bytes, "copy_GBps": round(copy), "triton_gather_GBps": round(tri),
                          "triton_ratio": round(tri / copy, 4), "ok": bool(torch.equal(out8, want))}), flush=True)
        rows = page_bytes // 1024
        ra = 1 << (rows.bit_length() - 1)
        rb = 1 << ((rows - ra).bit_length() - 1)
        rc = rows - ra - rb
        if page_bytes % 1024 or rc & (rc - 1) or rc == 0:
            continue
        pool = pool8.view(torch.int32).view(pool_pages * rows, 256)
        out = out8.view(torch.int32).view(gather_pages * rows, 256)
        lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        descs = [TensorDescriptor.from_tensor(x, [r, 256], lay) for x in (pool, out) for r in (ra, rb, rc)]
        for stages in (2, 3, 4, 5):
            smem = stages * page_bytes
            if smem > 220 * 1024:
                continue
            for ctas in sorted({1, max(1, (220 * 1024) // smem)}):
                grid = (min(gather_pages, ctas * sms),)
                out.zero_()
                try:
                    t = _bench(lambda: tma_page_gather[grid](*descs, idx, gather_pages, ROWS=rows, RA=ra, RB=rb,
                                                             STAGES=stages, num_warps=1))
                except Exception as e:  # noqa: BLE001
                    print("fail", stages, ctas, repr(e)[:300], flush=True)
                    continue
                g = nbytes / t / 1e9
                print(json.dumps({"page_bytes": page_bytes, "boxes_kb": [ra, rb, rc], "stages": stages,
                                  "ctas_per_sm": ctas, "GBps": round(g), "ratio": round(g / copy, 4),
                                  "ok": bool(torch.equal(out8, want))}), flush=True)
        del pool8, out8, flat
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
