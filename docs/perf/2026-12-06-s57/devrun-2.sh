# Session 57, calls 2-4 (any card, ~8 min): one build of branch s57-grouped-qmm (bench, gpu_kernels, gpu_model) from
# a tarball. Call 2: c57a.tar.xz, g57/b1 (6609b30e), results in r2:
#   run(command="bash docs/perf/2026-12-06-s57/devrun-2.sh", carry=["c57a.tar.xz"])
# Calls 3 and 4 run this script through devrun-3.sh and devrun-4.sh with their tarball, build and results named:
#   devrun-2.sh TARBALL BUILD RUN [MODEL]   (MODEL 0: gpu_model left out)
# 1. gpu_kernels' grouped MoE test (LILY_REQUIRE_GPU=1): the short passes' experts on qmm (grouped::experts) against
#    the f64 reference, beside the gemm path, at 5 / 64 / 300 tokens (production) and 5 (tiny).
# 2. Prefill A/B in one binary: --short-experts gemm (main's path) against qmm at 128 / 256 / 320 tokens, 40 random
#    layers, three interleaved rounds.
# 3. gpu_model's full-width test (the option against lily-cpu, and the bits repeating), as time allows.
# 4. A CUPTI timeline of the 256-token prefill on each path, as time allows.
set -u
TAR=${1:-c57a.tar.xz}; BUILD=${2:-g57/b1}; RUN=${3:-r2}; MODEL=${4:-1}
R=$PWD; S=$OUT/summary.txt; O=$OUT/$RUN; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/$TAR -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/$BUILD; echo "branch $(cut -c1-8 $B/REVISION)" | tee -a $S
export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
timeout 150 $B/gpu_kernels grouped_moe_gemm_path_matches_reference > $O/gpu_kernels.log 2>&1; echo "gpu_kernels grouped rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_kernels.log | tail -1)" | tee -a $S
grep -E "panicked|FAIL|relative|error" $O/gpu_kernels.log | head -20 >> $S
for r in 1 2 3; do
  for p in gemm qmm; do
    timeout 100 $B/bench --random-layers 40 --lengths 128,256,320 --steps 4 --short-experts $p > $O/$p-round$r.json 2> $O/$p-round$r.err; echo "bench $p round $r rc $? at ${SECONDS}s" | tee -a $S
  done
done
python3 - $O >> $S <<'PY'
import json, sys
o = sys.argv[1]
for r in (1, 2, 3):
    for p in ("gemm", "qmm"):
        try:
            rows = [json.loads(l) for l in open(f"{o}/{p}-round{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        print(p, r, " ".join(f"{x['prompt_tokens']}: {x['prefill_tok_s']:.0f} tok/s {x['first_token']} {x['digest'][:8]}" for x in rows if "prompt_tokens" in x))
PY
cat $S | tail -7
if [ $MODEL = 1 ] && [ $SECONDS -lt 330 ]; then
  timeout $((480 - SECONDS)) $B/gpu_model full_width_four_layer_model_matches_lily_cpu > $O/gpu_model.log 2>&1; echo "gpu_model full width rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_model.log | tail -1)" | tee -a $S
  grep -E "panicked|FAIL|qmm" $O/gpu_model.log | head -20 >> $S
fi
for p in qmm gemm; do
  if [ $SECONDS -lt 520 ]; then
    timeout $((585 - SECONDS)) $B/bench --random-layers 40 --lengths 256 --steps 2 --short-experts $p --timeline > $O/tl-$p.jsonl 2> $O/tl-$p.err; echo "timeline $p rc $? at ${SECONDS}s" | tee -a $S
    grep -A30 "prefill of 256 tokens: span" $O/tl-$p.err | head -24 >> $S
  fi
done
(cd $OUT && tar czf $RUN.tgz $RUN)
