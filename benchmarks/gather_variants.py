"""Benchmark (GPU): forms of the page gather against the one the compose path runs, in device time, each first
checked byte-exact against ``index_select``. Run from the repository root:

    PYTHONPATH=src python3 benchmarks/gather_variants.py [--json] [--reps 3]

Pages as ``cpkv bench compose``'s kernel case: 8,192 random 41,984-byte token pages of a 16,384-page pool, and
32,768 random 8,448-byte index pages of 65,536, gathered to consecutive destinations; every figure is bytes read +
written per second of device time (a spin kernel holds the stream while the host enqueues) divided by a ``copy_``
of the same bytes timed the same way in the same round. Forms (issue 24: the gather at 0.945 of ``copy_``, target
0.95):

* ``cpkv``: the kernel compose runs (``gather_launcher``, its default config: one program per page, one
  power-of-two block masked to the page);
* ``split``: one program per page, the page as a power-of-two block plus a smaller masked tail block (fewer
  registers held for masked lanes), all loads issued before the stores;
* ``pair``: one program per two pages (entries p and p + n/2), both loads before both stores;
* ``cs``: the cpkv form with streaming (``.cs``) stores; ``ef``: with ``evict_first`` loads.

Each form runs with 4 and 8 warps; the table is repeated ``--reps`` times to show the spread. Exit 0 when every
form is byte-exact.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from cpkv.bench.timing import event_median_s


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _split(OUT, POOL, DEST, PAGE, n, ELEMS: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr,
               STORE: tl.constexpr, LOAD: tl.constexpr):
        i = tl.program_id(0)
        src = POOL + tl.load(PAGE + i).to(tl.int64) * ELEMS
        dst = OUT + tl.load(DEST + i).to(tl.int64) * ELEMS
        a = tl.max_contiguous(tl.multiple_of(tl.arange(0, HEAD), HEAD), HEAD)
        x = tl.load(src + a, mask=a < ELEMS, eviction_policy=LOAD)
        if TAIL > 0:
            b = HEAD + tl.max_contiguous(tl.multiple_of(tl.arange(0, TAIL), TAIL), TAIL)
            y = tl.load(src + b, mask=b < ELEMS, eviction_policy=LOAD)
        tl.store(dst + a, x, mask=a < ELEMS, cache_modifier=STORE)
        if TAIL > 0:
            tl.store(dst + b, y, mask=b < ELEMS, cache_modifier=STORE)

    @triton.jit
    def _pair(OUT, POOL, DEST, PAGE, half, ELEMS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        j = i + half
        a = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
        m = a < ELEMS
        x = tl.load(POOL + tl.load(PAGE + i).to(tl.int64) * ELEMS + a, mask=m)
        y = tl.load(POOL + tl.load(PAGE + j).to(tl.int64) * ELEMS + a, mask=m)
        tl.store(OUT + tl.load(DEST + i).to(tl.int64) * ELEMS + a, x, mask=m)
        tl.store(OUT + tl.load(DEST + j).to(tl.int64) * ELEMS + a, y, mask=m)

    return _split, _pair


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _pow2_at_most(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def case(page_bytes: int, pool_pages: int, pages: int, device: torch.device) -> dict:
    from cpkv.kernels.page_gather.triton import gather_launcher

    split, pair = _kernels()
    elems = page_bytes // 4
    pool = torch.randint(0, 256, (pool_pages, page_bytes), dtype=torch.uint8, device=device)
    out = torch.empty((pages, page_bytes), dtype=torch.uint8, device=device)
    flat = torch.empty_like(out)
    idx = torch.randperm(pool_pages, device=device)[:pages].to(torch.int32)
    want = pool.index_select(0, idx.long())
    dest = torch.arange(pages, dtype=torch.int32, device=device)
    src = torch.zeros(pages, dtype=torch.int32, device=device)
    bases = torch.tensor([pool.data_ptr()], dtype=torch.int64, device=device)
    nbytes = 2 * pages * page_bytes
    o32, p32 = out.view(torch.int32), pool.view(torch.int32)
    head = _pow2_at_most(elems)
    tail = _pow2_at_least(elems - head) if elems > head else 0
    block = _pow2_at_least(elems)

    forms = {}
    for w in (4, 8):
        forms[f"cpkv_w{w}"] = gather_launcher(out, bases, dest, src, idx, config={"block": 16384, "num_warps": w})
        forms[f"split_w{w}"] = (lambda w=w: split[(pages,)](o32, p32, dest, idx, pages, ELEMS=elems, HEAD=head,
                                                             TAIL=tail, STORE="", LOAD="", num_warps=w))
        forms[f"pair_w{w}"] = (lambda w=w: pair[(pages // 2,)](o32, p32, dest, idx, pages // 2, ELEMS=elems,
                                                                BLOCK=block, num_warps=w))
        forms[f"cs_w{w}"] = (lambda w=w: split[(pages,)](o32, p32, dest, idx, pages, ELEMS=elems, HEAD=block,
                                                          TAIL=0, STORE=".cs", LOAD="", num_warps=w))
        forms[f"ef_w{w}"] = (lambda w=w: split[(pages,)](o32, p32, dest, idx, pages, ELEMS=elems, HEAD=block,
                                                          TAIL=0, STORE="", LOAD="evict_first", num_warps=w))
    res = {"page_bytes": page_bytes, "pages": pages, "head": head, "tail": tail, "correct": {}}
    for name, fn in forms.items():
        out.zero_()
        fn()
        torch.cuda.synchronize()
        res["correct"][name] = bool(torch.equal(out, want))

    def gbps(fn) -> float:
        return nbytes / event_median_s(fn, device_only=True) / 1e9

    rounds = []
    for _ in range(ARGS.reps):
        copy = gbps(lambda: flat.copy_(pool[:pages]))
        rounds.append({"copy_GBps": copy, **{name: gbps(fn) / copy for name, fn in forms.items()
                                             if res["correct"][name]}})
    res["rounds"] = rounds
    res["median_ratio"] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "copy_GBps"}
    return res


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ARGS = ap.parse_args()
    if not torch.cuda.is_available():
        print("gather_variants: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    res = {"token": case(41984, 16384, 8192, dev), "index": case(8448, 65536, 32768, dev)}
    if ARGS.json:
        print(json.dumps(res, indent=1))
    else:
        for kind, r in res.items():
            print(kind, r["page_bytes"], "B pages; ratio to copy_ (median of rounds):")
            for k, v in sorted(r["median_ratio"].items(), key=lambda kv: -kv[1]):
                print(f"  {k:10s} {v:.4f}  " + " ".join(f"{x[k]:.4f}" for x in r["rounds"]))
    ok = all(all(r["correct"].values()) for r in res.values())
    return 0 if ok else 1


ARGS: argparse.Namespace

if __name__ == "__main__":
    sys.exit(main())
