# Session 62, any card (~5-6 min): branch s62-gemm256, c62a.tar.xz: g62a/b = commit 1 (the 256-row wgmma tile, A by
# cp.async), g62a/t = commit 2 (its A tiles by TMA); bench, gpu_kernels, gpu_model each.
# 1. gpu_kernels' gemm tests on t then b (every tile height; split-K and segments at 130 rows on the 256-row tile);
# 2. prefill A/B, bench --random-layers 40 --lengths 256,512, two interleaved rounds: t --dense-whole off (main's
#    tiles), b 96, t 96, t 1; 3. the 256-token prefill's timeline, t off and t 96;
# 4. gpu_model's full-width test on t (a 200-token pass on 256-row tiles vs lily-cpu).
#   run(command="bash docs/perf/2026-12-06-s62/devrun-1.sh", carry=["c62a.tar.xz"])
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r1; mkdir -p $O /tmp/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf $R/c62a.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/x/g62a; echo "b $(cut -c1-8 $G/b/REVISION) t $(cut -c1-8 $G/t/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
for v in t b; do
  LILY_REQUIRE_GPU=1 timeout 120 $G/$v/gpu_kernels --test-threads=1 gemm > $O/gpu_kernels-$v.log 2>&1
  echo "gpu_kernels gemm ($v) rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_kernels-$v.log)" | tee -a $S
  grep -E "FAIL|panicked|failed" $O/gpu_kernels-$v.log | head -6 | tee -a $S
done
P() { python3 -c "
import json,sys
print(' '.join('%d: %.0f %s' % (j['prompt_tokens'], j['prefill_tok_s'], j['digest'][:8]) for j in map(json.loads, open(sys.argv[1])) if 'prompt_tokens' in j))" $1; }
for r in 1 2; do
  for c in t:off b:96 t:96 t:1; do
    v=${c%%:*}; w=${c##*:}
    timeout 60 $G/$v/bench --random-layers 40 --lengths 256,512 --steps 4 --dense-whole $w > $O/$v$w-r$r.jsonl 2> $O/$v$w-r$r.err
    echo "$v dense-whole $w r$r rc $? at ${SECONDS}s: $(P $O/$v$w-r$r.jsonl)" | tee -a $S
  done
done
(cd $OUT && tar czf r1.tgz r1)
for w in off 96; do
  timeout 60 $G/t/bench --random-layers 40 --lengths 256 --steps 4 --dense-whole $w --timeline > $O/tl-$w.jsonl 2> $O/tl-$w.err
  echo "timeline t $w rc $? at ${SECONDS}s" | tee -a $S
  grep -A12 "prefill of 256 tokens: span" $O/tl-$w.err | tee -a $S
done
(cd $OUT && tar czf r1.tgz r1)
LILY_REQUIRE_GPU=1 timeout 200 $G/t/gpu_model --test-threads=1 full_width_four_layer > $O/gpu_model.log 2>&1
echo "gpu_model full width (t) rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_model.log)" | tee -a $S
grep -E "FAIL|panicked|200-token|256-row" $O/gpu_model.log | head -10 | tee -a $S
(cd $OUT && tar czf r1.tgz r1 && rm -rf r1)
