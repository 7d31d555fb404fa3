#!/usr/bin/env bash
# One closed-loop run of the seed-shaped trace against a fresh `cpkv serve` per option set, the same trace for each:
# an A/B of server options (e.g. `--graph-tokens 0` against the default) through the HTTP path, every report in OUT_DIR.
#
#   benchmarks/serve_ab.sh OUT_DIR "NAME=SERVER OPTIONS" ["NAME=SERVER OPTIONS" ...]
#
# Environment (defaults: the CPU tiny model): GEOM (options of both the server and the load generator: the batch
# geometry), SERVE_EXTRA (options of every server), TRACE (`cpkv bench serve --make-trace` options), TRACE_FILE (a
# trace file to use instead), WARMUP (unrecorded requests first, default 4), CPKV (the cpkv command), PORT (30000),
# BOOT_S (seconds to wait for /health, 600), LOAD_EXTRA (options of the load generator only, e.g. --max-tokens 32
# for TPOT).
# A server that exits or never answers ends the script with status 1 and the tail of its log.
set -euo pipefail
out=${1:?usage: $0 OUT_DIR NAME=OPTIONS ...}; shift
[ $# -gt 0 ] || { echo "usage: $0 OUT_DIR NAME=OPTIONS ..."; exit 2; }
mkdir -p "$out"
TRACE=${TRACE:---requests 40 --scale 0.0078125}
. "$(dirname "$0")/serve_lib.sh"

if [ -n "${TRACE_FILE:-}" ]; then cp "$TRACE_FILE" "$out/trace.jsonl"; else
    # shellcheck disable=SC2086
    $cpkv bench serve --make-trace "$out/trace.jsonl" $TRACE
fi
for spec in "$@"; do
    name=${spec%%=*}; opts=${spec#*=}
    # shellcheck disable=SC2086
    start_server "$name" $opts
    # shellcheck disable=SC2086
    $cpkv bench serve --url "$url" --trace "$out/trace.jsonl" $GEOM ${LOAD_EXTRA:-} --warmup "$WARMUP" --closed-loop \
        --out-jsonl "$out/$name.jsonl" --json >"$out/$name.json"
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        "$url/metrics" >"$out/metrics_$name.txt"
    stop
    python3 - "$out/$name.json" "$name" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
f = lambda d: " / ".join("-" if d[q] is None else f"{d[q]:.3g}" for q in ("p50", "p90", "p99"))
print(f"{sys.argv[2]}: {s['completed']}/{s['requests']} ok, {s['failed']} failed, hit {s['cache_hit_ratio']}, "
      f"TTFT p50/p90/p99 {f(s['ttft_s'])} s")
EOF
done
