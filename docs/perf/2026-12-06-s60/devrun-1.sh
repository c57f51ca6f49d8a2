# Session 60, call 1 (any card): qmm_moe_f16 variants of the probe branch s60-probe (c60a.tar.xz: bench, gpu_qmm):
# LILY_PROBE_MOE_F16 = (default) | occ5 (5 blocks an SM, 96 registers) | lean (fold as two fma an output) |
# lean_occ5. gpu_qmm with each (the fp16 experts against lily-cpu), then ms a step at 32 / 64 / 128 sequences,
# two interleaved rounds (bench --random-layers 40).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r1; mkdir -p $O /tmp/g
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf $R/c60a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/probe; echo "probe $(cut -c1-8 $B/REVISION)" | tee -a $S
export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
for v in default lean occ5; do
  LILY_PROBE_MOE_F16=$v timeout 120 $B/gpu_qmm moe_router_plan_and_experts_match_the_reference --test-threads 1 > $O/gpu_qmm-$v.txt 2>&1; echo "gpu_qmm $v rc $? at ${SECONDS}s: $(grep -E '^test result' $O/gpu_qmm-$v.txt)" | tee -a $S
done
for r in 1 2; do
  for v in default occ5 lean lean_occ5; do
    LILY_PROBE_MOE_F16=$v timeout 60 $B/bench --random-layers 40 --lengths "" --batch 32,64,128 > $O/b-$v-r$r.jsonl 2> $O/b-$v-r$r.err
    echo "$v r$r rc $? at ${SECONDS}s: $(python3 -c "
import json,sys
print(' '.join('%d: %.3f %s' % (j['batch'], j['step_ms'], j['seq0_digest'][:8]) for j in map(json.loads, open(sys.argv[1])) if 'batch' in j))" $O/b-$v-r$r.jsonl)" | tee -a $S
  done
done
(cd $OUT && tar czf r1.tgz r1 && rm -rf r1)
