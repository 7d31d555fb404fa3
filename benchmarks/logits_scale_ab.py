"""Experiment (GPU, Hopper): the Gluon logits kernel with k_scale as the stride-33 view of the 132-byte index
rows against a unit-stride copy (cpkv.indexer.logits.aligned_scales), both with the plan's work items,
6 interleaved rounds of 25 ms per scenario, median ratio to the mean of the fp8 GEMMs timed between rounds.
Results in BENCHMARKS.md (indexer, fifth pass).

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/logits_scale_ab.py``. Not part of the package."""
import statistics, torch
from cpkv.bench.timing import do_bench_ms as _bench
from cpkv.bench.indexer import SCENARIOS, make_inputs, indexer_plan as _plan, fp8_gemm_tflops, HEADS, DIM
from cpkv.indexer.logits import aligned_keys, aligned_scales
from cpkv.indexer.plan import padded
from cpkv.kernels.mqa_logits.triton import work_shape
from cpkv.kernels.mqa_logits.gluon import mqa_logits_gluon
for s in SCENARIOS:
    q, k, k_scale, w, requests = make_inputs(s)
    full = _plan(requests, 1 << 62); c = full.chunks[0]
    ka = aligned_keys(k); pairs = int((full.ke - full.ks).sum())
    items = full.work_items(c, work_shape(q, ka))
    buf = torch.empty(c.rows, padded(c.width), device="cuda")[:, : c.width]
    arms = {"strided": k_scale, "unit_stride": aligned_scales(k_scale)}
    r = {n: [] for n in arms}
    g = [fp8_gemm_tflops(rep=25)]
    for rep in range(6):
        for n, sc in (arms.items() if rep % 2 == 0 else list(arms.items())[::-1]):
            ms = _bench(lambda: mqa_logits_gluon(q, ka, sc, w, full.ks, full.ke, buf, col_offset=c.key_start,
                                                 clean=False, items=items), rep_ms=25)
            r[n].append(pairs * 2 * HEADS * DIM / ms / 1e9)
        g.append(fp8_gemm_tflops(rep=25))
    gm = statistics.mean(g)
    print(s.name, "gemm", round(gm), {n: round(statistics.median(v) / gm, 3) for n, v in r.items()}, flush=True)
    del buf; torch.cuda.empty_cache()
