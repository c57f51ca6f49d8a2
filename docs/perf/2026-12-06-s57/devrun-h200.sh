# Session 57, for an H200 only (on another card it stops at once): session 55's devrun-4 then devrun-3 in one call,
# on c55a.tar.xz (main 9673c2f9's lily, bench, qmm_probe; main's kernels):
#   run(command="bash docs/perf/2026-12-06-s57/devrun-h200.sh [LIMIT_S]", carry=["c55a.tar.xz"], kind="nvidia-h200")
# (LIMIT_S: the call's time limit, default 590; step 2 runs only if ~7 min of it are left after step 1.)
# 1. The stream probe (history 194) and qmm_probe at 64 tokens, default against no math (history 184's question on
#    the H200: is the 64-token experts' ~2.4 TB/s the stream's structure or the math?). ~1 min.
# 2. Main's ten-length `lily bench` (the contract JSON of issues 11 and 12; the last on an H200 is session 41's). ~6 min.
set -u
LIMIT=${1:-590}
R=$PWD; S=$OUT/summary.txt; O=$OUT/h200; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
case "$GPU" in *H200*) ;; *) echo "not an H200: nothing run" | tee -a $S; exit 0;; esac
tar xJf $R/c55a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g55/main; echo "main $(cut -c1-8 $G/REVISION)" | tee -a $S
nvcc -O3 -arch=sm_90a -o /tmp/expert_stream crates/cuda/scripts/probes/expert_stream.cu > $O/expert-stream.txt 2>&1 && timeout 40 /tmp/expert_stream >> $O/expert-stream.txt 2>&1; echo "expert_stream rc $? at ${SECONDS}s" | tee -a $S
cat $O/expert-stream.txt >> $S
timeout 60 $G/qmm_probe 64 0,2 > $O/qmm-probe-64.txt 2>&1; echo "qmm_probe rc $? at ${SECONDS}s" | tee -a $S
grep -E "copy|moe" $O/qmm-probe-64.txt | tee -a $S
if [ $((LIMIT - SECONDS)) -lt 420 ]; then echo "contract skipped: $((LIMIT - SECONDS)) s left" | tee -a $S; (cd $OUT && tar czf h200.tgz h200); exit 0; fi
CK=/tmp/lily-full
RAYON_NUM_THREADS=16 $G/lily synth --preset full --out $CK > $O/synth.log 2>&1; tail -1 $O/synth.log | tee -a $S
timeout $((LIMIT - 10 - SECONDS)) $G/lily bench --model $CK --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf h200.tgz h200)
