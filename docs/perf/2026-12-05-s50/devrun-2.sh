# Session 50's second call. c10.tar.xz: main/{bench,lily} = main 9b21b0da. c11.tar.xz: benches of branch s50-kernels
# variants: red = the split-K reduction only (3d5fe691's gemm.cu, main's router); dot = red + the router's chunks
# converted once; stage = red + the router's tokens staged by cp.async; s50 = both (cc2a62c7; call 1 found it
# slower at 8 and 64 tokens, the router longer); red/gpu_kernels = d2257d33's suite (the split sums' check fixed).
#  1. gpu_kernels' split-K test; 2. bench at 1, 8, 64 (and the 256 prefill): main, red, dot, stage, s50, then main
#  and red again; 3. timelines of dot and stage at 8 and 64; 4. on an H200 only: serving with main's lily.
#   run(command="bash docs/perf/2026-12-05-s50/devrun-2.sh", carry=["c10.tar.xz", "c11.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b10 /tmp/b11; mkdir -p /tmp/b10 /tmp/b11 && tar xJf $R/c10.tar.xz -C /tmp/b10 && tar xJf $R/c11.tar.xz -C /tmp/b11
O=$OUT/r2; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee -a $S
LILY_REQUIRE_GPU=1 timeout 120 /tmp/b11/red/gpu_kernels gemm_split --test-threads=2 > $O/gpu_kernels.log 2>&1; echo "gpu_kernels split rc $?: $(grep -a 'test result' $O/gpu_kernels.log)" | tee -a $S
grep -a 'FAILED' $O/gpu_kernels.log | head -5 | tee -a $S
run_bench() { timeout 70 $2 --random-layers 40 --lengths 256 --batch 1,8,64 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], 'prefill %.0f decode %.1f' % (p[0]['prefill_tok_s'], p[0]['decode_tok_s']) if p else '', ' '.join('b%d %.3f ms %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/b10/main/bench; run_bench red-1 /tmp/b11/red/bench; run_bench dot-1 /tmp/b11/dot/bench
run_bench stage-1 /tmp/b11/stage/bench; run_bench s50-1 /tmp/b11/s50/bench
run_bench main-2 /tmp/b10/main/bench; run_bench red-2 /tmp/b11/red/bench
L=$(find /usr/local -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3); TLP=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')
for v in dot stage; do
  LD_LIBRARY_PATH=$TLP${LD_LIBRARY_PATH:-} timeout 60 /tmp/b11/$v/bench --random-layers 40 --lengths "" --batch 8,64 --timeline > $O/tl-$v.jsonl 2> $O/tl-$v.err; echo "timeline $v rc $?" | tee -a $S
  grep -a -A6 'timeline of' $O/tl-$v.err | cut -c1-90 >> $S
done
(cd $OUT && tar czf r2.tgz r2)
case "$GPU" in *H200*) ;; *) exit 0;; esac
[ -f $M/config.json ] || { (RAYON_NUM_THREADS=14 /tmp/b10/main/lily synth --preset full --out $M > /tmp/synth.log 2>&1); tail -1 /tmp/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=/tmp/b10/main/lily BENCH_JSON=$O/serve1.json timeout 50 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1.txt 2>&1 || echo "serve1 failed" | tee -a $S; J $O/serve1.json
LILY_BIN=/tmp/b10/main/lily BENCH_JSON=$O/serve8.json timeout 45 bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8.txt 2>&1 || echo "serve8 failed" | tee -a $S; J $O/serve8.json
LILY_BIN=/tmp/b10/main/lily BENCH_JSON=$O/serve64.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64.txt 2>&1 || echo "serve64 failed" | tee -a $S; J $O/serve64.json
(cd $OUT && tar czf r2.tgz r2)
