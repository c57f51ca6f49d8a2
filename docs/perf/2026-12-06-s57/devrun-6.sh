# Session 57, call 7 (any card, ~1 min). Carries c57d.tar.xz (g57/b5: bench of main 1cef0f67 and of the same with the
# 16-row GEMM tiles' ring 6 and 7 k-tiles deep, TILE_WSTAGES[0]; 4 on main):
#   run(command="bash docs/perf/2026-12-06-s57/devrun-6.sh", carry=["c57d.tar.xz"])
# Since the 16-row 4-bit tiles lost their fp16 W tile (DIRECT), a block's ring is 34 KB and four blocks an SM leave
# ~90 KB unused: deeper rings keep more weights in flight at the same four blocks. Prefill at 128 / 256 / 320 tokens
# (the passes on 16-row expert tiles), three interleaved rounds.
set -u
S=$OUT/summary.txt; O=$OUT/r7; mkdir -p $O /tmp/g
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf c57d.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g57/b5
for r in 1 2 3; do
  for v in main s6 s7; do
    timeout 100 $B/bench-$v --random-layers 40 --lengths 128,256,320 --steps 4 > $O/$v-round$r.json 2> $O/$v-round$r.err; echo "bench $v round $r rc $? at ${SECONDS}s" | tee -a $S
  done
done
python3 - $O >> $S <<'PY'
import json, sys
o = sys.argv[1]
for r in (1, 2, 3):
    for v in ("main", "s6", "s7"):
        try:
            rows = [json.loads(l) for l in open(f"{o}/{v}-round{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        print(v, r, " ".join(f"{x['prompt_tokens']}: {x['prefill_tok_s']:.0f} tok/s {x['digest'][:8]}" for x in rows if "prompt_tokens" in x))
PY
tail -9 $S
(cd $OUT && tar czf r7.tgz r7)
