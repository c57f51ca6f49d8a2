# Session 62, call 3 (an H200 only, ~8 min; it stops at once on another card): carry c61c.tar.xz (main 344e388f:
# lily, bench, gpu_qmm; c61b without qmm_probe). Session 61's waiting measurement of main after history 210:
# gpu_qmm's router tests, bench --router-mma off against main's default at 1-128 tokens (two rounds), 1 / 8 / 64
# clients served, and main's ten-length contract with the time left. (Its first version also reran call 2's Nsight
# Compute, which has run: dropped.)
#   run(command="bash docs/perf/2026-12-06-s62/devrun-3.sh", carry=["c61c.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD
S=$OUT/summary3.txt; O=$OUT/r3; mkdir -p $O /tmp/y; M=/tmp/lily-full
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU at ${SECONDS}s" | tee $S
case "$GPU" in *H200*) ;; *) echo "not an H200: main's H200 measurement not run" | tee -a $S; exit 0;; esac
tar xJf $R/c61c.tar.xz -C /tmp/y || { echo "c61c missing" | tee -a $S; exit 1; }
B=/tmp/y/g61b/main; echo "main $(cut -c1-8 $B/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
(RAYON_NUM_THREADS=12 $B/lily synth --preset full --out $M > $O/synth.log 2>&1; echo "synth rc $? at ${SECONDS}s" >> $O/synth.log) &
LILY_REQUIRE_GPU=1 timeout 120 $B/gpu_qmm --test-threads=2 moe_router > $O/gpu_qmm.log 2>&1
echo "gpu_qmm (router tests) rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_qmm.log)" | tee -a $S
for r in 1 2; do
  for m in off 40; do
    timeout 90 $B/bench --random-layers 40 --lengths "" --batch 1,8,16,32,64,128 --router-mma $m > $O/m$m-r$r.jsonl 2> $O/m$m-r$r.err
    echo "router-mma=$m r$r rc $?: $(python3 -c "
import json,sys
print(' '.join('%d: %.3f %s' % (j['batch'], j['step_ms'], j['seq0_digest'][:8]) for j in map(json.loads, open(sys.argv[1])) if 'batch' in j))" $O/m$m-r$r.jsonl)" | tee -a $S
  done
done
(cd $OUT && tar czf r3.tgz r3)
wait; tail -2 $O/synth.log | tee -a $S
LILY_BIN=$B/lily BENCH_JSON=$O/serve-1-8-64.json timeout 100 bash scripts/bench-serve.sh $M 1,8,64 2 128 > $O/serve-1-8-64.txt 2>&1 || echo "serve failed" | tee -a $S
python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(' | '.join('%d: %.1f tok/s ttft p50 %.1f p99 %.1f itl p50 %.3f p99 %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['ttft_s']['p99'], 1000*p['itl_s']['p50'], 1000*p['itl_s']['p99'], p['errors']) for p in j['phases']))" $O/serve-1-8-64.json | tee -a $S
grep -a "prefill_seconds_total\|decode_wait_seconds_total\|decode_steps_total" $O/serve-1-8-64.txt | tr '\n' ' ' | tee -a $S; echo | tee -a $S
(cd $OUT && tar czf r3.tgz r3)
LEFT=$((585 - SECONDS)); echo "contract with ${LEFT}s left" | tee -a $S
timeout $LEFT $B/lily bench --model $M --out $O/contract.json --markdown $O/contract.md > $O/contract.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r3.tgz r3 && rm -rf r3)
