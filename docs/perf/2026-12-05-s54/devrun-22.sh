# Session 54, call 5 (any card, ~3 min): history 192, branch s54-split-entries (every GEMM tile height compiled twice,
# unsplit and split-K, so the unsplit epilogue's per-value tests of the partial row fold away; history 191 found
# 188's restructured epilogue -1.1% at 128 tokens and +1.4-1.9% on short prefills, but a clean copy of it spilled).
# The same arithmetic, so every digest must equal main's. Carries c54e.tar.xz (git-ignored; stripped, with REVISIONs):
#   g54/main/bench   main 648ed673        g54/se/{bench,gpu_kernels,gpu_model}   s54-split-entries
#   run(command="bash docs/perf/2026-12-05-s54/devrun-22.sh", carry=["c54e.tar.xz"])
# 1. steps at 16 / 32 / 64 / 128 and the 256- and 1,024-token prefills, main / se, two interleaved rounds;
# 2. se's gpu_kernels (split-K against the reference and the reduction, bit for bit) and gpu_model, LILY_REQUIRE_GPU=1.
set -u
R=$PWD; mkdir -p /tmp/c54e
tar xJf $R/c54e.tar.xz -C /tmp/c54e || { echo "tarball missing" | tee $OUT/summary.txt; exit 1; }
G=/tmp/c54e/g54
O=$OUT/r22; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU$(for b in main se; do printf ' %s %s' $b $(cut -c1-8 $G/$b/REVISION); done)" | tee -a $S
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256,1024 --batch 16,32,64,128 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
for r in 1 2; do for b in main se; do run_bench $b-$r $G/$b/bench; done; done
echo "A/B done at ${SECONDS}s" | tee -a $S
(cd $OUT && tar czf r22.tgz r22)
for t in gpu_kernels gpu_model; do
  l=$O/se-$t.log; LILY_REQUIRE_GPU=1 timeout 100 $G/se/$t --test-threads=4 > $l 2>&1; echo "se $t rc $?: $(grep -a 'test result' $l) at ${SECONDS}s" | tee -a $S
done
grep -a 'FAIL\|panicked' $O/*.log | head -8 | tee -a $S
(cd $OUT && tar czf r22.tgz r22)
