# Session 51, call 7 (the session's last device time, ~300 s of commands). c15.tar.xz: main/{bench,lily} = main
# ff98d920. c19.tar.xz: prod/{bench,lily,gpu_qmm,gpu_kernels,gpu_model,qmm_probe} = branch s51-prod 4245a9be (the
# qmm stage producer's full-stage copies at fixed offsets, predicated).
#  1. bench steps at 1, 8, 16, 64 and the 256 prefill: main, prod, main, prod (digests must agree);
#  2. gpu_qmm and gpu_kernels' GEMM tests of prod (LILY_REQUIRE_GPU=1);
#  3. H200 only, as time allows: 64 clients at prefill budgets 2,048 and 4,096 (main), `lily bench` (ten lengths).
#   run(command="bash docs/perf/2026-12-05-s51/devrun-7.sh", carry=["c15.tar.xz", "c19.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; for c in 15 19; do rm -rf /tmp/b$c; mkdir -p /tmp/b$c && tar xJf $R/c$c.tar.xz -C /tmp/b$c; done
O=$OUT/r7; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee -a $S
H200=0; case "$GPU" in *H200*) H200=1;; esac
SYN=; if [ $H200 = 1 ] && [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=6 nice -n 19 /tmp/b15/main/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
run_bench() { timeout 60 $2 --random-layers 40 --lengths 256 --batch 1,8,16,64 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], 'prefill %.0f decode %.1f %s' % (p[0]['prefill_tok_s'], p[0]['decode_tok_s'], p[0]['digest'][:6]) if p else '', ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/b15/main/bench; run_bench prod-1 /tmp/b19/prod/bench
run_bench main-2 /tmp/b15/main/bench; run_bench prod-2 /tmp/b19/prod/bench
(cd $OUT && tar czf r7.tgz r7)
LILY_REQUIRE_GPU=1 timeout 100 /tmp/b19/prod/gpu_qmm --test-threads=4 > $O/gpu_qmm.log 2>&1; echo "gpu_qmm rc $?: $(grep -a 'test result' $O/gpu_qmm.log)" | tee -a $S
LILY_REQUIRE_GPU=1 timeout 60 /tmp/b19/prod/gpu_kernels gemm --test-threads=4 > $O/gpu_kernels.log 2>&1; echo "gpu_kernels gemm rc $?: $(grep -a 'test result' $O/gpu_kernels.log)" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_qmm.log $O/gpu_kernels.log | head -8 | tee -a $S
(cd $OUT && tar czf r7.tgz r7)
echo "after A/B and tests: ${SECONDS}s" | tee -a $S
[ $H200 = 1 ] || exit 0
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
for c in 2048 4096; do
  [ $SECONDS -lt 240 ] && { LILY_SERVE_ARGS="--prefill-chunk $c" LILY_BIN=/tmp/b15/main/lily BENCH_JSON=$O/serve64-chunk$c.json timeout 40 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64-chunk$c.txt 2>&1 || echo "serve64 chunk $c failed" | tee -a $S; J $O/serve64-chunk$c.json; }
done
(cd $OUT && tar czf r7.tgz r7)
[ $SECONDS -lt 250 ] && { timeout $((300 - SECONDS)) /tmp/b15/main/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S; cat $O/contract-main.md 2>/dev/null | tee -a $S; }
(cd $OUT && tar czf r7.tgz r7)
