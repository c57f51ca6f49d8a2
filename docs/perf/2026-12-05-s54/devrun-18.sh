# Session 54, call 1 (any card, <10 min): history 189 (branch s53-cluster-reduce 2b698cbc: split-K launches of 2-16
# splits reduced inside clusters of their splits through distributed shared memory) and history 188 (branch
# s53-fused-reduce cca530d6: 2-4 splits on tiles of <=64 rows reduced by each tile's last split block) against main.
# Both give the same bits by construction, so every digest must equal main's. Carries c54a.tar.xz (git-ignored, built
# on the development machine with crates/cuda/scripts/ab-revisions.sh collect, stripped; each dir has a REVISION):
#   g54/main/{bench,lily}   main (its kernels: 1d1802c9's)
#   g54/cr/{bench,lily,gpu_kernels,gpu_gdn,gpu_model}   s53-cluster-reduce
#   g54/fr/bench            s53-fused-reduce (optional: left out when its build was not ready)
#   run(command="bash docs/perf/2026-12-05-s54/devrun-18.sh", carry=["c54a.tar.xz"])
# 1. steps at 1 (a control: qmm path) / 16 / 32 / 64 / 128 tokens and the 256- and 1,024-token prefills, main / cr / fr,
#    two interleaved rounds; 2. cr's gpu_kernels (clusters against partials bit for bit), gpu_gdn (its cluster helpers
#    moved to common.cuh) and gpu_model, LILY_REQUIRE_GPU=1; 3. with the time left, 64 clients served by main and by cr
#    (scripts/bench-serve.sh, 2 requests each, 128 tokens), the full-shape checkpoint written on the CPU meanwhile.
set -u
R=$PWD; mkdir -p /tmp/c54a
tar xJf $R/c54a.tar.xz -C /tmp/c54a || { echo "tarball missing" | tee $OUT/summary.txt; exit 1; }
G=/tmp/c54a/g54; CK=/tmp/lily-full
O=$OUT/r18; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU main $(cut -c1-8 $G/main/REVISION) cr $(cut -c1-8 $G/cr/REVISION) fr $(cut -c1-8 $G/fr/REVISION 2>/dev/null || echo absent)" | tee -a $S
RAYON_NUM_THREADS=4 nice -n 19 $G/main/lily synth --preset full --out $CK > $O/synth.log 2>&1 &
SP=$!
run_bench() { timeout 120 $2 --random-layers 40 --lengths 256,1024 --batch 1,16,32,64,128 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
for r in 1 2; do run_bench main-$r $G/main/bench; run_bench cr-$r $G/cr/bench; [ -x $G/fr/bench ] && run_bench fr-$r $G/fr/bench; echo "round $r at ${SECONDS}s" | tee -a $S; done
(cd $OUT && tar czf r18.tgz r18)
for t in gpu_kernels gpu_gdn gpu_model; do
  LILY_REQUIRE_GPU=1 timeout 150 $G/cr/$t --test-threads=2 > $O/$t.log 2>&1; echo "cr $t rc $?: $(grep -a 'test result' $O/$t.log) at ${SECONDS}s" | tee -a $S
done
grep -a 'FAIL\|panicked' $O/gpu_*.log | head -8 | tee -a $S
(cd $OUT && tar czf r18.tgz r18)
while kill -0 $SP 2>/dev/null && [ $SECONDS -lt 470 ]; do sleep 5; done
kill -0 $SP 2>/dev/null && { echo "synth not done at ${SECONDS}s: no serving" | tee -a $S; exit 0; }
tail -1 $O/synth.log | tee -a $S
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
for b in main cr; do
  [ $SECONDS -lt 530 ] && [ -f $CK/config.json ] && { LILY_BIN=$G/$b/lily BENCH_JSON=$O/serve64-$b.json timeout 50 bash scripts/bench-serve.sh $CK 64 2 128 > $O/serve64-$b.txt 2>&1 || echo "serve64 $b failed" | tee -a $S; J $O/serve64-$b.json; }
done
(cd $OUT && tar czf r18.tgz r18)
