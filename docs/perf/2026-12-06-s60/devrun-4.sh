# For the next lease, on an H200 only (~9.5 min; it stops at once on another card). Carries c58d.tar.xz (session 58's
# qmm_probe) and c60h.tar.xz (g60h/main: lily and bench of main after history 206; session 59's devrun-9.sh otherwise):
#   run(command="bash docs/perf/2026-12-06-s60/devrun-4.sh", carry=["c58d.tar.xz", "c60h.tar.xz"], kind="nvidia-h200")
# 1. The experts' parts probe (session 58's devrun-6: both precisions, variants 0, 2, 11, 12, 13, 15, 16) at 8 / 64 /
#    128 tokens: how much of the fp16 experts' time on the H200 is arithmetic, x loads, or neither.
# 2. main's 64-token step timeline; 1, 8 and 64 clients served (scripts/bench-serve.sh, 2 requests of 128 tokens).
# 3. main's ten-length `lily bench` (the contract JSON of issues 11 and 12) with the time left.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r4; mkdir -p $O /tmp/g; M=/tmp/lily-full
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
case "$GPU" in *H200*) ;; *) echo "not an H200, nothing run" | tee -a $S; exit 0;; esac
tar xJf $R/c58d.tar.xz -C /tmp/g && tar xJf $R/c60h.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
Q=/tmp/g/g58d/main; B=/tmp/g/g60h/main; echo "qmm_probe $(cut -c1-8 $Q/REVISION), main $(cut -c1-8 $B/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
(RAYON_NUM_THREADS=12 $B/lily synth --preset full --out $M > $O/synth.log 2>&1; echo "synth rc $? at ${SECONDS}s" >> $O/synth.log) &
timeout 200 $Q/qmm_probe 8,64,128 0,2,11,12,13,15,16 > $O/qmm-probe.txt 2>&1; echo "qmm_probe rc $? at ${SECONDS}s" | tee -a $S
grep -E "copy|moe" $O/qmm-probe.txt | tee -a $S
timeout 60 $B/bench --random-layers 40 --lengths "" --batch 64 --timeline > $O/timeline.jsonl 2> $O/timeline.err; echo "timeline rc $? at ${SECONDS}s" | tee -a $S
grep -A14 "timeline of batch 64" $O/timeline.err | tee -a $S
(cd $OUT && tar czf r4.tgz r4)
wait; tail -2 $O/synth.log | tee -a $S
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft p50 %.1f p99 %.1f itl p50 %.3f p99 %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['ttft_s']['p99'], 1000*p['itl_s']['p50'], 1000*p['itl_s']['p99'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=$B/lily BENCH_JSON=$O/serve-1-8-64.json timeout 100 bash scripts/bench-serve.sh $M 1,8,64 2 128 > $O/serve-1-8-64.txt 2>&1 || echo "serve failed" | tee -a $S
J $O/serve-1-8-64.json; grep -a "prefill_seconds_total\|decode_wait_seconds_total\|decode_steps_total" $O/serve-1-8-64.txt | tr '\n' ' ' | tee -a $S; echo | tee -a $S
(cd $OUT && tar czf r4.tgz r4)
LEFT=$((585 - SECONDS)); echo "contract with ${LEFT}s left" | tee -a $S
timeout $LEFT $B/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r4.tgz r4)
(cd $OUT && tar czf r4.tgz r4 && rm -rf r4)
