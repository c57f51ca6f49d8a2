#!/usr/bin/env bash
# Builds the release binaries a GPU machine needs (it has no Rust toolchain)
# and collects them, stripped, into gpu-bin/ (or $1): the lily binary, the
# GPU test executables (target/release/deps/NAME-HASH, the newest of each,
# renamed to NAME) and the speed probes. Run from the repository root at the
# revision to measure; docs/gpu.md says what to do next.
set -euo pipefail
DEST=${1:-gpu-bin}
T=${CARGO_TARGET_DIR:-target}/release
cargo build --release -p lily
cargo test -p lily-cuda --release --no-run
cargo build -p lily-cuda --release --example bench --example attn_probe --example qmm_probe --example overlap_probe
mkdir -p "$DEST"
cp "$T/lily" "$T/examples/bench" "$T/examples/attn_probe" "$T/examples/qmm_probe" "$T/examples/overlap_probe" "$DEST/"
for t in nvrtc_compile gpu_kernels gpu_attention gpu_gdn gpu_qmm gpu_sampling gpu_runahead gpu_model memory_plan; do
  f=$(ls -t "$T"/deps/"$t"-* | grep -v '\.d$' | head -1)
  cp "$f" "$DEST/$t"
done
strip "$DEST"/*
du -sh "$DEST"
