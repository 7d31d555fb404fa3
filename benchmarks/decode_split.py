"""How a paged decode step could split its work over the CP group (docs/design.md §11): the bytes each rank moves per
step under the two splits considered, at GLM-5's shapes, and the host time of a step's bookkeeping and plan.

    (a) owner   the rank owning a generation's tail page runs its whole step: the indexer over every index row of
                the context and sparse MLA over the top-k token rows, peers' rows read through peer memory
    (b) split   every rank scores the index rows it holds of every generation, publishes its top-k candidates
                (score, position); the owner merges them and reads the chosen token rows where they lie

Bytes are per step, summed over the layers, for the busiest rank (generations spread evenly over the ranks: the
tail pages rotate); "peer" is the part read from other ranks' memory. The host times are measured on this
machine (Decoder.plan + advance: bookkeeping; decode_plan: the rank plan, its device part on the CPU here).

    PYTHONPATH=src python benchmarks/decode_split.py [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import time

from cpkv.config import PRESETS

KEYS = (1024, 32768, 131072)
BATCHES = (1, 8, 32)
CPS = (2, 8)
CANDIDATE_BYTES = 8  # a candidate: float32 score + int32 position


def split_bytes(split: str, b: int, ctx: int, cp: int, layers: int = 4) -> dict[str, float]:
    """Bytes the busiest rank reads in one step of ``b`` generations at ``ctx`` keys (GLM-5, ``layers`` layers)."""
    m = PRESETS["glm5"].with_layers(layers)
    full = m.indexer_types.count("full")
    tok, idx, k = m.row_bytes("token"), m.row_bytes("index"), m.index_topk
    peer_share = (cp - 1) / cp
    own = math.ceil(b / cp)  # generations whose step this rank runs
    rows = own * min(ctx, k) * tok * layers  # the chosen token rows, where they lie
    query = m.index_n_heads * (m.index_head_dim + 4)  # fp8 indexer query + float32 head weights
    if split == "owner":
        index = own * ctx * idx * full
        return {"index": index, "rows": rows, "peer": (index + rows) * peer_share, "rounds": 0}
    index = b * math.ceil(ctx / cp) * idx * full  # every generation's keys held here
    cand = own * (cp - 1) * min(ctx, k) * CANDIDATE_BYTES * full + b * query * full
    return {"index": index, "rows": rows, "peer": rows * peer_share + cand, "rounds": 2 * full}


def host_times(b: int, ctx: int, steps: int = 20) -> dict[str, float]:
    """Median host µs of one step's bookkeeping (Decoder.plan + advance) and rank plan (decode_plan) at cp 1."""
    import torch

    from cpkv.engine.decode import DecodeTable, decode_plan
    from cpkv.kvcache import KVCacheManager, PageAllocator
    from cpkv.model import load_model
    from cpkv.scheduler.decode import Decoder

    P = 64
    pages = b * (ctx // P + steps // P + 3) + 2
    kv = KVCacheManager(P, [PageAllocator(pages, "rank 0")])
    dec = Decoder(kv, 1, P)
    for g in range(b):
        toks = [g * 7 + i % 97 for i in range(ctx + 1)]
        got = kv.allocate([0] * (ctx // P + 1))
        prefix = kv.commit(toks[: ctx // P * P], kv.match([]), got[: ctx // P], hold=True)
        dec.start(g, toks, prefix, got[ctx // P:] if ctx % P else ())
        if not ctx % P:
            kv.release(got[ctx // P:])
    model = load_model("tiny", seed=0)
    table = DecodeTable(ctx // P + steps, torch.device("cpu"))
    book, plan = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        step, _ = dec.plan()
        t1 = time.perf_counter()
        table.apply(step)
        decode_plan(step, 0, model, table)
        t2 = time.perf_counter()
        for e in step.entries:
            dec.seqs[e.rid].tokens.append(s)
            dec.advance(e.rid)
        t3 = time.perf_counter()
        book.append((t1 - t0) + (t3 - t2))
        plan.append(t2 - t1)
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e6  # noqa: E731
    return {"bookkeeping_us": med(book), "plan_us": med(plan)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for cp in CPS:
        for b in BATCHES:
            for ctx in KEYS:
                a, s = split_bytes("owner", b, ctx, cp), split_bytes("split", b, ctx, cp)
                rows.append({"cp": cp, "batch": b, "keys": ctx, "owner": a, "split": s})
    host = [{"batch": b, "keys": ctx, **host_times(b, ctx)} for b in BATCHES for ctx in KEYS]
    if args.json:
        print(json.dumps({"bytes": rows, "host": host}, indent=1))
        return
    mb = lambda x: f"{x / 1e6:8.2f}"  # noqa: E731
    print("GLM-5, 4 layers (3 full), bytes per step on the busiest rank (MB): index rows read, token rows read, "
          "of which from peers; barrier rounds")
    print(" cp batch   keys | owner: index   rows   peer | split: index   rows   peer rounds")
    for r in rows:
        a, s = r["owner"], r["split"]
        print(f"{r['cp']:3d} {r['batch']:5d} {r['keys']:6d} | {mb(a['index'])} {mb(a['rows'])} {mb(a['peer'])} | "
              f"{mb(s['index'])} {mb(s['rows'])} {mb(s['peer'])} {s['rounds']:3d}")
    print("\nhost per step (µs, median of 20; P = 64): Decoder.plan + advance, decode_plan (device part on the CPU)")
    for h in host:
        print(f"batch {h['batch']:3d} keys {h['keys']:6d}: {h['bookkeeping_us']:8.1f} {h['plan_us']:10.1f}")


if __name__ == "__main__":
    main()
