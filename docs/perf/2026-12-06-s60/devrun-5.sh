# Session 60, call 4 (any card; ~2 min), c60h.tar.xz (main 11a808b5's bench): Nsight Compute of the 256-token
# prefill's 16-row expert tiles (gemm_q4_bm16, DIRECT: 58% of the pass; history 207-208 made them slower with
# fewer barriers and with more warps): speed of light, warp states, the stall reasons per issue, and the source
# view's stall samples by SASS line, so the next change aims at what they wait on.
set -u
R=$PWD; S=$OUT/summary5.txt; O=$OUT/r5; mkdir -p $O /tmp/g
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
[ -d /tmp/g/g60h ] || tar xJf $R/c60h.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g60h/main/bench; echo "main $(cut -c1-8 /tmp/g/g60h/main/REVISION)" | tee -a $S
timeout 300 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section SourceCounters \
  -k regex:"^gemm_q4_bm16$" -c 4 -o $O/p256 \
  $B --random-layers 4 --lengths 256 > $O/ncu.log 2>&1; echo "ncu rc $? at ${SECONDS}s" | tee -a $S
grep "Profiling" $O/ncu.log | sed -E 's/.*Profiling "([^"]+)".*/\1/' | uniq -c | tee -a $S
ncu --import $O/p256.ncu-rep --page details > $O/details.txt 2>&1
grep -E "Duration|Throughput|Hit Rate|Warp Cycles Per Issued|Issue Slots|Eligible|Achieved Occupancy|Block Limit|Registers|Grid Size|Mem Busy|Max Bandwidth|Mem Pipes|Executed Ipc" $O/details.txt | head -60 | tee -a $S
ncu --import $O/p256.ncu-rep --page raw -c 2 --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio > $O/stalls.txt 2>&1
grep -E "stalled" $O/stalls.txt | sort -k3 -g -r | head -16 | tee -a $S
ncu --import $O/p256.ncu-rep --page source --csv -c 1 > $O/source.csv 2>&1; echo "source rc $? lines $(wc -l < $O/source.csv)" | tee -a $S
rm -f $O/*.ncu-rep
(cd $OUT && tar czf r5.tgz r5 && rm -rf r5)
