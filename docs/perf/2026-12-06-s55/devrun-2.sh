# Session 55, call 2 (~8 min on an H200, ~3 on another card). Carries c55a.tar.xz (git-ignored):
#   g55/main/{lily,bench,qmm_probe,REVISION}: main 9673c2f9 (its kernels: 974d4b20, history 192 merged)
#   run(command="bash docs/perf/2026-12-06-s55/devrun-2.sh", carry=["c55a.tar.xz"])
# Any card: crates/cuda/scripts/probes/expert_stream.cu (the 64-token experts' weight stream alone, codes only: per-lane
#   cp.async as qmm, 128-byte bulk copies a row, or one TMA box a stage, at ring depths and blocks an SM); Nsight Compute of one 256-token prefill (4 random layers: 3 DeltaNet, 1 attention, the full model's
#   shapes; SpeedOfLight, LaunchStats, Occupancy of every kernel), for the per-kernel table of issue 12's shortest
#   prompt against each kernel's floor (the last such table is session 31's at 4,096 tokens).
# H200 only: qmm_probe's stage-math parts at 1 / 8 / 64 tokens (+ rings of 2). (Main's ten-length `lily bench` on an
#   H200 is devrun-3.sh, left out of this call to fit the session's device budget.)
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r2; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c55a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g55/main; echo "main $(cut -c1-8 $G/REVISION)" | tee -a $S
H200=0; case "$GPU" in *H200*) H200=1;; esac
nvcc -O3 -arch=sm_90a -o /tmp/expert_stream crates/cuda/scripts/probes/expert_stream.cu > $O/expert-stream.txt 2>&1 && timeout 60 /tmp/expert_stream >> $O/expert-stream.txt 2>&1; echo "expert_stream rc $?" | tee -a $S
cat $O/expert-stream.txt >> $S
if [ $H200 = 1 ]; then
  timeout 100 $G/qmm_probe 1,8,64 0,2,5,11,12,13,14 > $O/qmm-probe-parts.txt 2>&1; echo "qmm_probe rc $?" | tee -a $S
  cat $O/qmm-probe-parts.txt >> $S
fi
timeout 150 ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy --launch-skip 182 -c 120 \
  -o $O/p256 $G/bench --random-layers 4 --lengths 256 --steps 1 > $O/ncu-p256.log 2>&1; echo "ncu rc $?" | tee -a $S
ncu --import $O/p256.ncu-rep --csv --page details --print-metric-name name > $O/p256-details.csv 2>&1; rm -f $O/p256.ncu-rep
tail -3 $O/ncu-p256.log | tee -a $S
python3 crates/cuda/scripts/ncu_summary.py $O/p256-details.csv 2>&1 | tee $O/p256-summary.txt | head -40 >> $S
(cd $OUT && tar czf r2.tgz r2)
