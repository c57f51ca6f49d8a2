# Session 59, call 8 (any card; ~1.5 min). Carries c59g.tar.xz (g59g: a3d59beb's bench (history 204 as merged) and
# main 2344c14e's (the cap's exception narrowed to the 4-bit 64-row tiles: a 33-64-token prompt's 8-bit router +
# gate now splits in 8, not 16)).
#   run(command="bash docs/perf/2026-12-06-s59/devrun-8.sh", carry=["c59g.tar.xz"])
# Prefill tok/s at 40 / 64 / 256 tokens and steps at 8 / 64 sequences, two interleaved rounds: only the short
# prompts' digests and speed may differ.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r8; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c59g.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g59g; V="a3d59beb main"
for v in $V; do echo "$v $(cut -c1-8 $G/$v/REVISION 2>/dev/null)" | tee -a $S; done
for r in 1 2; do
  for v in $V; do
    timeout 100 $G/$v/bench --random-layers 40 --lengths 40,64,256 --batch 8,64 > $O/bench-$v-r$r.json 2> $O/bench-$v-r$r.err; echo "bench $v round $r rc $? at ${SECONDS}s" >> $S
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
        print(f"{v:9s} r{r} {steps} | {pre}")
PY
tail -4 $S
tar cJf $OUT/r8.tar.xz -C $OUT r8 && rm -rf $O
