# Session 50's third call. c12.tar.xz: main/bench = main 0a2c7fae (the split-K reduction merged, history 171);
# pdl/{bench,gpu_kernels,gpu_model} = branch gemm-pdl 416dda41 (the GEMM and its reduction launched with
# programmatic dependent launch; a dense GEMM requests its first k-tiles' weight lines into L2 before its wait).
#  1. pdl's gpu_kernels and gpu_model with LILY_REQUIRE_GPU=1;
#  2. bench --random-layers 40 --lengths 256 --batch 1,8,16,64: main and pdl interleaved, two rounds;
#  3. pdl's timeline at 16 and 64;
#  4. on an H200 only: the contract on main, bench --random-layers 40 --lengths 256,4096,32768,131072.
#   run(command="bash docs/perf/2026-12-05-s50/devrun-3.sh", carry=["c12.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b12; mkdir -p /tmp/b12 && tar xJf $R/c12.tar.xz -C /tmp/b12; B=/tmp/b12
O=$OUT/r3; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee -a $S
for t in gpu_kernels gpu_model; do
  LILY_REQUIRE_GPU=1 timeout 150 $B/pdl/$t --test-threads=2 > $O/$t.log 2>&1; echo "$t rc $?: $(grep -a 'test result' $O/$t.log)" | tee -a $S
  grep -a 'FAILED\|panicked' $O/$t.log | head -5 | tee -a $S
done
run_bench() { timeout 70 $2 --random-layers 40 --lengths 256 --batch 1,8,16,64 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], 'prefill %.0f decode %.1f %s' % (p[0]['prefill_tok_s'], p[0]['decode_tok_s'], p[0]['digest'][:6]) if p else '', ' '.join('b%d %.3f ms %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 $B/main/bench; run_bench pdl-1 $B/pdl/bench; run_bench main-2 $B/main/bench; run_bench pdl-2 $B/pdl/bench
L=$(find /usr/local -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3); TLP=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')
LD_LIBRARY_PATH=$TLP${LD_LIBRARY_PATH:-} timeout 60 $B/pdl/bench --random-layers 40 --lengths "" --batch 16,64 --timeline > $O/tl-pdl.jsonl 2> $O/tl-pdl.err; echo "timeline pdl rc $?" | tee -a $S
grep -a -A10 'timeline of' $O/tl-pdl.err | cut -c1-90 >> $S
(cd $OUT && tar czf r3.tgz r3)
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { (cd $OUT && rm -rf r3); exit 0; }
timeout 200 $B/main/bench --random-layers 40 --lengths 256,4096,32768,131072 > $O/contract-main.jsonl 2> $O/contract-main.err; echo "contract rc $?" | tee -a $S
grep -a '^{' $O/contract-main.jsonl | cut -c1-170 | tee -a $S
(cd $OUT && tar czf r3.tgz r3 && rm -rf r3)
