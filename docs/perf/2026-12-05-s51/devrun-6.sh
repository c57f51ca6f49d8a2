# Session 51, call 6 (H200 only): main's contract as the issues define it and its serving lines.
# c20.tar.xz: main51/{bench,lily} = main 582a5e2e (history 178 included; /work/lease-next/c20.tar.xz).
#  1. the full-shape checkpoint; 2. `lily bench` (all ten lengths, median of 2 rounds); 3. `lily bench --batch`
#  sweep; 4. serving 64 clients (the default prefill budget of 2,048 tokens a step, then 4,096 and 8,192) and 8.
#   run(command="bash docs/perf/2026-12-05-s51/devrun-6.sh", carry=["c20.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; [ -x /tmp/b20/main51/lily ] || { rm -rf /tmp/b20; mkdir -p /tmp/b20 && tar xJf $R/c20.tar.xz -C /tmp/b20; }
O=$OUT/r6; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee -a $S
case "$GPU" in *H200*) ;; *) echo "not an H200: nothing to do" | tee -a $S; exit 0;; esac
[ -f $M/config.json ] || { RAYON_NUM_THREADS=14 /tmp/b20/main51/lily synth --preset full --out $M > $O/synth.log 2>&1; tail -1 $O/synth.log | tee -a $S; }
timeout 200 /tmp/b20/main51/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r6.tgz r6)
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
[ $SECONDS -lt 500 ] && { LILY_BIN=/tmp/b20/main51/lily BENCH_JSON=$O/serve64.json timeout 45 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64.txt 2>&1 || echo "serve64 failed" | tee -a $S; J $O/serve64.json; }
for c in 4096 8192; do
  [ $SECONDS -lt 480 ] && { LILY_SERVE_ARGS="--prefill-chunk $c" LILY_BIN=/tmp/b20/main51/lily BENCH_JSON=$O/serve64-chunk$c.json timeout 45 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64-chunk$c.txt 2>&1 || echo "serve64 chunk $c failed" | tee -a $S; J $O/serve64-chunk$c.json; }
done
(cd $OUT && tar czf r6.tgz r6)
[ $SECONDS -lt 520 ] && { timeout $((575 - SECONDS)) /tmp/b20/main51/lily bench --model $M --batch 1,2,4,8,16,32,64,128 --out $O/batch-main.json > $O/batch-main.txt 2>&1; echo "lily bench --batch rc $?" | tee -a $S; tail -12 $O/batch-main.txt | tee -a $S; }
(cd $OUT && tar czf r6.tgz r6)
[ $SECONDS -lt 550 ] && { LILY_BIN=/tmp/b20/main51/lily BENCH_JSON=$O/serve8.json timeout $((590 - SECONDS)) bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8.txt 2>&1 || echo "serve8 failed" | tee -a $S; J $O/serve8.json; }
(cd $OUT && tar czf r6.tgz r6)
