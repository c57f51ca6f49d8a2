#!/usr/bin/env bash
# A/B of several revisions in one GPU call. On the development machine:
#
#   crates/cuda/scripts/ab-revisions.sh collect DEST REV...
#
# builds, for each revision (a branch, tag or commit), the bench example and
# the GPU test executables named in $TESTS (default: gpu_qmm gpu_gdn
# gpu_kernels gpu_model) in a temporary worktree, and collects them,
# stripped, into DEST/<name>/ (<name> = the revision with '/' as '-'), with
# this script beside them. Then, on the GPU machine (no Rust needed):
#
#   bash DEST/ab-revisions.sh run DEST [OUT]
#
# runs every revision's tests (LILY_REQUIRE_GPU=1: a skip fails; all of a
# revision's suites at once, the revisions one after another; RUN_TESTS=0
# skips them, TEST_ONLY="name ..." runs only those revisions' suites) and then $ROUNDS (default 2) interleaved rounds of
# `bench --random-layers 40 --lengths "$PREFILL" --batch $BATCH` per
# revision (PREFILL: prompt lengths whose prefill is timed too, default
# none; PARTS=K: each of them also as K sequences of length / K in one
# pass, `bench --parts`), so drifts in clocks and temperature fall on all of them alike;
# writes each run's JSON lines and logs under OUT (default DEST/out) and
# prints ms a step by batch size and revision, with each revision's seq0
# digests (equal digests across revisions = the same greedy tokens), then
# prefill tok/s by prompt length.
#
# Serving too: LILY=1 at collect also builds each revision's `lily`; then
# SERVE_CLIENTS="8,64" at run serves a full-shape synthetic checkpoint
# (`lily synth --preset full` into $SYNTH_DIR, default /tmp/lily-full,
# written on the CPU while the tests and benches run) with each revision
# in turn, $SERVE_ROUNDS (default 2) rounds, through scripts/bench-serve.sh
# (run from the repository root; $SERVE_PER_CLIENT requests of
# $SERVE_MAX_TOKENS tokens, default 2 and 128), JSON into OUT, and prints
# aggregate tok/s and TTFT p50 by revision and client count.
set -euo pipefail

usage() {
  sed -n '2,20p' "$0" >&2
  exit 2
}

