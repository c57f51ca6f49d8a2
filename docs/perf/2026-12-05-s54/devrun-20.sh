# Session 54, call 3 (any card, ~3 min; on an H200 also main's contract with the time left). Call 2 had history 188
# (s53-fused-reduce) slower where it reduces in the launch (16-64 tokens) but faster where it does not (128 tokens
# 21.475 -> 21.210 ms, the 256-token prefill +1.5%): whether its restructured GEMM epilogue alone (`for_each_partial`)
# is worth having. Carries c54c.tar.xz (git-ignored; stripped, each dir with a REVISION):
#   g54/main/{bench,lily}   main 648ed673      g54/fr/bench   s53-fused-reduce cca530d6
#   g54/froff/bench         s54-fr-off (188 rebased on main, the in-launch reduction never chosen)
#   run(command="bash docs/perf/2026-12-05-s54/devrun-20.sh", carry=["c54c.tar.xz"], kind="nvidia-h200")
# 1. steps at 16 / 32 / 64 / 128 and the 256- and 1,024-token prefills, main / fr / froff, two interleaved rounds;
# 2. on an H200: main's contract (`lily bench`, ten lengths, median of 2 rounds), the checkpoint written meanwhile.
set -u
R=$PWD; mkdir -p /tmp/c54c
tar xJf $R/c54c.tar.xz -C /tmp/c54c || { echo "tarball missing" | tee $OUT/summary.txt; exit 1; }
G=/tmp/c54c/g54; CK=/tmp/lily-full
O=$OUT/r20; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU$(for b in main fr froff; do printf ' %s %s' $b $(cut -c1-8 $G/$b/REVISION); done)" | tee -a $S
H200=0; case "$GPU" in *H200*) H200=1; RAYON_NUM_THREADS=8 nice -n 19 $G/main/lily synth --preset full --out $CK > $O/synth.log 2>&1 & ;; esac
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256,1024 --batch 16,32,64,128 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
for r in 1 2; do for b in main fr froff; do run_bench $b-$r $G/$b/bench; done; done
echo "A/B done at ${SECONDS}s" | tee -a $S
(cd $OUT && tar czf r20.tgz r20)
if [ $H200 = 1 ]; then
  wait
  tail -1 $O/synth.log | tee -a $S
  timeout 300 $G/main/lily bench --model $CK --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
  cat $O/contract-main.md 2>/dev/null | tee -a $S
  (cd $OUT && tar czf r20.tgz r20)
fi
