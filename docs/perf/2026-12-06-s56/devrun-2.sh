# Not to run as it stands: history 195 was slower on the H100 and not merged; this A/B is for the patch
# (docs/perf/2026-12-06-s56/moe-tma.patch) re-applied after devrun-3 finds what the bulk-copy kernels lose.
# Session 56, call 2 (~6 min; an H200 for the numbers issue 10 asks for, any card for the A/B). Carries c55a.tar.xz
# (g55/main: main's lily) and c56a.tar.xz (g56/s56-moe-tma: the branch's lily):
#   run(command="bash docs/perf/2026-12-06-s56/devrun-2.sh", carry=["c55a.tar.xz", "c56a.tar.xz"])
# 64 clients served (scripts/bench-serve.sh: 2 requests of 128 tokens each, ~256-token prompts, thinking on, the
# checkpoint's sampling defaults) by main and by the branch, two interleaved rounds, on a full-shape synthetic
# checkpoint written first (lily synth --preset full).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r2; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c55a.tar.xz -C /tmp/g && tar xJf $R/c56a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
M=/tmp/g/g55/main; B=/tmp/g/g56/s56-moe-tma; CK=/tmp/lily-full
echo "main $(cut -c1-8 $M/REVISION), branch $(cut -c1-8 $B/REVISION)" | tee -a $S
RAYON_NUM_THREADS=16 $M/lily synth --preset full --out $CK > $O/synth.log 2>&1; echo "synth rc $? at ${SECONDS}s" | tee -a $S
for r in 1 2; do
  for n in main branch; do
    D=$M; [ $n = branch ] && D=$B
    [ $SECONDS -lt 480 ] || { echo "out of time before $n round $r" | tee -a $S; continue; }
    LILY_BIN=$D/lily BENCH_JSON=$O/$n-serve64-r$r.json timeout 150 bash scripts/bench-serve.sh $CK 64 2 128 > $O/$n-serve64-r$r.txt 2>&1
    echo "$n round $r rc $? at ${SECONDS}s: $(python3 -c "import json,sys; p=json.load(open('$O/$n-serve64-r$r.json'))['phases'][0]; print(round(p['agg_output_tok_s'],1), 'tok/s, TTFT p50', round(p['ttft_s']['p50']*1e3), 'ms, errors', p.get('errors'))" 2>&1)" | tee -a $S
  done
done
(cd $OUT && tar czf r2.tgz r2)
