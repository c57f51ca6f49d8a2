# Session 51, call 10 (the last ~270 s of device time): history 178 on the card that comes (an H200 asked for):
# bench steps at 1, 8, 16, 64 and the 256 prefill, main before it (c15: ff98d920) and main with it (c20: 582a5e2e),
# interleaved, two rounds each.
#   run(command="bash docs/perf/2026-12-05-s51/devrun-10.sh", carry=["c15.tar.xz", "c20.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; for c in 15 20; do rm -rf /tmp/b$c; mkdir -p /tmp/b$c && tar xJf $R/c$c.tar.xz -C /tmp/b$c; done
O=$OUT/r10; mkdir -p $O; S=$OUT/summary.txt
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
run_bench() { timeout 40 $2 --random-layers 40 --lengths 256 --batch 1,8,16,64 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], 'prefill %.0f decode %.1f %s' % (p[0]['prefill_tok_s'], p[0]['decode_tok_s'], p[0]['digest'][:6]) if p else '', ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench before-1 /tmp/b15/main/bench; run_bench with-1 /tmp/b20/main51/bench
run_bench before-2 /tmp/b15/main/bench; run_bench with-2 /tmp/b20/main51/bench
