# Session 57, call 6 (any card, ~2 min). Carries c57c.tar.xz (g57/b3: the s57-grouped-qmm branch's bench, v3):
#   run(command="bash docs/perf/2026-12-06-s57/devrun-5.sh", carry=["c57c.tar.xz"])
# Nsight Compute of the 256-token pass's routed experts (4 random layers; the first two launches of each kernel,
# gate/up then down): qmm_grouped_f16 (--short-experts qmm) against gemm_q4_bm16 (gemm): why history 196 is slower.
set -u
S=$OUT/summary.txt; O=$OUT/n; mkdir -p $O /tmp/g
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf c57c.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g57/b3
for p in qmm gemm; do
  K=gemm_q4_bm16; [ $p = qmm ] && K=qmm_grouped_f16
  timeout 170 ncu --clock-control none -k regex:$K -c 2 --section SpeedOfLight --section WarpStateStats --section InstructionStats \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis -o $O/$p $B/bench --random-layers 4 --lengths 256 --steps 1 \
    --short-experts $p > $O/$p.log 2>&1; echo "ncu $p rc $? at ${SECONDS}s" | tee -a $S
  ncu --import $O/$p.ncu-rep --page details > $O/$p.txt 2>&1
  grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Issue Slots Busy|Executed Ipc Active|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Avg. Active Threads|L1/TEX Hit|L2 Hit|Executed Instructions  " $O/$p.txt | head -60 >> $S
done
(cd $OUT && tar czf n.tgz n)
