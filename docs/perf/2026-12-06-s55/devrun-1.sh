# Session 55, call 1 (any card, ~5 min): session 54's two waiting calls in one.
# (a) on an H200 only, qmm_probe's stage-math parts at 1 / 8 / 64 tokens with main's build (history 184's question: on the H100 the
#     64-token experts stream at 86% of the card's copy rate with no math at all; on the H200 they run at ~2.4 TB/s
#     of 4.3 with it, so this card's "no math" row says whether the math or the stream's structure holds them),
#     plus rings of 2 (variant 5) for the stream's sensitivity to bytes in flight;
# (b) history 192 (branch s54-split-entries) against main through ab-revisions.sh run (its gpu_kernels and gpu_model
#     with LILY_REQUIRE_GPU=1, steps at 16 / 32 / 64 / 128 tokens, prefills of 256 and 1,024, two interleaved rounds).
# Carries c54d.tar.xz (g54/main/{lily,qmm_probe}) and c54e.tar.xz (g54/main/bench, g54/se/*), git-ignored:
#   run(command="bash docs/perf/2026-12-06-s55/devrun-1.sh", carry=["c54d.tar.xz","c54e.tar.xz"])
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r1; mkdir -p $O /tmp/g
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $S
tar xJf $R/c54d.tar.xz -C /tmp/g && tar xJf $R/c54e.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
echo "main $(cut -c1-8 /tmp/g/g54/main/REVISION), se $(cut -c1-8 /tmp/g/g54/se/REVISION)" | tee -a $S
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H200*) timeout 150 /tmp/g/g54/main/qmm_probe 1,8,64 0,2,5,11,12,13,14 > $O/qmm-probe-parts.txt 2>&1; echo "qmm_probe rc $?" | tee -a $S
cat $O/qmm-probe-parts.txt >> $S;;
  *) echo "not an H200: parts probe skipped (the H100 numbers are history 184)" | tee -a $S;; esac
(cd $OUT && tar czf r1.tgz r1)
BATCH=16,32,64,128 PREFILL=256,1024 timeout 400 bash crates/cuda/scripts/ab-revisions.sh run /tmp/g/g54 $O/ab 2>&1 | tail -60 | tee -a $S
(cd $OUT && tar czf r1.tgz r1)
