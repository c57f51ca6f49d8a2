# Session 61, short call (any card, ~3 min), c61a.tar.xz (branch s61-router-mma): gpu_qmm's router tests
# (the new one against moe_router and the reference, and the MoE one), then bench at 1 / 8 / 16 / 32 / 64 / 128
# tokens, --router-mma off against the default (9), two interleaved rounds.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r4; mkdir -p $O /tmp/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf $R/c61a.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/x/g61a/s61; echo "branch $(cut -c1-8 $B/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
LILY_REQUIRE_GPU=1 timeout 150 $B/gpu_qmm --test-threads=2 moe_router > $O/gpu_qmm.log 2>&1; rc=$?
echo "gpu_qmm (router tests) rc $rc at ${SECONDS}s: $(grep 'test result' $O/gpu_qmm.log)" | tee -a $S
grep -E "FAIL|panicked|moe_router_mma:" $O/gpu_qmm.log | head -20 | tee -a $S
for r in 1 2; do
  for m in off 9; do
    timeout 90 $B/bench --random-layers 40 --lengths "" --batch 1,8,16,32,64,128 --router-mma $m > $O/m$m-r$r.jsonl 2> $O/m$m-r$r.err
    echo "router-mma=$m r$r rc $? at ${SECONDS}s: $(python3 -c "
import json,sys
print(' '.join('%d: %.3f %s' % (j['batch'], j['step_ms'], j['seq0_digest'][:8]) for j in map(json.loads, open(sys.argv[1])) if 'batch' in j))" $O/m$m-r$r.jsonl)" | tee -a $S
  done
done
(cd $OUT && tar czf r4.tgz r4 && rm -rf r4)
