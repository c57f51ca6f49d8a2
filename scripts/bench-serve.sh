#!/usr/bin/env bash
# Serving benchmark (docs/design.md §7.2, issue 5): N concurrent streaming clients over
# HTTP through the real server; aggregate output tok/s, time to first token
# and inter-token latency p50/p99 per N. Meant for the GPU host.
#
#   scripts/bench-serve.sh [MODEL_DIR] [COUNTS] [REQUESTS_PER_CLIENT] [MAX_TOKENS]
#
# Without MODEL_DIR a full-shape synthetic checkpoint is written once into
# ${LILY_BENCH_DIR:-/tmp/lily-full} (`lily synth --preset full`, ~20 GB).
# The binary is $LILY_BIN (default target/release/lily); on a GPU machine
# without Rust, build `lily` on a development machine, copy it with the
# repository into gpu-bin/ and set LILY_BIN=gpu-bin/lily (docs/gpu.md). The
# device is $LILY_DEVICE (default cuda); $LILY_SERVE_ARGS adds flags to
# `lily serve` (e.g. "--prefill-chunk 2048"). Prints the report of scripts/serve_bench.py
# (standard library Python only; --json to $BENCH_JSON when set) and the
# server's start-up summary. $BENCH_ARGS adds flags to serve_bench.py (e.g.
# "--temperature 0"). $LILY_SERVE_LOG keeps the server's log at that path
# (with RUST_LOG=debug: when each request was tokenized, admitted, drew its
# first token).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${LILY_BIN:-target/release/lily}
MODEL=${1:-}
COUNTS=${2:-1,8,32,64}
PER_CLIENT=${3:-4}
MAX_TOKENS=${4:-128}
DEVICE=${LILY_DEVICE:-cuda}
if [ -z "$MODEL" ]; then
  MODEL=${LILY_BENCH_DIR:-/tmp/lily-full}
  if [ ! -f "$MODEL/config.json" ]; then
    "$BIN" synth --preset full --out "$MODEL"
  fi
fi
MAX_CLIENTS=$(echo "$COUNTS" | tr ',' '\n' | sort -n | tail -1)
PORT=${LILY_BENCH_PORT:-18123}
LOG=${LILY_SERVE_LOG:-$(mktemp)}
"$BIN" serve --model "$MODEL" --device "$DEVICE" --bind "127.0.0.1:$PORT" \
  --max-concurrent "$MAX_CLIENTS" --served-model-name lily ${LILY_SERVE_ARGS:-} >"$LOG" 2>&1 &
PID=$!
trap 'kill -TERM $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 1200); do
  if python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; then break; fi
  if ! kill -0 $PID 2>/dev/null; then cat "$LOG"; echo "lily serve exited" >&2; exit 1; fi
  sleep 0.5
done
sed -n '/^lily serve/,/listening/p' "$LOG" >&2
rc=0
python3 scripts/serve_bench.py --base-url "http://127.0.0.1:$PORT" --clients "$COUNTS" \
  --requests-per-client "$PER_CLIENT" --max-tokens "$MAX_TOKENS" ${BENCH_JSON:+--json "$BENCH_JSON"} ${BENCH_ARGS:-} || rc=$?
# How the engine batched (decode batch-size histogram, prefix cache), to stderr.
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
  | grep -E '^lily_(decode|engine|prefix)' >&2 || true
exit $rc
