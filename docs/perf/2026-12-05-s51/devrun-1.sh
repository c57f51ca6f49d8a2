# Session 51, call 1. c15.tar.xz: main/{bench,lily} = main ff98d920 (the code of main ada5f760 but for
# 5b6ab300's refactor). c16.tar.xz: whole/{bench,lily,gpu_qmm,gpu_model,qmm_probe} = branch s51-whole 34a69ff9
# (the whole-K expert entries on the GEMM path's steps).
#  1. gpu_qmm and gpu_model of s51-whole (LILY_REQUIRE_GPU=1);
#  2. qmm_probe at 16 / 64 tokens (gate/up sliced against whole K, alone);
#  3. bench steps at 1, 9, 16, 32, 64, 128 and the 256 prefill: main, whole, main, whole;
#  4. Nsight Compute of main's qmm_moe_1 and the branch's qmm_moe_1_whole at 64 tokens (source counters).
#   run(command="bash docs/perf/2026-12-05-s51/devrun-1.sh", carry=["c15.tar.xz", "c16.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b15 /tmp/b16; mkdir -p /tmp/b15 /tmp/b16 && tar xJf $R/c15.tar.xz -C /tmp/b15 && tar xJf $R/c16.tar.xz -C /tmp/b16
O=$OUT/r1; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee -a $S
LILY_REQUIRE_GPU=1 timeout 150 /tmp/b16/whole/gpu_qmm --test-threads=2 --nocapture > $O/gpu_qmm.log 2>&1; echo "gpu_qmm rc $?: $(grep -a 'test result' $O/gpu_qmm.log)" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_qmm.log | head -8 | tee -a $S
timeout 60 /tmp/b16/whole/qmm_probe 16,64 0 > $O/probe.txt 2>&1; echo "probe rc $?" | tee -a $S; grep -a 'moe:' $O/probe.txt | tee -a $S
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256 --batch 1,9,16,32,64,128 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], 'prefill %.0f decode %.1f' % (p[0]['prefill_tok_s'], p[0]['decode_tok_s']) if p else '', ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/b15/main/bench; run_bench whole-1 /tmp/b16/whole/bench
run_bench main-2 /tmp/b15/main/bench; run_bench whole-2 /tmp/b16/whole/bench
(cd $OUT && tar czf r1.tgz r1)
LILY_REQUIRE_GPU=1 timeout 200 /tmp/b16/whole/gpu_model --test-threads=2 --nocapture > $O/gpu_model.log 2>&1; echo "gpu_model rc $?: $(grep -a 'test result' $O/gpu_model.log)" | tee -a $S
grep -a 'FAIL\|panicked\|inexact\|GEMM path) vs' $O/gpu_model.log | head -12 | tee -a $S
(cd $OUT && tar czf r1.tgz r1)
echo "before ncu: ${SECONDS}s" | tee -a $S
N=$OUT/ncu; mkdir -p $N
for v in main whole; do
  [ $SECONDS -gt 470 ] && break
  if [ $v = main ]; then B=/tmp/b15/main/bench; k='qmm_moe_1$'; else B=/tmp/b16/whole/bench; k='qmm_moe_1_whole$'; fi
  timeout $((560 - SECONDS)) ncu --clock-control none -k regex:"$k" --launch-skip 16 -c 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters --section InstructionStats \
    -o $N/$v $B --random-layers 4 --lengths "" --batch 64 > $N/$v.log 2>&1; echo "ncu $v rc $?" | tee -a $S
  ncu --import $N/$v.ncu-rep --page details > $N/$v-details.txt 2>&1
  ncu --import $N/$v.ncu-rep --page source --print-source sass --csv > $N/$v-sass.csv 2>&1
  grep -a "Duration\|DRAM Throughput\|Executed Instructions \|Issued Warp\|Warp Cycles Per Issued\|Achieved Occupancy" $N/$v-details.txt | head -16 >> $S
done
(cd $OUT && tar czf ncu.tgz ncu && rm -rf ncu)
