# For a lease after devrun-next.sh (session 50 left it unrun): Nsight Compute of the 64-token step's router and
# expert kernels, with warp-state and source-level stall sampling (what the router's 20 us a layer and the
# experts' ~2 TB/s wait on). c15.tar.xz: main/bench from main ff98d920. 4 random layers: the kernels' shapes
# are the full model's; --launch-skip passes the warm-up.
#   run(command="bash docs/perf/2026-12-05-s50/devrun-ncu.sh", carry=["c15.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b15; mkdir -p /tmp/b15 && tar xJf $R/c15.tar.xz -C /tmp/b15; B=/tmp/b15/main
O=$OUT/ncu; mkdir -p $O; S=$OUT/summary.txt
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $S
for k in 'moe_router' 'qmm_moe_1$'; do
  n=$(echo "$k" | tr -dc 'a-z_1')
  timeout 200 ncu --clock-control none -k regex:"$k" --launch-skip 16 -c 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SourceCounters \
    -o $O/$n $B/bench --random-layers 4 --lengths "" --batch 64 > $O/$n.log 2>&1; echo "ncu $n rc $?" | tee -a $S
  ncu --import $O/$n.ncu-rep --page details > $O/$n-details.txt 2>&1
  ncu --import $O/$n.ncu-rep --page source --print-source sass --csv > $O/$n-sass.csv 2>&1
  grep -a "Duration\|Throughput\|Warp Cycles Per Issued\|Achieved Occupancy\|Stall" $O/$n-details.txt | head -30 >> $S
done
(cd $OUT && tar czf ncu.tgz ncu && rm -rf ncu)
