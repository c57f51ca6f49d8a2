# Session 52, call 9: on any card, qmm_probe's K-slice variants at 1 / 8 / 64 tokens (default, slices of 512
# and 256 columns: more warps a task); on an H200 also call 8's work (the stage-math probe and main's contract).
#   run(command="bash docs/perf/2026-12-05-s52/devrun-9.sh", carry=["c20.tar.xz", "c52a.tar.xz"], kind="nvidia-h200")
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); S=$OUT/summary.txt; echo "$GPU" | tee -a $S
R=$PWD; mkdir -p /tmp/c52a && tar xJf $R/c52a.tar.xz -C /tmp/c52a
O=$OUT/r9; mkdir -p $O
timeout 150 /tmp/c52a/p52/qmm_probe 1,8,64 0,3,4 > $O/qmm-probe-kslices.txt 2>&1; grep -E "in_proj  |out_proj  |moe:" $O/qmm-probe-kslices.txt | tee -a $S
(cd $OUT && tar czf r9.tgz r9)
case "$GPU" in *H200*) bash docs/perf/2026-12-05-s52/devrun-8.sh;; esac
