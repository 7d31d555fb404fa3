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
cpkv=${CPKV:-cpkv}
port=${PORT:-30000}
url="http://127.0.0.1:$port"
GEOM=${GEOM:---model tiny --cp 2 --chunk-size 512 --page-size 64 --pages-per-rank 256 --max-requests 8}
SERVE_EXTRA=${SERVE_EXTRA:---device cpu}
TRACE=${TRACE:---requests 120 --scale 0.0078125}
LOAD=${LOAD:-}
WARMUP=${WARMUP:-4}
pid=

start() {  # start a server with the given policy; wait until /health answers 200
    # shellcheck disable=SC2086
    $cpkv serve --port "$port" --policy "$1" $GEOM $SERVE_EXTRA >"$out/serve_$2.log" 2>&1 &
    pid=$!
    for _ in $(seq "${BOOT_S:-600}"); do
        if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$url/health" \
            2>/dev/null; then return 0; fi
        if ! kill -0 "$pid" 2>/dev/null; then echo "server ($2) exited:"; tail -5 "$out/serve_$2.log"; exit 1; fi
        sleep 1
    done
    echo "server ($2) did not become healthy"; stop; exit 1
}

stop() {  # SIGTERM, then wait for it (the server drains and ends its ranks)
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" || true; pid=; fi
}
trap stop EXIT

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
