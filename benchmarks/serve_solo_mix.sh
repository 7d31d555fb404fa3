#!/usr/bin/env bash
# Solo vs mix TTFT on the seed-shaped trace, measured against `cpkv serve` by `cpkv bench serve`, with
# `cpkv replay`'s prediction beside each run. Three fresh servers (a run's prefix cache stays in the server):
#   1. --policy solo, the trace closed loop (every request alone): the calibration (costs) and its report;
#   2. --policy solo, the trace open loop;   3. --policy mix, the same.
# Runs 2 and 3 predict with the costs of run 1. Every report is written to OUT_DIR (JSON, JSONL, PNG).
#
#   benchmarks/serve_solo_mix.sh OUT_DIR
#
# Environment (defaults: the CPU tiny model):
#   GEOM         options given to both the server and the load generator (the batch geometry)
#   SERVE_EXTRA  options for the server only (device, layers)
#   TRACE        options of the seed-shaped trace (`cpkv bench serve --make-trace`)
#   LOAD         the open-loop load of runs 2 and 3 (default: the trace's arrivals)
#   WARMUP       unrecorded warm-up requests before each run (default 4)
#   CPKV         the cpkv command (default cpkv); PORT (default 30000); BOOT_S: seconds to wait for /health (600)
set -euo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
TRACE=${TRACE:---requests 120 --scale 0.0078125}
LOAD=${LOAD:-}
. "$(dirname "$0")/serve_lib.sh"

start() {  # policy, name
    start_server "$2" --policy "$1"
}

bench() {  # name, policy, options...
    local name=$1 policy=$2; shift 2
    # shellcheck disable=SC2086
    $cpkv bench serve --url "$url" --trace "$out/trace.jsonl" --policy "$policy" $GEOM --warmup "$WARMUP" \
        --out-jsonl "$out/$name.jsonl" --plot "$out/$name.png" --json "$@" >"$out/$name.json"
    python3 - "$out/$name.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
s, p = r["summary"], r["prediction"]
f = lambda d: " / ".join("-" if d[q] is None else f"{d[q]:.3g}" for q in ("p50", "p90", "p99"))
fit = r["calibration"].get("fitted_ttft_s")
model = f"replay {f(p['ttft_s'])}" if p else f"fitted {f(fit)}" if fit else "no model"
print(f"{sys.argv[1]}: {s['completed']}/{s['requests']} ok, {s['failed']} failed, hit {s['cache_hit_ratio']}, "
      f"TTFT p50/p90/p99 {f(s['ttft_s'])} s; {model} s")
EOF
}

# shellcheck disable=SC2086
$cpkv bench serve --make-trace "$out/trace.jsonl" $TRACE
start solo calib
bench calib solo --closed-loop
stop
for policy in solo mix; do
    start "$policy" "$policy"
    # shellcheck disable=SC2086
    bench "$policy" "$policy" $LOAD --costs "$out/calib.json"
    stop
done
