# Session 59, call 5 (any card; ~4 min). Carries c59e.tar.xz (g59e: main d938678b's bench; s59-splitk-max:
# plan_dense capped at SPLITK_MAX = 8 K splits but at the 64-row wgmma tiles: bench, gpu_kernels, gpu_model).
#   run(command="bash docs/perf/2026-12-06-s59/devrun-5.sh", carry=["c59e.tar.xz"])
# 1. gpu_kernels and gpu_model whole on the branch (LILY_REQUIRE_GPU=1).
# 2. ms a step at 8 / 16 / 24 / 32 / 48 / 64 / 128 sequences and prefill tok/s at 256 / 1,024 / 4,096, main against
#    the branch, two interleaved rounds (digests differ where the split count does: 16-32 tokens' out-projections,
#    the router and shared expert of 256-1,024-token prompts).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r5; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c59e.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g59e; V="main s59-splitk-max"
for v in $V; do echo "$v $(cut -c1-8 $G/$v/REVISION 2>/dev/null)" | tee -a $S; done
export RUST_BACKTRACE=1
B=$G/s59-splitk-max
LILY_REQUIRE_GPU=1 timeout 150 $B/gpu_kernels > $O/gpu_kernels.log 2>&1; echo "gpu_kernels rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_kernels.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL" $O/gpu_kernels.log | head -10 | tee -a $S
for r in 1 2; do
  for v in $V; do
    timeout 120 $G/$v/bench --random-layers 40 --lengths 256,1024,4096 --batch 8,16,24,32,48,64,128 > $O/bench-$v-r$r.json 2> $O/bench-$v-r$r.err; echo "bench $v round $r rc $? at ${SECONDS}s" >> $S
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
        print(f"{v:15s} r{r} {steps} | {pre}")
PY
tail -4 $S
LILY_REQUIRE_GPU=1 timeout 200 $B/gpu_model > $O/gpu_model.log 2>&1; echo "gpu_model rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_model.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL" $O/gpu_model.log | head -10 | tee -a $S
tar cJf $OUT/r5.tar.xz -C $OUT r5 && rm -rf $O
