# Session 59, call 4 (any card; ~2 min). Carries c59d.tar.xz (g59d/s59-splitk-cap: main + a probe-only env var,
# LILY_SPLITK_MAX, capping plan_dense's K splits).
#   run(command="bash docs/perf/2026-12-06-s59/devrun-4.sh", carry=["c59d.tar.xz"])
# Why: at 64 decode tokens the out-projection (16 W tiles, K = 4,096) runs 16 splits and its reduction reads 16
# partial planes (8.4 MB) for a 0.5 MB output; the in-projection 2. ms a step and prefill tok/s at caps of 2, 4, 8
# against none, two interleaved rounds (digests change with the split count: another summation order).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r4; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c59d.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g59d/s59-splitk-cap; echo "probe $(cut -c1-8 $B/REVISION)" | tee -a $S
for r in 1 2; do
  for c in none 8 4 2; do
    if [ $c = none ]; then unset LILY_SPLITK_MAX; else export LILY_SPLITK_MAX=$c; fi
    timeout 100 $B/bench --random-layers 40 --lengths 256 --batch 16,32,64,128 > $O/bench-$c-r$r.json 2> $O/bench-$c-r$r.err; echo "bench cap $c round $r rc $? at ${SECONDS}s" >> $S
  done
done
unset LILY_SPLITK_MAX
python3 - $O >> $S <<'PY'
import json, sys
o = sys.argv[1]
for r in (1, 2):
    for v in ("none", "8", "4", "2"):
        try:
            rows = [json.loads(l) for l in open(f"{o}/bench-{v}-r{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        steps = " ".join(f"{x['batch']}: {x['step_ms']:.3f}" for x in rows if "batch" in x)
        pre = " ".join(f"{x['prompt_tokens']}: {x['prefill_tok_s']:.0f}" for x in rows if "prompt_tokens" in x)
        print(f"cap {v:5s} r{r} {steps} | {pre}")
PY
tail -8 $S
tar cJf $OUT/r4.tar.xz -C $OUT r4 && rm -rf $O
