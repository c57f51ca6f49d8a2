# For the next lease (an H200 for the question; ~1.5 min). Carries c58d.tar.xz (g58d/main: main's qmm_probe with the
# MoE rows on both precisions and variant 16, the fp16 fold as two fused steps an output):
#   run(command="bash docs/perf/2026-12-06-s58/devrun-6.sh", carry=["c58d.tar.xz"])
# Call 7's probe (devrun-5.sh, which ran on an H100) on the card it was meant for, plus variant 16: the experts alone at
# 8 / 64 / 128 tokens, both precisions, in variants 0 (default), 2 (no math), 11 (no x loads), 12 (no
# dequantisation), 13 (no fold: hi/lo only), 15 (one warp a task at K = 2,048), 16 (QMM_PROBE_F16_LEAN_FOLD: the f16
# rows only). The H200's question: how much of the fp16 experts' time is still arithmetic, which part, and whether the
# leaner fold shows (session 58 call 6: hi/lo gate/up 104.9 us with its arithmetic, 74.2 without, at 64 tokens).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r6; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c58d.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g58d/main; echo "main $(cut -c1-8 $G/REVISION)" | tee -a $S
timeout 280 $G/qmm_probe 8,64,128 0,2,11,12,13,15,16 > $O/qmm-probe.txt 2>&1; echo "qmm_probe rc $? at ${SECONDS}s" | tee -a $S
grep -E "copy|moe" $O/qmm-probe.txt | tee -a $S
