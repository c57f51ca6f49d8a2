# Session 49's second call (c5.tar.xz: main/bench = b149fab5, main/lily = 55e0124e, both main 8391c4e9's code
# for what they run; m2/{bench,lily,qmm_probe,gpu_qmm,gpu_model} = moe-m2 68ee1d3b: the experts' 32-row tasks
# from 16 tokens, bit-identical by construction):
#  1. m2's gpu_qmm and gpu_model with LILY_REQUIRE_GPU=1, side by side (the full-shape checkpoint is written meanwhile);
#  2. bench --random-layers 40 --lengths 256 --batch 1,8,16,32,64: main, m2, two interleaved rounds (digests equal
#     = the same greedy tokens);
#  3. qmm_probe 8,16,32,64 with variants 0 (default: 32-row tasks from 16), 11 (16-row only), 12 (32-row from 2), 13 (32-row from 2, rings of 2);
#  4. 64 clients (bench-serve.sh 64 2 128), main against m2, two interleaved rounds; 8 clients once each.
#   run(command="bash docs/perf/2026-12-05-s49/devrun-2.sh", carry=["c5.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b6; mkdir -p /tmp/b6 && tar xJf $R/c5.tar.xz -C /tmp/b6; B=/tmp/b6; O=/tmp/r6; rm -rf $O; mkdir -p $O; M=/tmp/lily-full
S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $S
SYN=; if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=10 nice -n 19 $B/m2/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
P=; for t in gpu_qmm gpu_model; do (LILY_REQUIRE_GPU=1 timeout 240 $B/m2/$t --test-threads=2 --nocapture > $O/$t.log 2>&1; echo "m2 $t rc $?: $(grep -a 'test result' $O/$t.log)" >> $S) & P="$P $!"; done
wait $P; grep -a 'FAILED\|panicked' $O/gpu_qmm.log $O/gpu_model.log | head | tee -a $S
for r in 1 2; do for v in main m2; do
  timeout 90 $B/$v/bench --random-layers 40 --lengths 256 --batch 1,8,16,32,64 > $O/bench-$v-$r.json 2>> $O/err.txt || echo "bench $v $r failed" | tee -a $S
  grep -h '^{' $O/bench-$v-$r.json | cut -c1-140 | sed "s/^/$v $r /" | tee -a $S
done; done
timeout 150 $B/m2/qmm_probe 8,16,32,64 0,11,12,13 > $O/probe.txt 2>&1 || echo "probe rc $?" | tee -a $S
grep -a 'moe:' $O/probe.txt | tee -a $S
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
for r in 1 2; do for v in main m2; do
  LILY_BIN=$B/$v/lily BENCH_JSON=$O/serve64-$v-$r.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64-$v-$r.txt 2>&1 || echo "serve64 $v $r failed" | tee -a $S; J $O/serve64-$v-$r.json
done; done
for v in main m2; do
  LILY_BIN=$B/$v/lily BENCH_JSON=$O/serve8-$v.json timeout 45 bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8-$v.txt 2>&1 || echo "serve8 $v failed" | tee -a $S; J $O/serve8-$v.json
done
cd /tmp && tar czf $OUT/r6.tgz r6
