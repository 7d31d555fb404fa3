"""Experiment (GPU, Hopper): the current Gluon logits kernel against an earlier version of its module,
alternately in one process (4 rounds x 60 ms per scenario, ratio to the fp8 GEMM at the start), with a
byte comparison of their clean outputs. The refill-at-box-top A/B in BENCHMARKS.md (indexer, fourth
pass) compared against commit 714eb4c:

    git show 714eb4c:src/cpkv/kernels/mqa_logits_gluon.py > /tmp/mlg_old.py
    PYTHONPATH=src python3 benchmarks/logits_version_ab.py /tmp/mlg_old.py

Not part of the package."""
import importlib.util, sys, torch
from cpkv.bench.timing import do_bench_ms as _bench
from cpkv.bench.indexer import SCENARIOS, make_inputs, indexer_plan as _plan, fp8_gemm_tflops, HEADS, DIM
from cpkv.indexer.logits import aligned_keys
from cpkv.indexer.plan import padded
from cpkv.kernels.mqa_logits import gluon as new
old_path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/mlg_old.py"
spec = importlib.util.spec_from_file_location("mlg_old", old_path); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
c0 = fp8_gemm_tflops()
for s in SCENARIOS:
    q, k, k_scale, w, requests = make_inputs(s)
    full = _plan(requests, 1 << 62); c = full.chunks[0]
    ka = aligned_keys(k); pairs = int((full.ke - full.ks).sum())
    buf = torch.empty(c.rows, padded(c.width), device="cuda")[:, : c.width]
    r = {"old": [], "new": []}
    for rep in range(4):
        for n, m in (("old", old), ("new", new)):
            ms = _bench(lambda: m.mqa_logits_gluon(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=False))
            r[n].append(pairs * 2 * HEADS * DIM / ms / 1e9 / c0)
    m.mqa_logits_gluon(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=True); a = buf.clone()
    old.mqa_logits_gluon(q, ka, k_scale, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=True)
    print(s.name, {n: [round(x, 3) for x in sorted(v)] for n, v in r.items()}, "equal", bool(torch.equal(a, buf)), flush=True)
    del buf; torch.cuda.empty_cache()
print("ceiling", round(c0), "end", round(fp8_gemm_tflops()))
