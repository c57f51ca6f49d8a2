#!/usr/bin/env bash
# Runs every fuzz target in fuzz/ for a bounded time and prints a summary.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]      (default 60, all targets)
#
# Corpora are kept in fuzz/corpus/<target>/ (new inputs are added there; the
# committed part is seeds plus a `cargo fuzz cmin` of what grew). A crash
# stops that target, leaves its input in fuzz/artifacts/<target>/, and is
# counted; the script then goes on with the next target and exits 1 at the
# end if anything crashed.
#
# Toolchain: cargo-fuzz needs nightly-only rustc flags (-Zsanitizer,
# sanitizer coverage). On a stable toolchain the script sets RUSTC_BOOTSTRAP=1,
# which unlocks them; this works with stable 1.95 and AddressSanitizer. Set
# LILY_FUZZ_SANITIZER=none for about twice the speed without ASan (coverage
# still works). Targets are built with debug assertions, so integer overflow
# is a crash. Install the tool with `cargo install cargo-fuzz`.
#
# Environment: LILY_FUZZ_SANITIZER (address|none, default address),
# LILY_FUZZ_RSS_MB (default 4096), LILY_FUZZ_ARGS (extra libFuzzer flags).
# Run it under `nice -n 10` on a shared machine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FUZZ="$ROOT/fuzz"
SECONDS_PER="${1:-60}"
shift || true
ALL_TARGETS=(request_json tool_parser reasoning safetensors_file safetensors_index config_json chat_template tokenizer stop_strings)
if [ "$#" -gt 0 ]; then TARGETS=("$@"); else TARGETS=("${ALL_TARGETS[@]}"); fi
SANITIZER="${LILY_FUZZ_SANITIZER:-address}"
RSS_MB="${LILY_FUZZ_RSS_MB:-4096}"

if ! [[ "$SECONDS_PER" =~ ^[0-9]+$ ]] || [ "$SECONDS_PER" -lt 1 ]; then
    echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]" >&2
    exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is missing: cargo install cargo-fuzz" >&2
    exit 2
fi
if ! rustc --version | grep -q nightly; then
    export RUSTC_BOOTSTRAP=1
fi

TRIPLE="$(rustc -vV | sed -n 's/^host: //p')"
cd "$FUZZ"
echo "building fuzz targets (sanitizer: $SANITIZER, debug assertions on)..." >&2
# `cargo fuzz build` takes one target or all; build all when several are asked.
if [ "${#TARGETS[@]}" -eq 1 ]; then
    cargo fuzz build -a -s "$SANITIZER" "${TARGETS[0]}" >&2
else
    cargo fuzz build -a -s "$SANITIZER" >&2
fi
BIN_DIR="$FUZZ/target/$TRIPLE/release"

SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/lily-fuzz.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
export LILY_FUZZ_SCRATCH="$SCRATCH"
LOG_DIR="$FUZZ/target/logs"
mkdir -p "$LOG_DIR"

# Structured targets (inputs decoded with `arbitrary`) get long inputs from
# the start; byte targets keep libFuzzer's growing length control.
max_len_args() {
    case "$1" in
        request_json|safetensors_file) echo "-max_len=16384" ;;
        *) echo "-max_len=4096 -len_control=0" ;;
    esac
}

declare -a ROWS
crashed=0
total_execs=0
total_secs=0
for t in "${TARGETS[@]}"; do
    bin="$BIN_DIR/$t"
    if [ ! -x "$bin" ]; then
        echo "no such fuzz target: $t" >&2
        exit 2
    fi
    mkdir -p "corpus/$t" "artifacts/$t"
    dict=()
    [ -f "dict/$t.dict" ] && dict=("-dict=dict/$t.dict")
    log="$LOG_DIR/$t.log"
    start=$(date +%s)
    set +e
    # shellcheck disable=SC2046
    "$bin" "corpus/$t" $(max_len_args "$t") "${dict[@]}" \
        -max_total_time="$SECONDS_PER" -timeout=20 -rss_limit_mb="$RSS_MB" \
        -print_final_stats=1 -artifact_prefix="artifacts/$t/" ${LILY_FUZZ_ARGS:-} >"$log" 2>&1
    rc=$?
    set -e
    secs=$(( $(date +%s) - start ))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    execs=${execs:-0}
    crashes=0
    if [ "$rc" -ne 0 ]; then
        crashes=1
        crashed=$(( crashed + 1 ))
        echo "$t: crashed (exit $rc); input: $(sed -n 's/.*Test unit written to //p' "$log" | tail -1); log: $log" >&2
    fi
    ROWS+=("$(printf '%-18s %8s %12s %8s %8s' "$t" "$secs" "$execs" "$crashes" "$(ls "corpus/$t" | wc -l)")")
    total_execs=$(( total_execs + execs ))
    total_secs=$(( total_secs + secs ))
done

printf '%-18s %8s %12s %8s %8s\n' target seconds execs crashes corpus
for r in "${ROWS[@]}"; do echo "$r"; done
printf '%-18s %8s %12s %8s\n' total "$total_secs" "$total_execs" "$crashed"
[ "$crashed" -eq 0 ]
