# Session 60, call 10 (any card, ~2 min), c60f.tar.xz (branch s60-direct-wide 5ff169b0: bench, gpu_kernels): the
# wide 16-row expert tiles (256 W rows, 512 threads) against the same binary with LILY_GEMM_WIDE=0 (main's tiles):
# gpu_kernels (wide on), then two interleaved rounds of bench --random-layers 40 --lengths 256,512,1024,2048.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r10; mkdir -p $O /tmp/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf $R/c60f.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/x/g60f/s60-direct-wide; echo "branch $(cut -c1-8 $B/REVISION)" | tee -a $S
export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
timeout 150 $B/gpu_kernels --test-threads=2 > $O/gpu_kernels.log 2>&1; echo "gpu_kernels rc $?: $(grep 'test result' $O/gpu_kernels.log)" | tee -a $S
for r in 1 2; do
  for w in 0 1; do
    LILY_GEMM_WIDE=$w timeout 60 $B/bench --random-layers 40 --lengths 256,512,1024,2048 --steps 4 > $O/w$w-r$r.jsonl 2> $O/w$w-r$r.err
    echo "wide=$w r$r rc $?: $(python3 -c "
import json,sys
print(' '.join('%d: %.0f %s' % (j['prompt_tokens'], j['prefill_tok_s'], j['digest'][:8]) for j in map(json.loads, open(sys.argv[1])) if 'prompt_tokens' in j))" $O/w$w-r$r.jsonl)" | tee -a $S
  done
done
(cd $OUT && tar czf r10.tgz r10 && rm -rf r10)
