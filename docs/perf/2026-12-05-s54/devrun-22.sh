# Session 54, call 5 (any card, ~3 min): history 192, branch s54-split-entries (every GEMM tile height compiled twice,
# unsplit and split-K, so the unsplit epilogue's per-value tests of the partial row fold away; history 191 found
# 188's restructured epilogue -1.1% at 128 tokens and +1.4-1.9% on short prefills, but a clean copy of it spilled).
# The same arithmetic, so every digest must equal main's. Carries c54e.tar.xz (git-ignored; stripped, with REVISIONs):
#   g54/main/bench   main 648ed673        g54/se/{bench,gpu_kernels,gpu_model}   s54-split-entries
#   run(command="bash docs/perf/2026-12-05-s54/devrun-22.sh", carry=["c54e.tar.xz"])
# crates/cuda/scripts/ab-revisions.sh runs it: se's gpu_kernels (split-K against the reference and the reduction, bit
# for bit) and gpu_model with LILY_REQUIRE_GPU=1, then steps at 16 / 32 / 64 / 128 tokens and the 256- and 1,024-token
# prefills, main / se, two interleaved rounds, and prints the tables with each revision's digests.
set -u
R=$PWD; mkdir -p /tmp/c54e
tar xJf $R/c54e.tar.xz -C /tmp/c54e || { echo "tarball missing" | tee $OUT/summary.txt; exit 1; }
O=$OUT/r22; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/summary.txt
BATCH=16,32,64,128 PREFILL=256,1024 bash crates/cuda/scripts/ab-revisions.sh run /tmp/c54e/g54 $O 2>&1 | tee -a $OUT/summary.txt
(cd $OUT && tar czf r22.tgz r22)
