# For the next lease, on an H200 only (~8 min; it stops at once on another card). Carries c61b.tar.xz (g61b/main:
# lily, bench, qmm_probe, gpu_qmm of main 344e388f, after history 210):
#   run(command="bash docs/perf/2026-12-06-s61/devrun-5.sh", carry=["c61b.tar.xz"], kind="nvidia-h200")
# 1. gpu_qmm's router tests (moe_router_mma's and the MoE one); the rest only if they pass.
# 2. bench --random-layers 40 --batch 1,8,16,32,64,128, --router-mma off against main's default (40), two rounds.
# 3. 1 / 8 / 64 clients served on main, then 64 clients with LILY_ROUTER_MMA=off.
# 4. main's ten-length contract (`lily bench`) with the time left.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r5; mkdir -p $O /tmp/x; M=/tmp/lily-full
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
case "$GPU" in *H200*) ;; *) echo "not an H200, nothing run" | tee -a $S; exit 0;; esac
tar xJf $R/c61b.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/x/g61b/main; echo "main $(cut -c1-8 $B/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
(RAYON_NUM_THREADS=12 $B/lily synth --preset full --out $M > $O/synth.log 2>&1; echo "synth rc $? at ${SECONDS}s" >> $O/synth.log) &
LILY_REQUIRE_GPU=1 timeout 150 $B/gpu_qmm --test-threads=2 moe_router > $O/gpu_qmm.log 2>&1; rc=$?
echo "gpu_qmm (router tests) rc $rc at ${SECONDS}s: $(grep 'test result' $O/gpu_qmm.log)" | tee -a $S
grep -E "FAIL|panicked|moe_router_mma:" $O/gpu_qmm.log | head -20 | tee -a $S
[ $rc = 0 ] || { (cd $OUT && tar czf r5.tgz r5 && rm -rf r5); exit 0; }
for r in 1 2; do
  for m in off 40; do
    timeout 90 $B/bench --random-layers 40 --lengths "" --batch 1,8,16,32,64,128 --router-mma $m > $O/m$m-r$r.jsonl 2> $O/m$m-r$r.err
    echo "router-mma=$m r$r rc $?: $(python3 -c "
import json,sys
print(' '.join('%d: %.3f %s' % (j['batch'], j['step_ms'], j['seq0_digest'][:8]) for j in map(json.loads, open(sys.argv[1])) if 'batch' in j))" $O/m$m-r$r.jsonl)" | tee -a $S
  done
done
(cd $OUT && tar czf r5.tgz r5)
wait; tail -2 $O/synth.log | tee -a $S
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft p50 %.1f p99 %.1f itl p50 %.3f p99 %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['ttft_s']['p99'], 1000*p['itl_s']['p50'], 1000*p['itl_s']['p99'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=$B/lily BENCH_JSON=$O/serve-1-8-64.json timeout 100 bash scripts/bench-serve.sh $M 1,8,64 2 128 > $O/serve-1-8-64.txt 2>&1 || echo "serve failed" | tee -a $S
J $O/serve-1-8-64.json; grep -a "prefill_seconds_total\|decode_wait_seconds_total\|decode_steps_total" $O/serve-1-8-64.txt | tr '\n' ' ' | tee -a $S; echo | tee -a $S
LILY_ROUTER_MMA=off LILY_BIN=$B/lily BENCH_JSON=$O/serve-64-off.json timeout 80 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve-64-off.txt 2>&1 || echo "serve off failed" | tee -a $S
J $O/serve-64-off.json; grep -a "prefill_seconds_total\|decode_wait_seconds_total\|decode_steps_total" $O/serve-64-off.txt | tr '\n' ' ' | tee -a $S; echo | tee -a $S
(cd $OUT && tar czf r5.tgz r5)
LEFT=$((580 - SECONDS)); echo "contract with ${LEFT}s left" | tee -a $S
timeout $LEFT $B/lily bench --model $M --out $O/contract.json --markdown $O/contract.md > $O/contract.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r5.tgz r5 && rm -rf r5)
