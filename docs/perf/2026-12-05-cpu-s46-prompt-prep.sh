#!/usr/bin/env bash
# The runs of docs/perf/2026-12-05-cpu-s46-prompt-prep.txt: one client, 8
# requests of ~265 prompt tokens and 128 output tokens, against each `lily`
# binary $BINS/lily-NAME (NAME in $NAMES, default "base tok inline") in
# turn, two rounds, on the CPU demo; prints each request's preparation time
# (since_arrival_us) and the benchmark's summary line. Logs go to $OUT.
set -u
BINS=${BINS:?directory with the lily-NAME binaries}
OUT=${OUT:-$(mktemp -d)}
cd "$(dirname "$0")/../.."
for round in 1 2; do
  for b in ${NAMES:-base tok inline}; do
    RUST_LOG=lily_server=debug "$BINS/lily-$b" serve --bind 127.0.0.1:18300 > "$OUT/$b-$round.log" 2>&1 &
    pid=$!
    for _ in $(seq 50); do curl -s 127.0.0.1:18300/v1/models >/dev/null && break; sleep 0.2; done
    python3 scripts/serve_bench.py --base-url http://127.0.0.1:18300 --clients 1 --requests-per-client 8 \
      --max-tokens 128 --json "$OUT/$b-$round.json" > "$OUT/$b-$round.txt" 2>&1
    kill -9 $pid; wait $pid 2>/dev/null
    v=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/$b-$round.log" | grep -a -o 'since_arrival_us=[0-9]*' | cut -d= -f2 | tr '\n' ' ')
    echo "$b round $round since_arrival_us: $v | $(tail -1 "$OUT/$b-$round.txt")"
  done
done
