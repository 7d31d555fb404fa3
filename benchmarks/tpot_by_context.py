"""Time per output token through `cpkv serve`, by context length (issue 45's TPOT at 1K / 32K / 128K).

    python3 benchmarks/tpot_by_context.py make TRACE.jsonl [--lengths 1024,32768,131072] [--each 3]
    python3 benchmarks/tpot_by_context.py report RUN.jsonl [--json]

``make`` writes a trace (docs/trace-format.md) of ``--each`` fresh prompts per length, no shared prefixes, for
``benchmarks/serve_ab.sh`` (TRACE_FILE) and ``cpkv bench serve --closed-loop --max-tokens N``: one generation at a time,
so each request's TPOT is the batch-of-one decode step as the server runs it, the context growing from its prompt.
``report`` reads the load generator's per-request JSONL (``--out-jsonl``) and gives, per prompt length, the requests
that finished, TPOT p50 / p90 and TTFT p50 (the first token's wait is the prefill's, not the decode's).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def make_trace(lengths: list[int], each: int) -> list[dict]:
    """``each`` requests per length, lengths interleaved (1K, 32K, 128K, 1K, ...) so a slow first use of a kernel
    falls on every length's first request alike."""
    return [{"id": f"L{n}.{i}", "arrival": round(0.001 * (i * len(lengths) + j), 3), "prompt_len": n}
            for i in range(each) for j, n in enumerate(lengths)]


def report(rows: list[dict]) -> list[dict]:
    """Per prompt length (ascending): requests, finished ok, TPOT p50 / p90 (ms), TTFT p50 (s)."""
    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(int(r["prompt_tokens"]), []).append(r)
    out = []
    for n in sorted(by):
        ok = [r for r in by[n] if r.get("error") is None and r.get("tpot_s") is not None]
        tpot = np.asarray([r["tpot_s"] for r in ok], dtype=np.float64) * 1e3
        ttft = np.asarray([r["ttft_s"] for r in ok if r.get("ttft_s") is not None], dtype=np.float64)
        q = (lambda a, p: round(float(np.percentile(a, p)), 3) if a.size else None)
        out.append({"prompt_tokens": n, "requests": len(by[n]), "ok": len(ok), "tpot_ms_p50": q(tpot, 50),
                    "tpot_ms_p90": q(tpot, 90), "ttft_s_p50": q(ttft, 50),
                    "completion_tokens": sum(int(r.get("completion_tokens") or 0) for r in ok)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write the trace")
    mk.add_argument("path")
    mk.add_argument("--lengths", default="1024,32768,131072")
    mk.add_argument("--each", type=int, default=3)
    rp = sub.add_parser("report", help="TPOT per prompt length from a run's --out-jsonl")
    rp.add_argument("path")
    rp.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "make":
        try:
            lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--lengths: expected comma-separated integers, got {a.lengths!r}")
        if not lengths or min(lengths) < 1 or a.each < 1:
            ap.error("--lengths and --each must be positive")
        with open(a.path, "w") as f:
            for r in make_trace(lengths, a.each):
                f.write(json.dumps(r) + "\n")
        return 0
    with open(a.path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    table = report(rows)
    if a.json:
        print(json.dumps(table, indent=1))
    else:
        print(f"{'prompt':>8} {'ok':>5} {'TPOT p50 ms':>12} {'p90':>8} {'TTFT p50 s':>11}")
        for r in table:
            print(f"{r['prompt_tokens']:>8} {r['ok']:>2}/{r['requests']:<2} {r['tpot_ms_p50'] or '-':>12} "
                  f"{r['tpot_ms_p90'] or '-':>8} {r['ttft_s_p50'] or '-':>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
