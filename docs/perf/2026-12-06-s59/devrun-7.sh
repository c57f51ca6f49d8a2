# Session 59, call 7: session 58's waiting H200 question (devrun-6.sh of 2026-12-06-s58: the experts' parts probe on
# both precisions, with the leaner fp16 fold), run only on an H200 (stops at once on another card).
#   run(command="bash docs/perf/2026-12-06-s59/devrun-7.sh", carry=["c58d.tar.xz"], kind="nvidia-h200")
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
case "$GPU" in
  *H200*) bash docs/perf/2026-12-06-s58/devrun-6.sh ;;
  *) echo "$GPU: not an H200, nothing run" | tee $OUT/summary.txt ;;
esac
