#!/usr/bin/env bash
# Issue 6 on the GPU host: the fault and load checks that need the real
# CUDA backend and a full-shape checkpoint.
#
#   scripts/h200-reliability.sh [STAGES]     (default: "faults load")
#
# - faults: tests/e2e/gpu_faults.py (the KV pool runs out inside one request:
#   that request fails, the other and the next are served; then $PRESSURE_S
#   seconds (default 90) of 16 clients with long prompts keeping the pool
#   short, where every answer must be complete or that error; SIGTERM exits 0);
# - load: `lily serve` + scripts/load_test.py, 64 streaming clients for
#   $LOAD_S seconds (default 120) after a $WARMUP_S s warm-up (default 20),
#   server memory sampled against the warm baseline; then SIGTERM, which
#   must drain and exit 0.
#
# The binary is $LILY_BIN (default target/release/lily; on a GPU machine
# without Rust, build it on a development machine, copy it with the
# repository into gpu-bin/ and set LILY_BIN=gpu-bin/lily: docs/gpu.md); the
# checkpoint ${LILY_BENCH_DIR:-/tmp/lily-full} is written once with `lily
# synth --preset full`. Reports go to $OUT (default ./h200-out). Standard library Python.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${LILY_BIN:-target/release/lily}
MODEL=${LILY_BENCH_DIR:-/tmp/lily-full}
OUT=${OUT:-$PWD/h200-out}
STAGES=${1:-"faults load"}
LOAD_S=${LOAD_S:-120}
WARMUP_S=${WARMUP_S:-20}
mkdir -p "$OUT"
if [ ! -f "$MODEL/config.json" ]; then
  /usr/bin/time -v "$BIN" synth --preset full --out "$MODEL" > "$OUT/synth.log" 2>&1 || { tail -20 "$OUT/synth.log"; exit 1; }
fi
status=0
for s in $STAGES; do
  case $s in
    faults)
      python3 tests/e2e/gpu_faults.py --bin "$BIN" --model "$MODEL" --pressure-seconds "${PRESSURE_S:-90}" \
        --log "$OUT/faults_server.log" > "$OUT/faults.json"
      rc=$?; echo "== faults: rc $rc"; [ $rc = 0 ] || status=1 ;;
    load)
      PORT=18201
      "$BIN" serve --model "$MODEL" --device cuda --bind "127.0.0.1:$PORT" --max-concurrent 64 \
        --served-model-name lily > "$OUT/load_server.log" 2>&1 &
      PID=$!
      for _ in $(seq 1 600); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null && break
        kill -0 $PID 2>/dev/null || break
        sleep 0.5
      done
      python3 scripts/load_test.py --base-url "http://127.0.0.1:$PORT" --clients 64 --duration-s "$LOAD_S" \
        --warmup-s "$WARMUP_S" --server-pid $PID --json "$OUT/load.json" > "$OUT/load.txt" 2>&1
      rc=$?; echo "== load: rc $rc"; [ $rc = 0 ] || status=1
      kill -TERM $PID
      start=$(date +%s); wait $PID; src=$?
      echo "== load server after SIGTERM: exit $src in $(( $(date +%s) - start )) s"; [ $src = 0 ] || status=1
      tail -5 "$OUT/load.txt" ;;
  esac
done
exit $status
