# Session 59, call 1 (any card; ~5 min). Carries c59a.tar.xz (g59a: main d938678b, s59-splitk-fixup, s59-wg-pipe:
# bench, gpu_kernels, gpu_model, lily of each):
#   run(command="bash docs/perf/2026-12-06-s59/devrun-1.sh", carry=["c59a.tar.xz"])
# 1. gpu_kernels whole on s59-wg-pipe (the split-K finish in the kernel against the reduction launch bit for bit,
#    every tile height against the reference and each other) and gpu_model's full-width test (LILY_REQUIRE_GPU=1).
# 2. ms a step at 1 / 16 / 32 / 64 / 128 sequences and prefill tok/s at 256 / 1,024 tokens, main against the two
#    branches, two interleaved rounds, with the greedy digests (equal = the same bits, which both changes claim).
# 3. The 64-token step's timeline on s59-wg-pipe (the dense tiles' spans without their reduction launches).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r1; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c59a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g59a; for v in main s59-splitk-fixup s59-wg-pipe; do echo "$v $(cut -c1-8 $G/$v/REVISION 2>/dev/null)" | tee -a $S; done
export RUST_BACKTRACE=1
P=$G/s59-wg-pipe
LILY_REQUIRE_GPU=1 timeout 150 $P/gpu_kernels > $O/gpu_kernels.log 2>&1; echo "gpu_kernels rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_kernels.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL" $O/gpu_kernels.log | head -10 | tee -a $S
for r in 1 2; do
  for v in main s59-splitk-fixup s59-wg-pipe; do
    timeout 100 $G/$v/bench --random-layers 40 --lengths 256,1024 --batch 1,16,32,64,128 > $O/bench-$v-r$r.json 2> $O/bench-$v-r$r.err; echo "bench $v round $r rc $? at ${SECONDS}s" >> $S
  done
done
python3 - $O >> $S <<'PY'
import json, sys
o = sys.argv[1]
for r in (1, 2):
    for v in ("main", "s59-splitk-fixup", "s59-wg-pipe"):
        try:
            rows = [json.loads(l) for l in open(f"{o}/bench-{v}-r{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        steps = " ".join(f"{x['batch']}: {x['step_ms']:.3f} {x.get('seq0_digest', '')[:8]}" for x in rows if "batch" in x)
        pre = " ".join(f"{x['prompt_tokens']}: {x['prefill_tok_s']:.0f} {str(x.get('digest', ''))[:8]}" for x in rows if "prompt_tokens" in x)
        print(f"{v:18s} r{r} {steps} | {pre}")
PY
tail -6 $S
timeout 60 $P/bench --random-layers 40 --lengths "" --batch 64 --timeline > $O/timeline64.jsonl 2> $O/timeline64.err; echo "timeline rc $? at ${SECONDS}s" | tee -a $S
grep -E "gemm_q4|gemm_splitk|qmm_moe|gdn_decode |moe_router|xnorm" $O/timeline64.err | head -12 | tee -a $S
LILY_REQUIRE_GPU=1 timeout 200 $P/gpu_model > $O/gpu_model.log 2>&1; echo "gpu_model rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_model.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL" $O/gpu_model.log | head -10 | tee -a $S
