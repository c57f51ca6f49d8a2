# Session 50's last call. c14.tar.xz: main/bench = main 46a742e8 (histories 171 and 173 merged);
# apdl/{bench,gpu_attention} = branch attn-pdl 2029f335 (the decode step's attention kernels launched with
# programmatic dependent launch).
#  1. bench --random-layers 40 --lengths 256,4096 --batch 1,8,64: main and apdl interleaved, two rounds;
#  2. apdl's gpu_attention with LILY_REQUIRE_GPU=1.
#   run(command="bash docs/perf/2026-12-05-s50/devrun-5.sh", carry=["c14.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b14; mkdir -p /tmp/b14 && tar xJf $R/c14.tar.xz -C /tmp/b14; B=/tmp/b14
O=$OUT/r5; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee -a $S
run_bench() { timeout 70 $2 --random-layers 40 --lengths 256,4096 --batch 1,8,64 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('%d: prefill %.0f decode %.1f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r['decode_tok_s'], r['digest'][:6]) for r in p), ' '.join('b%d %.3f ms %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 $B/main/bench; run_bench apdl-1 $B/apdl/bench; run_bench main-2 $B/main/bench; run_bench apdl-2 $B/apdl/bench
(cd $OUT && tar czf r5.tgz r5)
LILY_REQUIRE_GPU=1 timeout 100 $B/apdl/gpu_attention --test-threads=2 > $O/gpu_attention.log 2>&1; echo "gpu_attention rc $?: $(grep -a 'test result' $O/gpu_attention.log)" | tee -a $S
grep -a 'FAILED\|panicked' $O/gpu_attention.log | head -5 | tee -a $S
(cd $OUT && tar czf r5.tgz r5 && rm -rf r5)
