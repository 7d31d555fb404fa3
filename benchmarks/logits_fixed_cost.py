"""Experiment (GPU, Hopper): tail-shaped logits (prefix 64,512 keys) at T = 512 ... 8192 new tokens, timed by
do_bench and as a CUDA graph of 10 back-to-back launches; a linear fit of time against pairs splits a fixed
per-launch cost from the per-pair rate. Results in BENCHMARKS.md (indexer, fifth pass).

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/logits_fixed_cost.py``. Not part of the package."""
import torch, statistics
from cpkv.bench.timing import do_bench_ms as _bench
from cpkv.bench.indexer import Scenario, make_inputs, indexer_plan as _plan, HEADS, DIM
from cpkv.indexer.logits import aligned_keys, aligned_scales, logits_into
from cpkv.indexer.plan import padded
res = {}
for T in (512, 1024, 2048, 4096, 8192):
    s = Scenario(f"t{T}", ((64512, T),))
    q, k, k_scale, w, requests = make_inputs(s)
    full = _plan(requests, 1 << 62); c = full.chunks[0]
    ka, ksc = aligned_keys(k), aligned_scales(k_scale)
    buf = torch.empty(c.rows, padded(c.width), device="cuda")[:, : c.width]
    f = lambda: logits_into(q, ka, ksc, w, full.ks, full.ke, buf, col_offset=c.key_start, clean=False, work=lambda sh: full.work_items(c, sh))
    pairs = int((full.ke - full.ks).sum())
    ms = [_bench(f, rep_ms=25) for _ in range(3)]
    # a CUDA graph of 10 back-to-back launches (no L2 flush between them)
    g = torch.cuda.CUDAGraph()
    f(); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(10): f()
    gms = [_bench(lambda: g.replay(), rep_ms=50) / 10 for _ in range(3)]
    res[T] = (statistics.median(ms), statistics.median(gms), pairs)
    print(T, "ms", round(statistics.median(ms), 4), "graph ms/launch", round(statistics.median(gms), 4), "TFLOP/s", round(pairs * 2 * HEADS * DIM / statistics.median(ms) / 1e9), round(pairs * 2 * HEADS * DIM / statistics.median(gms) / 1e9), flush=True)
    del buf; torch.cuda.empty_cache()
Ts = sorted(res); xs = [res[t][2] for t in Ts]
for j in (0, 1):
    ys = [res[t][j] for t in Ts]
    n = len(xs); mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print("fit", "do_bench" if j == 0 else "graph", "fixed ms", round(my - b * mx, 4), "TFLOP/s marginal", round(2 * HEADS * DIM / b / 1e9))
