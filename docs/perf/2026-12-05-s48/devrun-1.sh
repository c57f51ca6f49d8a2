# Session 48's first call (H200 wanted): the fp16 dense inputs as the default (f16-default: main 382e22b2 +
# DECODE_F16_FROM = 5 in DecodeMatrices::FASTEST, gpu_model's exact checks moved to f16_from off) against
# main (fp16 off): the branch's GPU suites with LILY_REQUIRE_GPU=1, the contract's decode and prefill at 256
# (two rounds), 1 client (4 requests, two runs), and 8 + 64 clients (2 requests each) with each binary in
# two interleaved rounds. c1.tar.xz: f16/{lily,bench,gpu_model,gpu_runahead,gpu_sampling}, main/lily.
#   run(command="bash docs/perf/2026-12-05-s48/devrun-1.sh", carry=["c1.tar.xz"])
set -u
R=$PWD; mkdir -p /tmp/b && tar xJf $R/c1.tar.xz -C /tmp/b; O=$OUT/r1; mkdir -p $O; M=/tmp/lily-full; B=/tmp/b
export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
SYN=; if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=10 nice -n 19 $B/f16/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
for s in gpu_model gpu_runahead gpu_sampling; do
  LILY_REQUIRE_GPU=1 timeout 150 $B/f16/$s --test-threads=2 --nocapture > $O/$s.log 2>&1
  echo "$s rc $?: $(grep -a 'test result' $O/$s.log)" | tee -a $O/summary.txt
done
grep -h -a 'default decode path\|fp16 activations: batch\|default batches\|GEMM decode path: batch\|FAILED\|panicked' $O/gpu_model.log | cut -c1-220 | head -20 | tee -a $O/summary.txt
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log; }
for r in 1 2; do
  timeout 60 $B/f16/bench --random-layers 40 --lengths 256 --batch 1,5,8 --served > $O/bench256-$r.json 2>> $O/err.txt || echo "bench $r failed" | tee -a $O/summary.txt
  grep -h '^{' $O/bench256-$r.json | cut -c1-160 | tee -a $O/summary.txt
done
S() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $O/summary.txt; }
for r in 1 2; do
  LILY_BIN=$B/f16/lily BENCH_JSON=$O/serve1-$r.json timeout 60 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1-$r.txt 2>&1 || echo "serve1 $r failed" | tee -a $O/summary.txt
  S $O/serve1-$r.json
done
for r in 1 2; do for v in main f16; do
  L=/dev/null; [ $r = 1 ] && L=$O/serve-$v-log.txt
  RUST_LOG=lily_engine=debug LILY_SERVE_LOG=$L LILY_BIN=$B/$v/lily BENCH_JSON=$O/serve-$v-$r.json timeout 80 bash scripts/bench-serve.sh $M 8,64 2 128 > $O/serve-$v-$r.txt 2>&1 || echo "serve $v $r failed" | tee -a $O/summary.txt
  S $O/serve-$v-$r.json
done; done
for v in main f16; do sed 's/\x1b\[[0-9;]*m//g' $O/serve-$v-log.txt 2>/dev/null | grep -a -o 'held the first prefill.*\|prefill pass parts=[0-9]* tokens=[0-9]* ms=[0-9.]*' | head -12 | cut -c1-200 | sed "s/^/$v /" >> $O/summary.txt; done
cd $OUT && tar czf r1.tgz r1 && rm -rf r1
