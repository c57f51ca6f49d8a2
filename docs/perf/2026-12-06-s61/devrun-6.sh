# Session 61, short H200 call (~1.5 min; stops at once on another card), c61b.tar.xz (main 344e388f): gpu_qmm's
# router tests, then bench at 1 / 16 / 32 / 64 / 128 tokens with --router-mma off against main's default (40),
# two interleaved rounds.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r6; mkdir -p $O /tmp/x
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
case "$GPU" in *H200*) ;; *) echo "not an H200, nothing run" | tee -a $S; exit 0;; esac
tar xJf $R/c61b.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/x/g61b/main; echo "main $(cut -c1-8 $B/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
LILY_REQUIRE_GPU=1 timeout 100 $B/gpu_qmm --test-threads=2 moe_router > $O/gpu_qmm.log 2>&1
echo "gpu_qmm (router tests) rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_qmm.log)" | tee -a $S
grep -E "FAIL|panicked|moe_router_mma:" $O/gpu_qmm.log | head -10 | tee -a $S
for r in 1 2; do
  for m in off 40; do
    timeout 60 $B/bench --random-layers 40 --lengths "" --batch 1,16,32,64,128 --router-mma $m > $O/m$m-r$r.jsonl 2> $O/m$m-r$r.err
    echo "router-mma=$m r$r rc $? at ${SECONDS}s: $(python3 -c "
import json,sys
print(' '.join('%d: %.3f %s' % (j['batch'], j['step_ms'], j['seq0_digest'][:8]) for j in map(json.loads, open(sys.argv[1])) if 'batch' in j))" $O/m$m-r$r.jsonl)" | tee -a $S
  done
done
(cd $OUT && tar czf r6.tgz r6 && rm -rf r6)
