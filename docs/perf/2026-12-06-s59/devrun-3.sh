# Session 59, call 3 (any card; ~3 min). Carries c59c.tar.xz (g59c: main d938678b's bench; s59-plan-fill: plan_dense
# splits short launches for the height's resident blocks an SM (4 at 16 rows, 3 at 32) instead of 2; s59-bm64-occ3:
# that and the 64-row tiles at 3 blocks an SM (80 registers, one 8-byte spill: a probe)):
#   run(command="bash docs/perf/2026-12-06-s59/devrun-3.sh", carry=["c59c.tar.xz"])
# Why: Nsight Compute (call 2) has the 64-token dense tiles latency-bound at 2 blocks an SM (0.65 eligible warps a
# scheduler, DRAM 22%, L2 40%); the planner assumed 2 blocks an SM at every height.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r3; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c59c.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g59c; V="main s59-plan-fill s59-bm64-occ3"
for v in $V; do echo "$v $(cut -c1-8 $G/$v/REVISION 2>/dev/null)" | tee -a $S; done
export RUST_BACKTRACE=1
LILY_REQUIRE_GPU=1 timeout 150 $G/s59-plan-fill/gpu_kernels > $O/gpu_kernels.log 2>&1; echo "gpu_kernels (plan-fill) rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_kernels.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL" $O/gpu_kernels.log | head -10 | tee -a $S
for r in 1 2; do
  for v in $V; do
    timeout 100 $G/$v/bench --random-layers 40 --lengths 64,256 --batch 1,8,16,24,32,48,64,128 > $O/bench-$v-r$r.json 2> $O/bench-$v-r$r.err; echo "bench $v round $r rc $? at ${SECONDS}s" >> $S
  done
done
python3 - $O "$V" >> $S <<'PY'
import json, sys
o, vs = sys.argv[1], sys.argv[2].split()
for r in (1, 2):
    for v in vs:
        try:
            rows = [json.loads(l) for l in open(f"{o}/bench-{v}-r{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        steps = " ".join(f"{x['batch']}: {x['step_ms']:.3f} {x.get('seq0_digest', '')[:8]}" for x in rows if "batch" in x)
        pre = " ".join(f"{x['prompt_tokens']}: {x['prefill_tok_s']:.0f} {str(x.get('digest', ''))[:8]}" for x in rows if "prompt_tokens" in x)
        print(f"{v:16s} r{r} {steps} | {pre}")
PY
tail -6 $S
tar cJf $OUT/r3.tar.xz -C $OUT r3 && rm -rf $O
