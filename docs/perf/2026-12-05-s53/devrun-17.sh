# Session 53's branch s53-cluster-reduce (2b698cbc, crates/cuda/NOTES.md history 189) against main, any card (<10 min):
# split-K launches of 2-16 splits run as thread block clusters of their splits and reduce through distributed shared
# memory instead of fp32 partials in global memory and a gemm_splitk_reduce launch (80 of them a 64-token decode step,
# 160 in a 256-token prefill); the same bits by construction, so every digest must agree with main's. Carries:
#   c20.tar.xz:  main51/{bench,lily}   main 582a5e2e's build (main's kernels)
#   c53b.tar.xz: g53/cr/{bench,lily,gpu_kernels,gpu_model,gpu_gdn}   branch s53-cluster-reduce
#   run(command="bash docs/perf/2026-12-05-s53/devrun-17.sh", carry=["c20.tar.xz", "c53b.tar.xz"])
# 1. steps at 1 (qmm: a control) / 16 / 32 / 64 / 128 tokens and the 256- and 1,024-token prefills, main / branch,
#    two interleaved rounds; 2. the branch's gpu_kernels (clusters against partials bit for bit), gpu_gdn (its cluster
#    helpers moved to common.cuh) and gpu_model, LILY_REQUIRE_GPU=1; 3. with the time left, 64 clients served by main
#    and by the branch (scripts/bench-serve.sh, 2 requests each, 128 tokens), the full-shape checkpoint written first.
set -u
R=$PWD; mkdir -p /tmp/b20 /tmp/c53b
tar xJf $R/c20.tar.xz -C /tmp/b20 && tar xJf $R/c53b.tar.xz -C /tmp/c53b || { echo "tarballs missing" | tee $OUT/summary.txt; exit 1; }
M=/tmp/b20/main51; C=/tmp/c53b/g53/cr; CK=/tmp/lily-full
O=$OUT/r17; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU $(cat $C/REVISION)" | tee -a $S
# The checkpoint for step 3, written on the CPU meanwhile (a few threads, lowest priority).
RAYON_NUM_THREADS=4 nice -n 19 $M/lily synth --preset full --out $CK > $O/synth.log 2>&1 &
SP=$!
run_bench() { timeout 120 $2 --random-layers 40 --lengths 256,1024 --batch 1,16,32,64,128 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
for r in 1 2; do run_bench main-$r $M/bench; run_bench cr-$r $C/bench; done
(cd $OUT && tar czf r17.tgz r17)
for t in gpu_kernels gpu_gdn gpu_model; do
  LILY_REQUIRE_GPU=1 timeout 150 $C/$t --test-threads=2 > $O/$t.log 2>&1; echo "cr $t rc $?: $(grep -a 'test result' $O/$t.log)" | tee -a $S
done
grep -a 'FAIL\|panicked' $O/gpu_*.log | head -8 | tee -a $S
(cd $OUT && tar czf r17.tgz r17)
while kill -0 $SP 2>/dev/null && [ $SECONDS -lt 470 ]; do sleep 5; done
kill -0 $SP 2>/dev/null && { echo "synth not done at ${SECONDS}s: no serving" | tee -a $S; exit 0; }
tail -1 $O/synth.log | tee -a $S
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
for b in main cr; do
  L=$M/lily; [ $b = cr ] && L=$C/lily
  [ $SECONDS -lt 530 ] && [ -f $CK/config.json ] && { LILY_BIN=$L BENCH_JSON=$O/serve64-$b.json timeout 50 bash scripts/bench-serve.sh $CK 64 2 128 > $O/serve64-$b.txt 2>&1 || echo "serve64 $b failed" | tee -a $S; J $O/serve64-$b.json; }
done
(cd $OUT && tar czf r17.tgz r17)
