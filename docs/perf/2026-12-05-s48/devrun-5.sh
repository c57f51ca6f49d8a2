# The next lease's call, prepared by session 48 (c4.tar.xz in /work/lease-next: xp/bench = x-prefetch
# 92767d4b; xp2/{bench,gpu_qmm,gpu_model} = x-prefetch-task 86803347; main/{bench,lily} = b149fab5 (the fp16
# default, before the newcomer gather); main2/lily = 55e0124e (the newcomer gather)). Best on an H200:
#  1. bench --random-layers 40 --lengths 256 --batch 1,8,64: main, xp, xp2, two interleaved rounds (digests
#     equal = the same greedy tokens; the decode at 256 is the contract's, for the one-client ratio);
#  2. xp2's gpu_qmm and gpu_model with LILY_REQUIRE_GPU=1, side by side;
#  3. serving (bench-serve.sh, full-shape synthetic checkpoint written during 1-2): 1 client (4 requests) with
#     main2; 8 clients (2 requests each), main against main2, two interleaved rounds, with each run's first
#     passes from the engine's debug log; 64 clients with main2.
# Everything goes to $OUT/summary.txt as it grows; the logs and JSON to $OUT/r5.tgz at the end.
#   run(command="bash docs/perf/2026-12-05-s48/devrun-5.sh", carry=["c4.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b5; mkdir -p /tmp/b5 && tar xJf $R/c4.tar.xz -C /tmp/b5; B=/tmp/b5; O=/tmp/r5; rm -rf $O; mkdir -p $O; M=/tmp/lily-full
S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $S
SYN=; if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=10 nice -n 19 $B/main2/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
for r in 1 2; do for v in main xp xp2; do
  timeout 60 $B/$v/bench --random-layers 40 --lengths 256 --batch 1,8,64 > $O/bench-$v-$r.json 2>> $O/err.txt || echo "bench $v $r failed" | tee -a $S
  grep -h '^{' $O/bench-$v-$r.json | cut -c1-140 | sed "s/^/$v $r /" | tee -a $S
done; done
P=; for t in gpu_qmm gpu_model; do (LILY_REQUIRE_GPU=1 timeout 200 $B/xp2/$t --test-threads=2 --nocapture > $O/$t.log 2>&1; echo "xp2 $t rc $?: $(grep -a 'test result' $O/$t.log)" >> $S) & P="$P $!"; done
wait $P; grep -a 'FAILED\|panicked' $O/gpu_qmm.log $O/gpu_model.log | head | tee -a $S
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=$B/main2/lily BENCH_JSON=$O/serve1.json timeout 50 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1.txt 2>&1 || echo "serve1 failed" | tee -a $S; J $O/serve1.json
for r in 1 2; do for v in main main2; do
  RUST_LOG=lily_engine=debug LILY_SERVE_LOG=$O/serve8-$v-$r.log LILY_BIN=$B/$v/lily BENCH_JSON=$O/serve8-$v-$r.json timeout 45 bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8-$v-$r.txt 2>&1 || echo "serve8 $v $r failed" | tee -a $S
  J $O/serve8-$v-$r.json
  echo "  passes: $(sed 's/\x1b\[[0-9;]*m//g' $O/serve8-$v-$r.log | grep -a -o 'prefill pass parts=[0-9]*' | cut -d= -f2 | head -8 | tr '\n' ' ')" | tee -a $S
done; done
LILY_BIN=$B/main2/lily BENCH_JSON=$O/serve64.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64.txt 2>&1 || echo "serve64 failed" | tee -a $S; J $O/serve64.json
cd /tmp && tar czf $OUT/r5.tgz r5
