# For a later lease (session 52 left it unrun: no device time). History 187, branch s52-resid: the out-projections'
# residual rows read when a task starts instead of in the epilogue (the same sums, so the same bits).
# c20b.tar.xz: main51/bench = main 582a5e2e; c52f.tar.xz: rs/{bench,gpu_qmm,gpu_model} = the branch.
#  1. bench --random-layers 40: steps at 1 / 2 / 4 / 8 and the 256-token prefill (digests must agree), main / branch
#     twice; 2. gpu_qmm and gpu_model of the branch (LILY_REQUIRE_GPU=1).
#   run(command="bash docs/perf/2026-12-05-s52/devrun-14.sh", carry=["c20b.tar.xz", "c52f.tar.xz"])
set -u
R=$PWD; for c in c20b c52f; do mkdir -p /tmp/$c && tar xJf $R/$c.tar.xz -C /tmp/$c; done
O=$OUT/r14; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256 --batch 1,2,4,8 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f d %.1f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r.get('decode_tok_s', 0), r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/c20b/main51/bench; run_bench resid-1 /tmp/c52f/rs/bench
run_bench main-2 /tmp/c20b/main51/bench; run_bench resid-2 /tmp/c52f/rs/bench
LILY_REQUIRE_GPU=1 timeout 200 /tmp/c52f/rs/gpu_qmm --test-threads=4 > $O/gpu_qmm.log 2>&1; echo "gpu_qmm rc $?: $(grep -a 'test result' $O/gpu_qmm.log)" | tee -a $S
LILY_REQUIRE_GPU=1 timeout 150 /tmp/c52f/rs/gpu_model --test-threads=2 > $O/gpu_model.log 2>&1; echo "gpu_model rc $?: $(grep -a 'test result' $O/gpu_model.log)" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_qmm.log $O/gpu_model.log | head -8 | tee -a $S
(cd $OUT && tar czf r14.tgz r14)
