# Session 61, call 1 (any card, ~5 min), c61a.tar.xz (branch s61-router-mma: lily, bench, qmm_probe, gpu_qmm,
# gpu_model): moe_router_mma (the GEMM path's router on mma.sync) against moe_router in one binary.
# 1. gpu_qmm (the new test against moe_router and the reference; the others with the new argument).
# 2. bench --random-layers 40 --batch 1,8,16,32,64,128, --router-mma off against the default (9), two
#    interleaved rounds; then the 64-token timeline of each.
# 3. gpu_model (its full-width test now with the tensor-core router from 3 sequences), with the time left.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r1; mkdir -p $O /tmp/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf $R/c61a.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/x/g61a/s61; echo "branch $(cut -c1-8 $B/REVISION)" | tee -a $S
export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
timeout 200 $B/gpu_qmm --test-threads=2 > $O/gpu_qmm.log 2>&1; echo "gpu_qmm rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_qmm.log)" | tee -a $S
grep -E "FAIL|panicked|moe_router_mma:" $O/gpu_qmm.log | head -20 | tee -a $S
for r in 1 2; do
  for m in off 9; do
    timeout 90 $B/bench --random-layers 40 --lengths "" --batch 1,8,16,32,64,128 --router-mma $m > $O/m$m-r$r.jsonl 2> $O/m$m-r$r.err
    echo "router-mma=$m r$r rc $?: $(python3 -c "
import json,sys
print(' '.join('%d: %.3f %s' % (j['batch'], j['step_ms'], j['seq0_digest'][:8]) for j in map(json.loads, open(sys.argv[1])) if 'batch' in j))" $O/m$m-r$r.jsonl)" | tee -a $S
  done
done
for m in off 9; do
  timeout 60 $B/bench --random-layers 40 --lengths "" --batch 64 --timeline --router-mma $m > $O/tl-$m.jsonl 2> $O/tl-$m.err
  echo "timeline router-mma=$m rc $?" | tee -a $S; grep -A8 "timeline of batch 64" $O/tl-$m.err | tee -a $S
done
(cd $OUT && tar czf r1.tgz r1)
LEFT=$((570 - SECONDS)); echo "gpu_model with ${LEFT}s left" | tee -a $S
timeout $LEFT $B/gpu_model --test-threads=2 > $O/gpu_model.log 2>&1; echo "gpu_model rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_model.log)" | tee -a $S
grep -E "FAIL|panicked" $O/gpu_model.log | head -20 | tee -a $S
(cd $OUT && tar czf r1.tgz r1 && rm -rf r1)
