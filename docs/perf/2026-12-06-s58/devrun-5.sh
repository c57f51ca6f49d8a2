# Session 58, call 7 (any card; ~1 min; an H200 for the question). Carries c58c.tar.xz (g58c/main: qmm_probe of main
# with the MoE rows on exact hi/lo x and on fp16 x, `moe f16`):
#   run(command="bash docs/perf/2026-12-06-s58/devrun-5.sh", carry=["c58c.tar.xz"])
# The experts alone at 8 / 64 / 128 tokens, both precisions, in the probe's variants 0 (default), 2 (no math), 11 (no
# x loads), 12 (no dequantisation), 13 (no fold: the hi/lo path only) and 15 (one warp a task at K = 2,048): how much
# of the fp16 experts'
# time is still their arithmetic, and which part (call 6 on the H200: hi/lo gate/up 104.9 us with it, 74.2 without,
# at 64 tokens).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r5; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c58c.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g58c/main; echo "main $(cut -c1-8 $G/REVISION)" | tee -a $S
timeout 250 $G/qmm_probe 8,64,128 0,2,11,12,13,15 > $O/qmm-probe.txt 2>&1; echo "qmm_probe rc $? at ${SECONDS}s" | tee -a $S
grep -E "copy|moe" $O/qmm-probe.txt | tee -a $S
