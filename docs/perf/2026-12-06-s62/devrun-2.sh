# Session 62, call 2 (any card; ~2 min), c62n.tar.xz (g62a/t/bench: the 256-row tile, A by TMA): Nsight Compute of a
# 256-token prefill's dense in-projection on the 256-row tile (--dense-whole 96) and on two 128-row tiles (off):
# why one block an SM on m64n256 ran slower (call 1: 42 against 36 us a DeltaNet in-projection): speed of light,
# the tensor pipe, warp states and the stall reasons per issue.
set -u
R=$PWD; S=$OUT/summary2.txt; O=$OUT/r2; mkdir -p $O /tmp/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
[ -d /tmp/x/g62a ] || tar xJf $R/c62n.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/x/g62a/t/bench
for c in 96:bm256 off:bm128; do
  w=${c%%:*}; k=${c##*:}
  timeout 150 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    -k regex:"^gemm_q4_${k}\$" -c 3 -o $O/p-$w \
    $B --random-layers 4 --lengths 256 --steps 2 --dense-whole $w > $O/ncu-$w.log 2>&1; echo "ncu $w rc $? at ${SECONDS}s" | tee -a $S
  ncu --import $O/p-$w.ncu-rep --page details > $O/details-$w.txt 2>&1
  grep -E "gemm_q4|Duration|Pipe|Tensor|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Warp Cycles Per Issued|Issue Slots Busy|Eligible Warps|Achieved Occupancy|Registers Per|Grid Size|Executed Ipc Active|hmma|gmma" $O/details-$w.txt | head -40 | tee -a $S
  ncu --import $O/p-$w.ncu-rep --page raw -c 1 --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio > $O/stalls-$w.txt 2>&1
  grep -E "stalled" $O/stalls-$w.txt | sort -k3 -g -r | head -10 | tee -a $S
  rm -f $O/*.ncu-rep
done
(cd $OUT && tar czf r2.tgz r2 && rm -rf r2)
