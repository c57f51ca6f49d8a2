# For the next lease: everything session 52 left waiting, in one call (~8 min on an H200; results are written as they
# come, so a call cut at its limit still returns them). c52g.tar.xz (/work/lease-next/ on the development machine):
#   g/main/{bench,lily}         main 582a5e2e's build (main's kernels; later commits are docs, probes, SASS-identical mends)
#   g/xpf0/bench                branch s52-xpf0 da7ca767 (history 186)
#   g/resid/{bench,gpu_qmm,gpu_model}  branch s52-resid 9d70d9b4 (history 187)
#   g/parts/qmm_probe           main 01fa5bc7's probe with the stage-math part variants (history 184)
#  1. any card: steps at 1 / 2 / 4 / 8 and the 256-token prefill, main / xpf0 / resid, two interleaved rounds
#     (digests must agree); resid's gpu_qmm and gpu_model (LILY_REQUIRE_GPU=1);
#  2. an H200 only: main's contract (`lily bench`, ten lengths, median of 2 rounds: the JSON the issues ask for)
#     and the stage-math parts probe at 1 / 8 / 64 tokens.
#   run(command="bash docs/perf/2026-12-05-s52/devrun-15.sh", carry=["c52g.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; mkdir -p /tmp/c52g && tar xJf $R/c52g.tar.xz -C /tmp/c52g; B=/tmp/c52g/g
O=$OUT/r15; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee -a $S
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256 --batch 1,2,4,8 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f d %.1f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r.get('decode_tok_s', 0), r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
for r in 1 2; do run_bench main-$r $B/main/bench; run_bench xpf0-$r $B/xpf0/bench; run_bench resid-$r $B/resid/bench; done
(cd $OUT && tar czf r15.tgz r15)
LILY_REQUIRE_GPU=1 timeout 150 $B/resid/gpu_qmm --test-threads=4 > $O/gpu_qmm.log 2>&1; echo "resid gpu_qmm rc $?: $(grep -a 'test result' $O/gpu_qmm.log)" | tee -a $S
LILY_REQUIRE_GPU=1 timeout 120 $B/resid/gpu_model --test-threads=2 > $O/gpu_model.log 2>&1; echo "resid gpu_model rc $?: $(grep -a 'test result' $O/gpu_model.log)" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_qmm.log $O/gpu_model.log | head -8 | tee -a $S
(cd $OUT && tar czf r15.tgz r15)
case "$GPU" in *H200*) ;; *) exit 0;; esac
M=/tmp/lily-full
RAYON_NUM_THREADS=14 $B/main/lily synth --preset full --out $M > $O/synth.log 2>&1; tail -1 $O/synth.log | tee -a $S
timeout 300 $B/main/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r15.tgz r15)
timeout 120 $B/parts/qmm_probe 1,8,64 0,2,11,12,13,14 > $O/qmm-probe-parts.txt 2>&1; grep -E "in_proj  |moe:" $O/qmm-probe-parts.txt | tee -a $S
(cd $OUT && tar czf r15.tgz r15)
