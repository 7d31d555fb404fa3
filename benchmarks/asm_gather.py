"""Experiment (GPU): page gather with the 16-byte loads/stores written as inline PTX, to try cache and
prefetch qualifiers Triton does not emit. Run from the repository root:
``PYTHONPATH=src python3 benchmarks/asm_gather.py``; results in BENCHMARKS.md (compose, 2026-12-01)."""
import json
import torch, triton, triton.language as tl
from cpkv.bench.timing import event_median_s as _bench  # median seconds over CUDA-event-timed runs

LOADS = {
    "nc": "ld.global.nc.v4.b32 {$0,$1,$2,$3}, [$4];",
    "nc_na": "ld.global.nc.L1::no_allocate.v4.b32 {$0,$1,$2,$3}, [$4];",
    "nc_na_256": "ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {$0,$1,$2,$3}, [$4];",
    "plain_256": "ld.global.L2::256B.v4.b32 {$0,$1,$2,$3}, [$4];",
    "ef_256": "ld.global.L1::evict_first.L2::256B.v4.b32 {$0,$1,$2,$3}, [$4];",
    "lu": "ld.global.lu.v4.b32 {$0,$1,$2,$3}, [$4];",
}
STORES = {k: "{ .reg .pred p; setp.ne.b64 p, $1, 0; @p " + v + " [$1], {$2,$3,$4,$5}; mov.b32 $0, 0; }"
          for k, v in {"plain": "st.global.v4.b32", "cs": "st.global.cs.v4.b32",
                       "na": "st.global.L1::no_allocate.v4.b32"}.items()}


@triton.jit
def _g(OUT, BASES, DEST, SRC, PAGE, VECS: tl.constexpr, BLOCK: tl.constexpr, LD: tl.constexpr, ST: tl.constexpr):
    # one program per page; VECS 16-byte vectors per page; BLOCK >= VECS (pow2)
    i = tl.program_id(0)
    v = tl.arange(0, BLOCK)
    m = v < VECS
    s = tl.load(SRC + i)
    src = tl.load(BASES + s) + tl.load(PAGE + i).to(tl.int64) * (VECS * 16) + v.to(tl.int64) * 16
    dst = OUT.to(tl.int64, bitcast=True) + tl.load(DEST + i).to(tl.int64) * (VECS * 16) + v.to(tl.int64) * 16
    src = tl.where(m, src, tl.load(BASES + s))  # masked lanes re-read the page start (harmless)
    a, b, c, d = tl.inline_asm_elementwise(LD, "=r,=r,=r,=r,l", [src], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                           is_pure=True, pack=1)
    dst = tl.where(m, dst, 0)
    # masked lanes must not store: branch in asm on a zero address
    tl.inline_asm_elementwise(ST, "=r,l,r,r,r,r", [dst, a, b, c, d], dtype=tl.int32, is_pure=False, pack=1)


def main():
    dev = torch.device("cuda")
    for page_bytes, pool_pages, gather_pages in ((64 * 656, 16384, 8192), (64 * 132, 65536, 32768)):
        pool = torch.randint(0, 256, (pool_pages, page_bytes), dtype=torch.uint8, device=dev)
        out = torch.empty((gather_pages, page_bytes), dtype=torch.uint8, device=dev)
        flat = torch.empty_like(out)
        idx = torch.randperm(pool_pages, device=dev)[:gather_pages]
        want = pool.index_select(0, idx)
        dest = torch.arange(gather_pages, dtype=torch.int32, device=dev)
        src = torch.zeros(gather_pages, dtype=torch.int32, device=dev)
        bases = torch.tensor([pool.data_ptr()], dtype=torch.int64, device=dev)
        nbytes = 2 * gather_pages * page_bytes
        copy = nbytes / _bench(lambda: flat.copy_(pool[:gather_pages])) / 1e9
        print(json.dumps({"page_bytes": page_bytes, "copy_GBps": round(copy)}), flush=True)
        vecs = page_bytes // 16
        block = 1 << (vecs - 1).bit_length()
        for ld in LOADS:
            for st in STORES:
                for warps in ((8, 16) if page_bytes > 20000 else (4, 8)):
                    if block // (warps * 32) < 1:
                        continue
                    out.zero_()
                    try:
                        t = _bench(lambda: _g[(gather_pages,)](out, bases, dest, src, idx, VECS=vecs, BLOCK=block,
                                                              LD=LOADS[ld], ST=STORES[st], num_warps=warps))
                    except Exception as e:  # noqa
                        print("fail", ld, st, warps, repr(e)[:300], flush=True)
                        continue
                    g = nbytes / t / 1e9
                    print(json.dumps({"page_bytes": page_bytes, "ld": ld, "st": st, "warps": warps, "GBps": round(g),
                                      "ratio": round(g / copy, 4), "ok": bool(torch.equal(out, want))}), flush=True)
        del pool, out, flat
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
