# Session 50's fourth call. c13.tar.xz: main/bench = main 0a2c7fae; pdl2/{bench,gpu_kernels,gpu_model} = branch
# gemm-pdl 29e18e23 (programmatic dependent launch only for the decode steps' one-M-tile wgmma GEMMs, 33-128 tokens).
#  1. pdl2's gpu_kernels (the GEMM tests) with LILY_REQUIRE_GPU=1 (and gpu_model with WITH_MODEL=1: the device
#     budget left for this call did not hold it; call 3 ran it on every launch programmatic);
#  2. bench --random-layers 40 --lengths 256 --batch 16,32,64,128: main and pdl2 interleaved, two rounds;
#  3. on an H200 only: the contract on main, bench --random-layers 40 --lengths 256,4096,32768,131072.
#   run(command="bash docs/perf/2026-12-05-s50/devrun-4.sh", carry=["c13.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b13; mkdir -p /tmp/b13 && tar xJf $R/c13.tar.xz -C /tmp/b13; B=/tmp/b13
O=$OUT/r4; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee -a $S
LILY_REQUIRE_GPU=1 timeout 100 $B/pdl2/gpu_kernels gemm --test-threads=2 > $O/gpu_kernels.log 2>&1; echo "gpu_kernels gemm rc $?: $(grep -a 'test result' $O/gpu_kernels.log)" | tee -a $S
[ -n "${WITH_MODEL:-}" ] && { LILY_REQUIRE_GPU=1 timeout 120 $B/pdl2/gpu_model --test-threads=2 > $O/gpu_model.log 2>&1; echo "gpu_model rc $?: $(grep -a 'test result' $O/gpu_model.log)" | tee -a $S; }
grep -a 'FAILED\|panicked' $O/gpu_*.log | head -5 | tee -a $S
run_bench() { timeout 70 $2 --random-layers 40 --lengths 256 --batch 16,32,64,128 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], 'prefill %.0f decode %.1f %s' % (p[0]['prefill_tok_s'], p[0]['decode_tok_s'], p[0]['digest'][:6]) if p else '', ' '.join('b%d %.3f ms %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 $B/main/bench; run_bench pdl2-1 $B/pdl2/bench; run_bench main-2 $B/main/bench; run_bench pdl2-2 $B/pdl2/bench
(cd $OUT && tar czf r4.tgz r4)
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { (cd $OUT && rm -rf r4); exit 0; }
timeout 150 $B/main/bench --random-layers 40 --lengths 256,4096,32768,131072 > $O/contract-main.jsonl 2> $O/contract-main.err; echo "contract rc $?" | tee -a $S
grep -a '^{' $O/contract-main.jsonl | cut -c1-170 | tee -a $S
(cd $OUT && tar czf r4.tgz r4 && rm -rf r4)