collect() {
  local dest=$1
  shift
  [ $# -ge 1 ] || usage
  local root
  root=$(git rev-parse --show-toplevel)
  local tests=${TESTS:-gpu_qmm gpu_gdn gpu_kernels gpu_model}
  local target=${CARGO_TARGET_DIR:-$root/target}/ab
  mkdir -p "$dest"
  cp "$0" "$dest/ab-revisions.sh"
  for rev in "$@"; do
    local name=${rev//\//-}
    local wt
    wt=$(mktemp -d /tmp/ab-wt.XXXXXX)
    git -C "$root" worktree add --detach -q "$wt" "$rev"
    (
      cd "$wt"
      CARGO_TARGET_DIR=$target cargo build --release -p lily-cuda --example bench
      CARGO_TARGET_DIR=$target cargo test --release -p lily-cuda --no-run
      if [ "${LILY:-0}" = 1 ]; then CARGO_TARGET_DIR=$target cargo build --release -p lily; fi
    )
    mkdir -p "$dest/$name"
    cp "$target/release/examples/bench" "$dest/$name/"
    for t in $tests; do
      local f
      f=$(ls -t "$target"/release/deps/"$t"-* | grep -v '\.d$' | head -1)
      cp "$f" "$dest/$name/$t"
    done
    if [ "${LILY:-0}" = 1 ]; then cp "$target/release/lily" "$dest/$name/lily"; fi
    strip "$dest/$name"/*
    git -C "$wt" rev-parse HEAD >"$dest/$name/REVISION"
    git -C "$root" worktree remove --force "$wt"
    echo "collected $rev ($(cat "$dest/$name/REVISION")) into $dest/$name"
  done
  du -sh "$dest"
}

run() {
  local dest=$1
  local out=${2:-$dest/out}
  local rounds=${ROUNDS:-2}
  local batch=${BATCH:-1,2,4,8,16,32,64,128}
  export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
  mkdir -p "$out"
  local names=()
  for d in "$dest"/*/; do
    [ -x "$d/bench" ] && names+=("$(basename "$d")")
  done
  [ ${#names[@]} -ge 1 ] || { echo "no revisions under $dest" >&2; exit 1; }
  local prefill=${PREFILL:-}
  local synth_dir=${SYNTH_DIR:-/tmp/lily-full} synth_pid=
  if [ -n "${SERVE_CLIENTS:-}" ] && [ ! -f "$synth_dir/config.json" ]; then
    # Written on the CPU (a few threads, lowest priority) while the GPU runs the tests and benches.
    RAYON_NUM_THREADS=4 nice -n 19 "$dest/${names[0]}/lily" synth --preset full --out "$synth_dir" >"$out/synth.log" 2>&1 &
    synth_pid=$!
  fi
  if [ "${RUN_TESTS:-1}" != 0 ]; then
    for n in "${names[@]}"; do
      case " ${TEST_ONLY:-$n} " in *" $n "*) ;; *) continue ;; esac
      local pids=()
      for t in "$dest/$n"/gpu_*; do
        [ -x "$t" ] || continue
        (
          log="$out/$n-$(basename "$t").log"
          if timeout 300 "$t" --test-threads=2 >"$log" 2>&1; then rc=0; else rc=$?; fi
          echo "$n $(basename "$t") rc $rc: $(grep -h 'test result' "$log" | tail -1)"
        ) &
        pids+=($!)
      done
      # Only the suites: a bare `wait` would also wait for (and reap) the
      # synthetic checkpoint being written in the background.
      if [ ${#pids[@]} -gt 0 ]; then wait "${pids[@]}"; fi
    done
  fi
  for r in $(seq 1 "$rounds"); do
    for n in "${names[@]}"; do
      timeout 120 "$dest/$n/bench" --random-layers 40 --lengths "$prefill" ${PARTS:+--parts "$PARTS"} --batch "$batch" >"$out/$n-round$r.json" 2>"$out/$n-round$r.err" ||
        echo "$n round $r: bench failed (see $out/$n-round$r.err)"
    done
  done
  if [ -n "${SERVE_CLIENTS:-}" ]; then
    if [ -n "$synth_pid" ]; then wait "$synth_pid" || echo "lily synth failed (see $out/synth.log)"; fi
    for r in $(seq 1 "${SERVE_ROUNDS:-2}"); do
      for n in "${names[@]}"; do
        [ -x "$dest/$n/lily" ] || { echo "$n: no lily binary (collect with LILY=1)"; continue; }
        LILY_BIN="$dest/$n/lily" BENCH_JSON="$out/$n-serve$r.json" timeout 300 \
          bash scripts/bench-serve.sh "$synth_dir" "$SERVE_CLIENTS" "${SERVE_PER_CLIENT:-2}" "${SERVE_MAX_TOKENS:-128}" >"$out/$n-serve$r.txt" 2>&1 ||
          echo "$n serve round $r failed (see $out/$n-serve$r.txt)"
      done
    done
  fi
  python3 - "$out" "$rounds" "${names[@]}" <<'PY'
import glob, json, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows, pre = {}, {}
for n in names:
    for r in range(1, rounds + 1):
        try:
            lines = open(f"{out}/{n}-round{r}.json").read().splitlines()
        except OSError:
            continue
        for l in lines:
            if not l.startswith("{"):
                continue
            j = json.loads(l)
            if "batch" in j:
                rows.setdefault((n, j["batch"]), []).append((j["step_ms"], j["seq0_digest"]))
            elif "parts" in j:
                # K sequences in one pass: keyed "Kx<tokens each>", no digest.
                pre.setdefault((n, f'{j["parts"]}x{j["part_tokens"]}'), []).append((j["prefill_tok_s"], ""))
            elif "prefill_tok_s" in j:
                pre.setdefault((n, j["prompt_tokens"]), []).append((j["prefill_tok_s"], j["digest"]))
def table(title, data, fmt):
    keys = sorted({k for (_, k) in data}, key=lambda k: str(k).zfill(12))
    if not keys:
        return
    print(title)
    print("revision".ljust(24) + "".join(f"{k:>22}" for k in keys))
    for n in names:
        cells = []
        for k in keys:
            v = data.get((n, k), [])
            cells.append(" / ".join(fmt(x) for x, _ in v) + (f" {v[0][1][:6]}" if v else ""))
        print(n.ljust(24) + "".join(f"{c:>22}" for c in cells))
table("ms a step (rounds), seq0 digest", rows, lambda ms: f"{ms:.3f}")
table("prefill tok/s (rounds), digest", pre, lambda x: f"{x:.0f}")
serve = {}
for n in names:
    for f in sorted(glob.glob(f"{out}/{n}-serve*.json")):
        for ph in json.load(open(f)).get("phases", []):
            serve.setdefault((n, f'{ph["clients"]} clients'), []).append((ph["agg_output_tok_s"], ""))
            serve.setdefault((n, f'{ph["clients"]} TTFT p50'), []).append((ph["ttft_s"]["p50"] * 1e3, ""))
table("served: aggregate tok/s and TTFT p50 ms (rounds)", serve, lambda x: f"{x:.0f}")
PY
}

case "${1:-}" in
  collect) shift; [ $# -ge 2 ] || usage; collect "$@" ;;
  run) shift; [ $# -ge 1 ] || usage; run "$@" ;;
  *) usage ;;
esac
