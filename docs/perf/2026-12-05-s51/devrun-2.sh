# Session 51, call 2. c15.tar.xz: main/{bench,lily} = main ff98d920 (main ada5f760's code but for 5b6ab300's
# refactor). c17.tar.xz: xpf/{bench,lily,gpu_qmm,qmm_probe} = branch s51-xpf (the expert kernels prefetch the
# next stage's x into L1).
#  1. the full-shape checkpoint written in the background (H200 only);
#  2. bench steps at 1, 8, 16, 32, 64 and the 256 prefill: main, xpf, main, xpf (digests must agree);
#  3. gpu_qmm's MoE tests of xpf (LILY_REQUIRE_GPU=1);
#  4. H200 only: serving 64 clients with main and xpf, main's contract lengths, main's 1 and 8 clients.
#   run(command="bash docs/perf/2026-12-05-s51/devrun-2.sh", carry=["c15.tar.xz", "c17.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; rm -rf /tmp/b15 /tmp/b17; mkdir -p /tmp/b15 /tmp/b17 && tar xJf $R/c15.tar.xz -C /tmp/b15 && tar xJf $R/c17.tar.xz -C /tmp/b17
O=$OUT/r2; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee -a $S
H200=0; case "$GPU" in *H200*) H200=1;; esac
SYN=; if [ $H200 = 1 ] && [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=8 nice -n 19 /tmp/b15/main/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
run_bench() { timeout 80 $2 --random-layers 40 --lengths 256 --batch 1,8,16,32,64 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], 'prefill %.0f decode %.1f' % (p[0]['prefill_tok_s'], p[0]['decode_tok_s']) if p else '', ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/b15/main/bench; run_bench xpf-1 /tmp/b17/xpf/bench
run_bench main-2 /tmp/b15/main/bench; run_bench xpf-2 /tmp/b17/xpf/bench
LILY_REQUIRE_GPU=1 timeout 90 /tmp/b17/xpf/gpu_qmm moe_ --test-threads=2 --nocapture > $O/gpu_qmm.log 2>&1; echo "gpu_qmm moe_ rc $?: $(grep -a 'test result' $O/gpu_qmm.log)" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_qmm.log | head -8 | tee -a $S
timeout 40 /tmp/b17/xpf/qmm_probe 8,64 0 > $O/probe.txt 2>&1; grep -a 'moe:' $O/probe.txt | tee -a $S
(cd $OUT && tar czf r2.tgz r2)
echo "after A/B: ${SECONDS}s" | tee -a $S
[ $H200 = 1 ] || exit 0
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=/tmp/b15/main/lily BENCH_JSON=$O/serve64-main.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64-main.txt 2>&1 || echo "serve64 main failed" | tee -a $S; J $O/serve64-main.json
LILY_BIN=/tmp/b17/xpf/lily BENCH_JSON=$O/serve64-xpf.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64-xpf.txt 2>&1 || echo "serve64 xpf failed" | tee -a $S; J $O/serve64-xpf.json
(cd $OUT && tar czf r2.tgz r2)
echo "after serve64: ${SECONDS}s" | tee -a $S
[ $SECONDS -lt 420 ] && { timeout $((520 - SECONDS)) /tmp/b15/main/bench --random-layers 40 --lengths 256,4096,32768,131072 > $O/contract.jsonl 2> $O/contract.err; echo "contract rc $?" | tee -a $S; grep -a '^{' $O/contract.jsonl | cut -c1-150 | tee -a $S; }
(cd $OUT && tar czf r2.tgz r2)
[ $SECONDS -lt 510 ] && { LILY_BIN=/tmp/b15/main/lily BENCH_JSON=$O/serve8.json timeout $((585 - SECONDS)) bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8.txt 2>&1 || echo "serve8 failed" | tee -a $S; J $O/serve8.json; }
(cd $OUT && tar czf r2.tgz r2)
