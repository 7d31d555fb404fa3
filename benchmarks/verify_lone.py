"""Where the engine and its single-process reference part, at cp 1 (issue 43's cause, recorded in BENCHMARKS.md).

For GLM-5's first 1..4 layers, bf16 and fp8 weights, graphs off and on: a request run alone in one batch (the engine
then computes what the reference computes, row for row, on a batch of the same size) and the same request batched
with others (the GEMMs see another row count) -> each request's max |logit diff| against the reference, with its
decisions forced (cpkv.engine.taps). A lone request's diff 0 says the engine's path equals the reference's; a
batched one's shows what batching alone changes, layer by layer.

    python3 benchmarks/verify_lone.py [--model glm5] [--json]
"""
from __future__ import annotations

import argparse
import json

from cpkv.engine.config import EngineConfig
from cpkv.engine.engine import run_jobs, verify_run
from cpkv.scheduler.trace import TraceRequest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm5")
    ap.add_argument("--layers", default="1,2,3,4")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    alone = [TraceRequest("a", 0.0, 448)]
    batched = [TraceRequest("a", 0.0, 448), TraceRequest("b", 0.0, 320), TraceRequest("c", 0.0, 200)]
    rows = []
    for weights in ("bf16", "fp8"):
        for layers in [int(x) for x in args.layers.split(",")]:
            for graphs in (0, 1024):
                base = EngineConfig(model=args.model, num_layers=layers, cp=1, device="cuda", weights=weights,
                                    record=True, graph_tokens=graphs, chunk_size=1024, page_size=64)
                jobs = [(base, alone), (base, batched)]
                for (cfg, trace), res in zip(jobs, run_jobs(jobs, timeout_s=500)):
                    rep = verify_run(res, trace)
                    rows.append({"weights": weights, "layers": layers, "graphs": graphs, "batch": len(trace),
                                 "diffs": {q["id"]: q.get("diff") for q in rep.requests},
                                 "experts_differ": rep.decisions["route"].differed,
                                 "noise": round(rep.decisions["route"].noise, 6)})
                    print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
