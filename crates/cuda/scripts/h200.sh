#!/usr/bin/env bash
# The GPU suite and a speed probe on the H200, from test binaries built on a
# development machine (the GPU machine needs no Rust toolchain):
#
#   1. on the development machine, at the revision to test:
#        bash crates/cuda/scripts/collect-gpu-bin.sh
#      (builds lily, the GPU test executables and the speed probes and copies
#      them, stripped, into gpu-bin/, which git ignores);
#   2. copy the repository, gpu-bin/ included, to the GPU machine;
#   3. there, from the repository root: bash crates/cuda/scripts/h200.sh
#      (BIN=DIR when the binaries are in another folder).
#
# docs/gpu.md gives these steps as commands. Logs go to $OUT (or ./h200-out);
# the last lines summarise every binary.
set -u
OUT=${OUT:-$PWD/h200-out}
mkdir -p "$OUT"
BIN=${BIN:-gpu-bin}
export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
STAGES=${STAGES:-"nvrtc qmm kernels attention gdn sampling runahead bench attnprobe model"}
BENCH_ARGS=${BENCH_ARGS:-"--random-layers 40 --lengths 256,4096,32768 --steps 64 --profile --batch 1,8,32,64,128"}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
run() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  local start=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
}
for s in $STAGES; do
  case $s in
    nvrtc) run nvrtc 60 "$BIN/nvrtc_compile" --test-threads=4 ;;
    qmm) run qmm 240 "$BIN/gpu_qmm" --test-threads=2 --nocapture ;;
    kernels) run kernels 200 "$BIN/gpu_kernels" --test-threads=6 --nocapture ;;
    attention) run attention 200 "$BIN/gpu_attention" --test-threads=4 --nocapture ;;
    gdn) run gdn 200 "$BIN/gpu_gdn" --test-threads=4 --nocapture ;;
    sampling) run sampling 90 "$BIN/gpu_sampling" --test-threads=4 --nocapture ;;
    runahead) run runahead 200 "$BIN/gpu_runahead" --test-threads=3 --nocapture ;;
    bench) run bench 110 "$BIN/bench" $BENCH_ARGS ;;
    attnprobe) run attnprobe 120 "$BIN/attn_probe" ;;   # attention kernels alone, one layer
    model) run model 240 "$BIN/gpu_model" --test-threads=2 --nocapture ;;
    ncu) # per-kernel GPU time of a short run (prefill of 256 + 2x2 decode steps)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || echo /usr/local/cuda/bin/ncu)
      run ncu 240 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu.csv" \
        "$BIN/bench" --random-layers 40 --lengths 256 --steps 2
      python3 crates/cuda/scripts/ncu_summary.py "$OUT/ncu.csv" 4 > "$OUT/ncu_summary.txt" 2>&1 ;;
    ncu-stalls) # why the prefill GEMM's wgmma tiles wait: warp stall reasons (sampled per
      # instruction) of the first in-projection, out-projection and expert launches of a
      # 4,096-token prefill (NOTES.md, "What limits serving next": the tensor pipe is ~48% busy)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || echo /usr/local/cuda/bin/ncu)
      run ncu-stalls 240 "$NCU" --clock-control none -k regex:gemm_q4_bm128 --launch-count 4 \
        --section WarpStateStats --section SourceCounters --section SchedulerStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --log-file "$OUT/ncu-stalls.txt" \
        "$BIN/bench" --random-layers 40 --lengths 4096 --steps 2 ;;
  esac
done
echo "---- summary"
for f in nvrtc qmm kernels attention gdn sampling runahead model; do
  [ -f "$OUT/$f.log" ] && grep -E "^test result|panicked|FAILED CHECK|^test .* FAILED" "$OUT/$f.log" | head -40
done
[ -f "$OUT/bench.log" ] && grep -vE "^upload" "$OUT/bench.log" | tail -45
[ -f "$OUT/attnprobe.log" ] && cat "$OUT/attnprobe.log"
[ -f "$OUT/ncu_summary.txt" ] && head -40 "$OUT/ncu_summary.txt"
cat "$OUT/summary.txt"
