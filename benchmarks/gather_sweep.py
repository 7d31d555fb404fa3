"""Experiment (GPU): page-gather variants (block, warps, order, cache hints) against a device copy.

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/gather_sweep.py``; results in BENCHMARKS.md
(compose, 2026-12-01). Not part of the package."""
import json, os
import torch, triton, triton.language as tl
from cpkv.kernels.page_gather.triton import page_gather_triton, launch_params
from cpkv.bench.timing import event_median_s as _bench  # median seconds over CUDA-event-timed runs


@triton.jit
def _ld(ptr, mask, CM: tl.constexpr):
    if CM == 1:
        return tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")
    elif CM == 2:
        return tl.load(ptr, mask=mask, other=0, cache_modifier=".cg")
    elif CM == 3:
        return tl.load(ptr, mask=mask, other=0, cache_modifier=".cg", eviction_policy="evict_first")
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _st(ptr, x, mask, CM: tl.constexpr):
    if CM == 1 or CM == 3:
        tl.store(ptr, x, mask=mask, cache_modifier=".cs")
    elif CM == 2:
        tl.store(ptr, x, mask=mask, cache_modifier=".cg")
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _gather_pipe(OUT, BASES, DEST, SRC, PAGE, out_addr, n, n_units, PAGE_ELEMS: tl.constexpr,
                 ELEM_BYTES: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr, NBLK: tl.constexpr,
                 PAGE_MAJOR: tl.constexpr, HINTS: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ar = tl.arange(0, BLOCK)
    u = pid
    if PAGE_MAJOR:
        i = u // NBLK
        c = u % NBLK
    else:
        i = u % n
        c = u // n
    offs = tl.max_contiguous(tl.multiple_of(c * BLOCK + ar, BLOCK), BLOCK)
    s = tl.load(SRC + i)
    d = tl.load(DEST + i).to(tl.int64) * PAGE_ELEMS
    addr = tl.load(BASES + tl.maximum(s, 0)) + tl.load(PAGE + i).to(tl.int64) * (PAGE_ELEMS * ELEM_BYTES)
    delta = ((addr - out_addr) // (ELEM_BYTES * VEC)) * VEC
    m = offs < PAGE_ELEMS
    x = _ld(OUT + delta + offs, m & (s >= 0), HINTS)
    for u2 in range(pid + nprog, n_units, nprog):
        if PAGE_MAJOR:
            i2 = u2 // NBLK
            c2 = u2 % NBLK
        else:
            i2 = u2 % n
            c2 = u2 // n
        offs2 = tl.max_contiguous(tl.multiple_of(c2 * BLOCK + ar, BLOCK), BLOCK)
        s2 = tl.load(SRC + i2)
        d2 = tl.load(DEST + i2).to(tl.int64) * PAGE_ELEMS
        addr2 = tl.load(BASES + tl.maximum(s2, 0)) + tl.load(PAGE + i2).to(tl.int64) * (PAGE_ELEMS * ELEM_BYTES)
        delta2 = ((addr2 - out_addr) // (ELEM_BYTES * VEC)) * VEC
        m2 = offs2 < PAGE_ELEMS
        x2 = _ld(OUT + delta2 + offs2, m2 & (s2 >= 0), HINTS)
        _st(OUT + d + offs, x, m, HINTS)
        x, d, offs, m = x2, d2, offs2, m2
    _st(OUT + d + offs, x, m, HINTS)


@triton.jit
def _memcpy(DST, SRC, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    tl.store(DST + offs, tl.load(SRC + offs, mask=m), mask=m)


def pipe(out, bases, dest, src, page, block, warps, waves, page_major, hints, sms):
    dtype, ebytes, vec, elems, block, nblk = launch_params(out.shape[-1], True, block)
    n = dest.numel()
    units = n * nblk
    grid = (min(units, waves * sms) if waves else units,)
    _gather_pipe[grid](out.view(dtype), bases, dest, src, page, out.data_ptr(), n, units, elems, ebytes, vec, block,
                       nblk, page_major, hints, num_warps=warps)


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"gpu": torch.cuda.get_device_name(0), "rows": []}
    for page_bytes, pool_pages, gather_pages in ((64 * 656, 16384, 8192), (64 * 132, 65536, 32768)):
        pool = torch.randint(0, 256, (pool_pages, page_bytes), dtype=torch.uint8, device=dev)
        out = torch.empty((gather_pages, page_bytes), dtype=torch.uint8, device=dev)
        flat = torch.empty_like(out)
        idx = torch.randperm(pool_pages, device=dev)[:gather_pages]
        dest = torch.arange(gather_pages, dtype=torch.int32, device=dev)
        src = torch.zeros(gather_pages, dtype=torch.int32, device=dev)
        bases = torch.tensor([pool.data_ptr()], dtype=torch.int64, device=dev)
        want = pool.index_select(0, idx)
        nbytes = 2 * gather_pages * page_bytes
        def row(name, fn, check=True):
            t = _bench(fn)
            ok = bool(torch.equal(out, want)) if check else None
            r = {"page_bytes": page_bytes, "name": name, "GBps": nbytes / t / 1e9, "ok": ok}
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
            out.zero_()
            return r
        row("copy_", lambda: flat.copy_(pool[:gather_pages]), check=False)
        row("copy_ again", lambda: flat.copy_(pool[:gather_pages]), check=False)
        flat_u = flat.view(-1); src_u = pool[:gather_pages].reshape(-1)
        for blk, w in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)):
            g = (triton.cdiv(flat_u.numel() // 4, blk),)
            row(f"triton memcpy int4x{blk} w{w}", lambda: _memcpy[g](flat_u.view(torch.int32).view(-1, 4).view(torch.float64) if False else flat_u.view(torch.int32), src_u.view(torch.int32), flat_u.numel() // 4, BLOCK=blk, num_warps=w), check=False)
        row("index_select", lambda: torch.index_select(pool, 0, idx, out=out))
        for cfg in ({"block": 2048, "num_warps": 2}, {"block": 2048, "num_warps": 4}, {"block": 4096, "num_warps": 4}):
            row(f"current {cfg}", lambda: page_gather_triton(out, bases, dest, src, idx, config=cfg))
        small = page_bytes < 20000
        combos = []
        for block in ((1024, 2048, 4096) if small else (1024, 2048, 4096, 8192, 16384)):
            for warps in (4, 8, 16):
                if block // (warps * 32) < 4:
                    continue
                combos += [(block, warps, 0, True, 0), (block, warps, 0, False, 0)]
                combos += [(block, warps, 0, True, cm) for cm in (1, 2)] if warps == 8 else []
                combos += [(block, warps, 16, True, 0)]
        for block, warps, waves, pm, cm in combos:
            row(f"pipe b{block} w{warps} waves{waves} pm{int(pm)} cm{cm}",
                lambda: pipe(out, bases, dest, src, idx, block, warps, waves, pm, cm, sms))
        sidx = idx.sort().values
        want = pool.index_select(0, sidx)
        row("index_select sorted", lambda: torch.index_select(pool, 0, sidx, out=out))
        row("current sorted", lambda: page_gather_triton(out, bases, dest, src, sidx))
        del pool, out, flat
        torch.cuda.empty_cache()
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gather_sweep.json"), "w") as f:
        json.dump(res, f, indent=1)
    best = {}
    for r in res["rows"]:
        k = r["page_bytes"]
        if r["name"].startswith("copy_") :
            best.setdefault(k, {})["copy"] = max(best.get(k, {}).get("copy", 0), r["GBps"])
    for r in sorted(res["rows"], key=lambda r: -r["GBps"])[:25]:
        print("TOP", r["page_bytes"], r["name"], round(r["GBps"]), round(r["GBps"] / best[r["page_bytes"]]["copy"], 3), r["ok"])


if __name__ == "__main__":
    main()
