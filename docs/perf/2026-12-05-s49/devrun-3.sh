# Session 49's third call (c6.tar.xz: main/bench = b149fab5 (main 8391c4e9's bench code); m2d/{bench,gpu_qmm} =
# moe-m2 c031469d: the experts' down projections on 32-row tasks from 2 tokens, gate/up as main; bit-identical):
#  1. bench --random-layers 40 --lengths 256 --batch 1,2,4,8,16,32,64: main, m2d, three interleaved rounds
#     (digests equal = the same greedy tokens);
#  2. m2d's gpu_qmm with LILY_REQUIRE_GPU=1.
#   run(command="bash docs/perf/2026-12-05-s49/devrun-3.sh", carry=["c6.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b7; mkdir -p /tmp/b7 && tar xJf $R/c6.tar.xz -C /tmp/b7; B=/tmp/b7; O=/tmp/r7; rm -rf $O; mkdir -p $O
S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $S
for r in 1 2 3; do for v in main m2d; do
  timeout 90 $B/$v/bench --random-layers 40 --lengths 256 --batch 1,2,4,8,16,32,64 > $O/bench-$v-$r.json 2>> $O/err.txt || echo "bench $v $r failed" | tee -a $S
  grep -h '^{' $O/bench-$v-$r.json | grep batch | cut -c1-120 | sed "s/^/$v $r /" | tee -a $S
done; done
LILY_REQUIRE_GPU=1 timeout 240 $B/m2d/gpu_qmm --test-threads=2 --nocapture > $O/gpu_qmm.log 2>&1; echo "m2d gpu_qmm rc $?: $(grep -a 'test result' $O/gpu_qmm.log)" | tee -a $S
grep -a 'FAILED\|panicked' $O/gpu_qmm.log | head | tee -a $S
cd /tmp && tar czf $OUT/r7.tgz r7
