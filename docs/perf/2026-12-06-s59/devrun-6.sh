# Session 59, call 6 (any card; ~4 min). Carries c59f.tar.xz (g59f: main's kernels after history 204 (a3d59beb,
# bench) and s59-cluster-splitk (split launches of up to 8 splits summed inside a thread-block cluster: bench,
# gpu_kernels, gpu_model)).
#   run(command="bash docs/perf/2026-12-06-s59/devrun-6.sh", carry=["c59f.tar.xz"])
# 1. gpu_kernels whole (the cluster's sums against the reduction launch bit for bit, every height and mode) and
#    gpu_model whole on the branch (LILY_REQUIRE_GPU=1).
# 2. ms a step at 8-128 sequences and prefill tok/s at 256 / 1,024, main against the branch, two interleaved rounds;
#    the digests must be equal (the same bits).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r6; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c59f.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g59f; V="main s59-cluster-splitk"
for v in $V; do echo "$v $(cut -c1-8 $G/$v/REVISION 2>/dev/null)" | tee -a $S; done
export RUST_BACKTRACE=1
B=$G/s59-cluster-splitk
LILY_REQUIRE_GPU=1 timeout 150 $B/gpu_kernels > $O/gpu_kernels.log 2>&1; echo "gpu_kernels rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_kernels.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL|check failed" $O/gpu_kernels.log | head -10 | tee -a $S
for r in 1 2; do
  for v in $V; do
    timeout 120 $G/$v/bench --random-layers 40 --lengths 256,1024 --batch 8,16,24,32,48,64,128 > $O/bench-$v-r$r.json 2> $O/bench-$v-r$r.err; echo "bench $v round $r rc $? at ${SECONDS}s" >> $S
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
        print(f"{v:18s} r{r} {steps} | {pre}")
PY
tail -4 $S
grep -h "rc [^0]" $S | head -5
LILY_REQUIRE_GPU=1 timeout 200 $B/gpu_model > $O/gpu_model.log 2>&1; echo "gpu_model rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_model.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL" $O/gpu_model.log | head -10 | tee -a $S
tar cJf $OUT/r6.tar.xz -C $OUT r6 && rm -rf $O
