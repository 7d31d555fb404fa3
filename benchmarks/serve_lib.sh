# Sourced by benchmarks/serve_solo_mix.sh and benchmarks/serve_ab.sh: the defaults both share, and a fresh
# `cpkv serve` started and stopped. Needs $out (the output folder) set first.
# Environment: GEOM (options of both the server and the load generator: the batch geometry), SERVE_EXTRA (options
# of the server only), WARMUP (unrecorded requests first, default 4), CPKV (the cpkv command), PORT (30000), BOOT_S
# (seconds to wait for /health, 600).
cpkv=${CPKV:-cpkv}
port=${PORT:-30000}
url="http://127.0.0.1:$port"
GEOM=${GEOM:---model tiny --cp 2 --chunk-size 512 --page-size 64 --pages-per-rank 256 --max-requests 8}
SERVE_EXTRA=${SERVE_EXTRA:---device cpu}
WARMUP=${WARMUP:-4}
pid=

start_server() {  # NAME OPTIONS...: a server with GEOM, SERVE_EXTRA and OPTIONS, logged to $out/serve_NAME.log;
    # waits until /health answers 200 (a server that exits or never answers: exit 1 with its log's tail)
    local name=$1; shift
    # shellcheck disable=SC2086
    $cpkv serve --port "$port" $GEOM $SERVE_EXTRA "$@" >"$out/serve_$name.log" 2>&1 &
    pid=$!
    for _ in $(seq "${BOOT_S:-600}"); do
        if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$url/health" \
            2>/dev/null; then return 0; fi
        if ! kill -0 "$pid" 2>/dev/null; then echo "server ($name) exited:"; tail -5 "$out/serve_$name.log"; exit 1; fi
        sleep 1
    done
    echo "server ($name) did not become healthy"; stop; exit 1
}

stop() {  # SIGTERM, then wait for it (the server drains and ends its ranks)
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; wait "$pid" || true; pid=; fi
}
trap stop EXIT
