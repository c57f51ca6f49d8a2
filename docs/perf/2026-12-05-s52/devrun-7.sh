# Session 52, call 7: one-token launches with x staged in shared memory (the *_x entries).
# c20b.tar.xz: main51/bench = main 582a5e2e; c52c.tar.xz: xs/{bench,qmm_probe,gpu_qmm,gpu_model,...} = the branch.
#  1. gpu_qmm, gpu_model (LILY_REQUIRE_GPU=1); 2. qmm_probe at 1 token: staged (0) against not (15), twice;
#  3. bench --random-layers 40, steps at 1 / 2 / 8 and the contract's decode at 256: main / branch / main / branch.
#   run(command="bash docs/perf/2026-12-05-s52/devrun-7.sh", carry=["c20b.tar.xz", "c52c.tar.xz"])
set -u
R=$PWD; for c in c20b c52c; do mkdir -p /tmp/$c && tar xJf $R/$c.tar.xz -C /tmp/$c; done
O=$OUT/r7; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
LILY_REQUIRE_GPU=1 timeout 120 /tmp/c52c/xs/gpu_qmm --test-threads=1 > $O/gpu_qmm.log 2>&1; echo "gpu_qmm rc $?: $(grep -a 'test result' $O/gpu_qmm.log)" | tee -a $S
for r in 1 2; do timeout 100 /tmp/c52c/xs/qmm_probe 1 0,15 > $O/probe-$r.txt 2>&1; grep -E "in_proj  |out_proj  |lm_head  |moe:" $O/probe-$r.txt | tee -a $S; done
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256 --batch 1,2,8 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f d %.1f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r.get('decode_tok_s', 0), r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/c20b/main51/bench; run_bench xs-1 /tmp/c52c/xs/bench
run_bench main-2 /tmp/c20b/main51/bench; run_bench xs-2 /tmp/c52c/xs/bench
(cd $OUT && tar czf r7.tgz r7)
LILY_REQUIRE_GPU=1 timeout 150 /tmp/c52c/xs/gpu_model --test-threads=2 > $O/gpu_model.log 2>&1; echo "gpu_model rc $?: $(grep -a 'test result' $O/gpu_model.log)" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_qmm.log $O/gpu_model.log | head -8 | tee -a $S
(cd $OUT && tar czf r7.tgz r7)
