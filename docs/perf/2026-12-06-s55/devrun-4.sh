# Session 55, call 4 (any card, ~1 min; what was left of the device budget after five failed starts): the stream probe
# (crates/cuda/scripts/probes/expert_stream.cu) and, on an H200, qmm_probe at 64 tokens, default against no math.
#   run(command="bash docs/perf/2026-12-06-s55/devrun-4.sh", carry=["c55a.tar.xz"], timeout_s=90)
set -u
R=$PWD; S=$OUT/summary.txt; mkdir -p /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
nvcc -O3 -arch=sm_90a -o /tmp/expert_stream crates/cuda/scripts/probes/expert_stream.cu > $OUT/expert-stream.txt 2>&1 && timeout 40 /tmp/expert_stream >> $OUT/expert-stream.txt 2>&1; echo "expert_stream rc $?" | tee -a $S
case "$GPU" in *H200*)
  tar xJf $R/c55a.tar.xz -C /tmp/g && timeout 40 /tmp/g/g55/main/qmm_probe 64 0,2 > $OUT/qmm-probe-64.txt 2>&1; echo "qmm_probe rc $?" | tee -a $S;;
esac
