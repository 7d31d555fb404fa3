"""Experiment (GPU, Hopper): logits kernel configs timed interleaved (3 rounds of every config per scenario,
median TFLOP/s each), each against the fp8 GEMM ceiling measured at the start of the run (and again at its end).
Interleaving spreads the clock's drift under sustained tensor work over every config alike.

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/logits_ab.py``; results in BENCHMARKS.md
(indexer, fourth pass). Not part of the package."""
import json, os, sys, torch
from cpkv.bench.timing import do_bench_ms as _bench
from cpkv.bench.indexer import SCENARIOS, make_inputs, indexer_plan as _plan, fp8_gemm_tflops, HEADS, DIM
from cpkv.indexer.logits import aligned_keys, logits_into
from cpkv.indexer.plan import padded
from cpkv.kernels.mqa_logits.triton import LogitsConfig
V = {"default": LogitsConfig(), "span128": LogitsConfig(gluon_span=128), "span32": LogitsConfig(gluon_span=32),
     "span256": LogitsConfig(gluon_span=256), "wg2": LogitsConfig(gluon_warpgroups=2),
     "wg2_span32": LogitsConfig(gluon_warpgroups=2, gluon_span=32),
     "wg2_span128": LogitsConfig(gluon_warpgroups=2, gluon_span=128),
     "pipe2": LogitsConfig(gluon_pipe=2, gluon_box=1, gluon_stages=4)}
c0 = fp8_gemm_tflops()
res = {}
for s in SCENARIOS:
    q, k, k_scale, w, requests = make_inputs(s)
    full = _plan(requests, 1 << 62); c = full.chunks[0]
    ka = aligned_keys(k)
    pairs = int((full.ke - full.ks).sum())
    buf = torch.empty(c.rows, padded(c.width), device="cuda")[:, : c.width]
    r = {n: [] for n in V}
    for rep in range(3):
        for n, cfg in V.items():
            ms = _bench(lambda: logits_into(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=False, config=cfg))
            r[n].append(pairs * 2 * HEADS * DIM / ms / 1e9)
    res[s.name] = {n: sorted(v) for n, v in r.items()}
    del buf; torch.cuda.empty_cache()
c1 = fp8_gemm_tflops()
print("ceiling before", round(c0), "after", round(c1))
for sn, r in res.items():
    print(sn, "  ".join(f"{n}:{v[1]/c0:.3f}[{v[0]/c0:.3f}-{v[2]/c0:.3f}]" for n, v in r.items()))
json.dump({"ceiling": [c0, c1], "tflops": res}, open(os.environ.get("OUT", "/tmp") + "/sweep.json", "w"))
