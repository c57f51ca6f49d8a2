# Session 56, call 1 (any card, ~8 min). Carries c55a.tar.xz (g55/main: main 9673c2f9's lily, bench, qmm_probe; its
# kernels are main's) and c56a.tar.xz (g56/s56-moe-tma: the branch's bench, lily, qmm_probe, gpu_qmm, gpu_model):
#   run(command="bash docs/perf/2026-12-06-s56/devrun-1.sh", carry=["c55a.tar.xz", "c56a.tar.xz"])
# 1. qmm_probe of the branch at 1 / 8 / 64 tokens: the experts on cp.async (16) and on bulk copies (variant 0),
#    each also with no math (17, 2).
# 2. gpu_qmm of the branch (LILY_REQUIRE_GPU=1): the bulk-copy experts against the cp.async ones bit for bit, and
#    against lily-cpu's reference.
# 3. main against the branch: ms a step at 1 / 8 / 64 tokens (bench --random-layers 40), two interleaved rounds.
# 4. The stream probe (crates/cuda/scripts/probes/expert_stream.cu), then gpu_model of the branch, as time allows.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r1; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c55a.tar.xz -C /tmp/g && tar xJf $R/c56a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
M=/tmp/g/g55/main; B=/tmp/g/g56/s56-moe-tma
echo "main $(cut -c1-8 $M/REVISION), branch $(cut -c1-8 $B/REVISION)" | tee -a $S
export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
# The probe first, the cp.async variants before the bulk-copy ones, so that a bulk-copy kernel that never
# completes (an mbarrier phase that never arrives) costs only this step's timeout and leaves the baseline lines.
timeout 220 $B/qmm_probe 1,8,64 16,17,0,2 > $O/qmm-probe.txt 2>&1; echo "qmm_probe rc $? at ${SECONDS}s" | tee -a $S
grep -E "copy|moe" $O/qmm-probe.txt >> $S
TMA_OK=0; grep -q "^default, no math .*n=64 .*moe:" $O/qmm-probe.txt && TMA_OK=1
if [ $TMA_OK = 1 ]; then
  timeout 200 $B/gpu_qmm --test-threads=2 > $O/gpu_qmm.log 2>&1; echo "gpu_qmm rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_qmm.log | tail -1)" | tee -a $S
  grep -E "^test |panicked|FAIL" $O/gpu_qmm.log | head -20 >> $S
else
  echo "the bulk-copy probe lines are missing: gpu_qmm and the branch's steps skipped" | tee -a $S
fi
for r in 1 2; do
  for n in main branch; do
    D=$M; [ $n = branch ] && D=$B
    [ $n = branch ] && [ $TMA_OK = 0 ] && continue
    timeout 90 $D/bench --random-layers 40 --lengths "" --batch 1,8,64 > $O/$n-round$r.json 2> $O/$n-round$r.err; echo "bench $n round $r rc $? at ${SECONDS}s" | tee -a $S
  done
done
python3 - $O >> $S <<'PY'
import json, sys
o = sys.argv[1]
for n in ("main", "branch"):
    for r in (1, 2):
        try:
            rows = [json.loads(l) for l in open(f"{o}/{n}-round{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        print(n, r, " ".join(f"{x['batch']}: {x['step_ms']:.3f} ms {x['seq0_digest'][:8]}" for x in rows if "batch" in x))
PY
if [ $SECONDS -lt 420 ]; then
  nvcc -O3 -arch=sm_90a -o /tmp/expert_stream crates/cuda/scripts/probes/expert_stream.cu > $O/expert-stream.txt 2>&1 && timeout 45 /tmp/expert_stream >> $O/expert-stream.txt 2>&1; echo "expert_stream rc $? at ${SECONDS}s" | tee -a $S
  cat $O/expert-stream.txt >> $S
fi
if [ $SECONDS -lt 440 ]; then
  timeout $((570 - SECONDS)) $B/gpu_model --test-threads=2 > $O/gpu_model.log 2>&1; echo "gpu_model rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_model.log | tail -1)" | tee -a $S
fi
(cd $OUT && tar czf r1.tgz r1)
