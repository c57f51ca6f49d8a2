# Session 52, call 12: warp 0 of each dense qmm block requests x's lines into L1 after the dependency wait (steps of
# up to 4 tokens; branch s52-xpf0). c20b.tar.xz: main51/bench = main 582a5e2e; c52e.tar.xz: xp/{bench,qmm_probe}.
#  1. bench --random-layers 40: steps at 1 / 2 / 4 / 8 and the 256-token prefill, main / branch / main / branch;
#  2. qmm_probe at 1 and 4 tokens (default variant).
#   run(command="bash docs/perf/2026-12-05-s52/devrun-12.sh", carry=["c20b.tar.xz", "c52e.tar.xz"])
set -u
R=$PWD; for c in c20b c52e; do mkdir -p /tmp/$c && tar xJf $R/$c.tar.xz -C /tmp/$c; done
O=$OUT/r12; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256 --batch 1,2,4,8 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f d %.1f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r.get('decode_tok_s', 0), r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/c20b/main51/bench; run_bench xpf0-1 /tmp/c52e/xp/bench
run_bench main-2 /tmp/c20b/main51/bench; run_bench xpf0-2 /tmp/c52e/xp/bench
timeout 60 /tmp/c52e/xp/qmm_probe 1,4 0 > $O/probe.txt 2>&1; grep -E "lm_head  |in_proj  |out_proj  " $O/probe.txt | tee -a $S
