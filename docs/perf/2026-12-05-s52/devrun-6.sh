# Session 52, call 6: qmm's task-start L1 request of a task's x lines (QMM_NO_X_TASK_PREFETCH turns it off).
# c20.tar.xz: main51/{bench,lily} = main 582a5e2e; c52b.tar.xz: p52b/{bench,qmm_probe} = main + the change.
#  1. qmm_probe at 1 / 8 / 64 tokens: the change (variant 0) against it turned off (15), twice;
#  2. bench --random-layers 40: steps at 1 / 8 / 16 / 64 and the 256-token prefill, main / change / main / change.
#   run(command="bash docs/perf/2026-12-05-s52/devrun-6.sh", carry=["c20.tar.xz", "c52b.tar.xz"])
set -u
R=$PWD; for c in c20 c52b; do mkdir -p /tmp/$c && tar xJf $R/$c.tar.xz -C /tmp/$c; done
O=$OUT/r6; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
for r in 1 2; do timeout 150 /tmp/c52b/p52b/qmm_probe 1,8,64 0,15 > $O/probe-$r.txt 2>&1; grep -E "in_proj  |out_proj  |lm_head  |moe:" $O/probe-$r.txt | tee -a $S; done
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256 --batch 1,8,16,64 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/c20/main51/bench; run_bench xtp-1 /tmp/c52b/p52b/bench
run_bench main-2 /tmp/c20/main51/bench; run_bench xtp-2 /tmp/c52b/p52b/bench
(cd $OUT && tar czf r6.tgz r6)
