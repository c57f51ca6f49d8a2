# Session 57, call 8 (any card, ~1.5 min). Carries c57e.tar.xz (g57/b6: bench and gpu_qmm of branch s57-moe-f16):
#   run(command="bash docs/perf/2026-12-06-s57/devrun-7.sh", carry=["c57e.tar.xz"])
# 1. gpu_qmm's MoE test (LILY_REQUIRE_GPU=1): the experts on fp16 x (qmm_moe_f16) against the reference, beside hi/lo.
# 2. ms a step at 16 / 32 / 64 / 128 sequences (bench --random-layers 40), --moe-f16 off (main's path) against 9,
#    two interleaved rounds.
set -u
S=$OUT/summary.txt; O=$OUT/r8; mkdir -p $O /tmp/g
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf c57e.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g57/b6; echo "branch $(cut -c1-8 $B/REVISION)" | tee -a $S
export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
for r in 1 2; do
  for v in off 9; do
    timeout 100 $B/bench --random-layers 40 --lengths "" --batch 16,32,64,128 --moe-f16 $v > $O/$v-round$r.json 2> $O/$v-round$r.err; echo "bench $v round $r rc $? at ${SECONDS}s" | tee -a $S
  done
done
python3 - $O >> $S <<'PY'
import json, sys
o = sys.argv[1]
for r in (1, 2):
    for v in ("off", "9"):
        try:
            rows = [json.loads(l) for l in open(f"{o}/{v}-round{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        print(v, r, " ".join(f"{x['batch']}: {x['step_ms']:.3f} ms {x.get('seq0_digest', '')[:8]}" for x in rows if "batch" in x))
PY
tail -4 $S
timeout 120 $B/gpu_qmm moe_router_plan_and_experts_match_the_reference > $O/gpu_qmm.log 2>&1; echo "gpu_qmm moe rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_qmm.log | tail -1)" | tee -a $S
grep -E "panicked|FAIL|fp16 experts" $O/gpu_qmm.log | head -20 | tee -a $S
(cd $OUT && tar czf r8.tgz r8)
