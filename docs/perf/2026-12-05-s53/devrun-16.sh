# Session 53's branch s53-fused-reduce (cca530d6, crates/cuda/NOTES.md history 188) against main, any card (~5 min):
# split launches of 2-4 splits on tiles of up to 64 rows (the in-projections of decode steps of 9-64 tokens on the
# GEMM path) reduced by each tile's last split block instead of a gemm_splitk_reduce launch; the same bits by
# construction, so the digests must agree. Carries (`/work/lease-next/` on the development machine):
#   c52g.tar.xz: g/main/bench   main 582a5e2e's build (main's kernels); g/parts/qmm_probe (main 01fa5bc7's probe)
#   c53.tar.xz:  g53/fr/{bench,gpu_kernels,gpu_model}   branch s53-fused-reduce cca530d6
#   run(command="bash docs/perf/2026-12-05-s53/devrun-16.sh", carry=["c52g.tar.xz", "c53.tar.xz"])
# 1. steps at 16 / 32 / 64 / 128 tokens (128: 128-row tiles, not fused: a control) and the 256-token prefill
#    (its split launches are on 128-row tiles: unchanged), main / branch, two interleaved rounds;
# 2. the branch's gpu_kernels (both reductions bit for bit, counters back at 0) and gpu_model, LILY_REQUIRE_GPU=1;
# 3. qmm_probe at 64 tokens, main's kernels with rings of 4 (default), no math, and rings of 6 for every matrix kernel:
#    whether deeper rings move the experts' stream at 64 tokens on this card (history 184's question, from the ring side).
set -u
R=$PWD; mkdir -p /tmp/c52g /tmp/c53
tar xJf $R/c52g.tar.xz -C /tmp/c52g g/main/bench g/parts/qmm_probe && tar xJf $R/c53.tar.xz -C /tmp/c53 || { echo "tarballs missing" | tee $OUT/summary.txt; exit 1; }
M=/tmp/c52g/g/main; P=/tmp/c52g/g/parts; F=/tmp/c53/g53/fr
O=$OUT/r16; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee -a $S
run_bench() { timeout 150 $2 --random-layers 40 --lengths 256 --batch 16,32,64,128 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f d %.1f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r.get('decode_tok_s', 0), r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
for r in 1 2; do run_bench main-$r $M/bench; run_bench fr-$r $F/bench; done
(cd $OUT && tar czf r16.tgz r16)
LILY_REQUIRE_GPU=1 timeout 150 $F/gpu_kernels --test-threads=2 > $O/gpu_kernels.log 2>&1; echo "fr gpu_kernels rc $?: $(grep -a 'test result' $O/gpu_kernels.log)" | tee -a $S
LILY_REQUIRE_GPU=1 timeout 150 $F/gpu_model --test-threads=2 > $O/gpu_model.log 2>&1; echo "fr gpu_model rc $?: $(grep -a 'test result' $O/gpu_model.log)" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_kernels.log $O/gpu_model.log | head -8 | tee -a $S
(cd $OUT && tar czf r16.tgz r16)
timeout 100 $P/qmm_probe 64 0,2,6 > $O/qmm-probe-rings.txt 2>&1; grep -E "device copy|moe:" $O/qmm-probe-rings.txt | tee -a $S
(cd $OUT && tar czf r16.tgz r16)
