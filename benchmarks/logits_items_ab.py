"""Experiment (GPU, Hopper): the Gluon logits kernel launched as the full grid (span index fastest, or token group
fastest) against the plan's work items (last wave split or not, 32- or 128-tile spans), interleaved rounds, each
output checked equal to the clean grid run on every visible entry. Results in BENCHMARKS.md (indexer, fifth pass).

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/logits_items_ab.py [names]``. Not part of the
package."""
import json, os, sys, statistics, torch
from cpkv.bench.timing import do_bench_ms as _bench
from cpkv.bench.indexer import SCENARIOS, make_inputs, indexer_plan as _plan, fp8_gemm_tflops, HEADS, DIM
from cpkv.indexer.logits import aligned_keys, logits_into
from cpkv.indexer.plan import padded
from cpkv.kernels.mqa_logits.triton import LogitsConfig
V = {"grid_s": LogitsConfig(gluon_items=False), "grid_t": LogitsConfig(gluon_items=False, gluon_t_major=True),
     "items": LogitsConfig(), "items_nosplit": LogitsConfig(gluon_split=1),
     "items_sp32": LogitsConfig(gluon_span=32), "items_sp128": LogitsConfig(gluon_span=128, gluon_split=8)}
only = sys.argv[1].split(",") if len(sys.argv) > 1 else None
if only: V = {k: v for k, v in V.items() if k in only}
rounds = int(os.environ.get("ROUNDS", "3"))
c0 = fp8_gemm_tflops()
res = {}
for s in SCENARIOS:
    q, k, k_scale, w, requests = make_inputs(s)
    full = _plan(requests, 1 << 62); c = full.chunks[0]
    ka = aligned_keys(k)
    pairs = int((full.ke - full.ks).sum())
    buf = torch.empty(c.rows, padded(c.width), device="cuda")[:, : c.width]
    work = lambda shape: full.work_items(c, shape)
    # correctness vs clean grid on visible entries
    logits_into(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=True, config=V.get("grid_s", LogitsConfig(gluon_items=False)))
    want = buf.clone(); fin = torch.isfinite(want)
    ok = {}
    for n, cfg in V.items():
        buf.fill_(0)
        logits_into(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=False, config=cfg, work=work)
        ok[n] = bool(torch.equal(buf[fin], want[fin]))
    del want, fin
    r = {n: [] for n in V}
    g = []
    for rep in range(rounds):
        g.append(fp8_gemm_tflops())
        for n, cfg in (V.items() if rep % 2 == 0 else list(V.items())[::-1]):
            ms = _bench(lambda: logits_into(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=False, config=cfg, work=work))
            r[n].append(pairs * 2 * HEADS * DIM / ms / 1e9)
    g.append(fp8_gemm_tflops())
    gm = statistics.mean(g)
    res[s.name] = {"tflops": r, "gemm": g, "equal": ok}
    print(s.name, "gemm", [round(x) for x in g], " ".join(f"{n}:{statistics.median(v)/gm:.3f}[{min(v)/gm:.3f}-{max(v)/gm:.3f}]{'' if ok[n] else '!MISMATCH'}" for n, v in r.items()), flush=True)
    del buf; torch.cuda.empty_cache()
json.dump({"ceiling0": c0, "res": res}, open(os.environ.get("OUT", "/tmp") + "/ab_items.json", "w"))
