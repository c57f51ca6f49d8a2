# For a later lease (session 51 left it unrun: no device time). History 179, branch s51-direct-issue 580f6803 (the
# short GEMM tiles' A address and first k-tile kept in registers) against main 582a5e2e. c20.tar.xz: main51/{bench,
# lily}; c21.tar.xz: dis/{bench,lily,gpu_kernels,gpu_model} (both in /work/lease-next/ on the development machine).
#  1. prefill at 256 / 1,024 / 4,096 and steps at 1 / 9 / 16 / 64: main, dis, main, dis (digests must agree);
#  2. gpu_kernels' GEMM tests and gpu_model of dis (LILY_REQUIRE_GPU=1).
#   run(command="bash docs/perf/2026-12-05-s51/devrun-11.sh", carry=["c20.tar.xz", "c21.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; for c in 20 21; do rm -rf /tmp/b$c; mkdir -p /tmp/b$c && tar xJf $R/c$c.tar.xz -C /tmp/b$c; done
O=$OUT/r11; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256,1024,4096 --batch 1,9,16,64 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/b20/main51/bench; run_bench dis-1 /tmp/b21/dis/bench
run_bench main-2 /tmp/b20/main51/bench; run_bench dis-2 /tmp/b21/dis/bench
LILY_REQUIRE_GPU=1 timeout 90 /tmp/b21/dis/gpu_kernels gemm --test-threads=4 > $O/gpu_kernels.log 2>&1; echo "gpu_kernels gemm rc $?: $(grep -a 'test result' $O/gpu_kernels.log)" | tee -a $S
LILY_REQUIRE_GPU=1 timeout 150 /tmp/b21/dis/gpu_model --test-threads=2 > $O/gpu_model.log 2>&1; echo "gpu_model rc $?: $(grep -a 'test result' $O/gpu_model.log)" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_kernels.log $O/gpu_model.log | head -8 | tee -a $S
(cd $OUT && tar czf r11.tgz r11)
