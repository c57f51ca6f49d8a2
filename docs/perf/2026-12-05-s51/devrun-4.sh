# Session 51, call 4 (the warm H200): main's 64 clients a second time, and Nsight Compute of moe_router at 64 tokens
# (warp states, source-level stalls).
#   run(command="bash docs/perf/2026-12-05-s51/devrun-4.sh", carry=["c15.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; [ -x /tmp/b15/main/bench ] || { rm -rf /tmp/b15; mkdir -p /tmp/b15 && tar xJf $R/c15.tar.xz -C /tmp/b15; }
O=$OUT/r4; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
[ -f $M/config.json ] && { LILY_BIN=/tmp/b15/main/lily BENCH_JSON=$O/serve64.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64.txt 2>&1 || echo "serve64 failed" | tee -a $S; J $O/serve64.json; }
(cd $OUT && tar czf r4.tgz r4)
N=$O/ncu; mkdir -p $N
timeout 200 ncu --clock-control none -k regex:'moe_router' --launch-skip 16 -c 2 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
  -o $N/router /tmp/b15/main/bench --random-layers 4 --lengths "" --batch 64 > $N/router.log 2>&1; echo "ncu router rc $?" | tee -a $S
ncu --import $N/router.ncu-rep --page details > $N/router-details.txt 2>&1
ncu --import $N/router.ncu-rep --page source --print-source sass --csv > $N/router-sass.csv 2>&1
grep -a "Duration\|DRAM Throughput\|Executed Instructions \|Warp Cycles Per Issued\|Achieved Occupancy" $N/router-details.txt | head -12 >> $S
(cd $OUT && tar czf r4.tgz r4)
