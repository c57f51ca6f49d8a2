# Session 56, call 4 (any card, ~2 min). Carries c56b.tar.xz (g56b/tma: qmm_probe of s56-moe-tma with variant 17):
#   run(command="bash docs/perf/2026-12-06-s56/devrun-3.sh", carry=["c56b.tar.xz"])
# The experts at 1 / 8 / 64 tokens on cp.async (variant 15), on bulk copies (0), on bulk copies without the proxy
# fence before each stage's request (17), polling its mbarriers with test_wait (18), and cp.async again (15).
set -u
S=$OUT/summary.txt; mkdir -p /tmp/g
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf c56b.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
echo "qmm_probe of $(cut -c1-8 /tmp/g/g56b/tma/REVISION)" | tee -a $S
timeout 200 /tmp/g/g56b/tma/qmm_probe 1,8,64 15,0,17,18,15 > $OUT/qmm-probe.txt 2>&1; echo "qmm_probe rc $? at ${SECONDS}s" | tee -a $S
grep -E "copy|moe" $OUT/qmm-probe.txt | tee -a $S
# On an H200 also the stream probe (history 194's question there) and the same experts with no math (16).
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H200*)
  nvcc -O3 -arch=sm_90a -o /tmp/expert_stream crates/cuda/scripts/probes/expert_stream.cu > $OUT/expert-stream.txt 2>&1 && timeout 60 /tmp/expert_stream >> $OUT/expert-stream.txt 2>&1; echo "expert_stream rc $? at ${SECONDS}s" | tee -a $S
  cat $OUT/expert-stream.txt >> $S
  timeout 120 /tmp/g/g56b/tma/qmm_probe 64 16,2 > $OUT/qmm-probe-nomath.txt 2>&1; echo "qmm_probe no math rc $? at ${SECONDS}s" | tee -a $S
  grep -E "moe" $OUT/qmm-probe-nomath.txt | tee -a $S;;
esac
