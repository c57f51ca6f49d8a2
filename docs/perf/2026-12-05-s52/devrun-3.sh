# Session 52, call 3: how the served prefill budget moves 64 clients (main 582a5e2e's binaries, c20.tar.xz).
#  1. bench --parts: a prefill pass of K prompts of 256 tokens (K = 8, 16, 32: budgets 2,048 / 4,096 / 8,192);
#  2. serving 64 clients at --prefill-chunk 2048 (the CUDA default), 4096, 8192, 16384; 3. on an H200 only: `lily bench`.
#   run(command="bash docs/perf/2026-12-05-s52/devrun-3.sh", carry=["c20.tar.xz"])
set -u
R=$PWD; [ -x /tmp/b20/main51/lily ] || { rm -rf /tmp/b20; mkdir -p /tmp/b20 && tar xJf $R/c20.tar.xz -C /tmp/b20; }
O=$OUT/r3; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee -a $S
for k in 8 16 32; do
  timeout 60 /tmp/b20/main51/bench --random-layers 40 --lengths $((256 * k)) --parts $k --batch 1 > $O/parts-$k.json 2>> $O/parts-err.txt || echo "parts $k failed" | tee -a $S
  grep -a '"parts"' $O/parts-$k.json | tee -a $S
done
echo "after parts: ${SECONDS}s" | tee -a $S
[ -f $M/config.json ] || { RAYON_NUM_THREADS=14 /tmp/b20/main51/lily synth --preset full --out $M > $O/synth.log 2>&1; tail -1 $O/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft p50 %.1f p99 %.1f itl p50 %.3f p99 %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['ttft_s']['p99'], 1000*p['itl_s']['p50'], 1000*p['itl_s']['p99'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
for c in 2048 4096 8192 16384; do
  [ $SECONDS -lt 420 ] && { LILY_SERVE_ARGS="--prefill-chunk $c" LILY_BIN=/tmp/b20/main51/lily BENCH_JSON=$O/serve64-chunk$c.json timeout 50 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64-chunk$c.txt 2>&1 || echo "serve64 chunk $c failed" | tee -a $S; J $O/serve64-chunk$c.json; grep -a "prefill_seconds_total\|decode_wait_seconds_total\|decode_steps_total\|mixed_steps_total" $O/serve64-chunk$c.txt | tr '\n' ' ' | tee -a $S; echo | tee -a $S; }
done
(cd $OUT && tar czf r3.tgz r3)
case "$GPU" in *H200*) [ $SECONDS -lt 330 ] && { timeout 250 /tmp/b20/main51/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S; cat $O/contract-main.md | tee -a $S; };; esac
(cd $OUT && tar czf r3.tgz r3)
