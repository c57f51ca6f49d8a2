# Session 60, call 2 (any card): branches s60-mbar-ring (bench, gpu_kernels, gpu_model) and s60-lean-fold (bench, gpu_qmm), c60b.tar.xz, against main
# (c59h.tar.xz: g59h/main, b7a77f2a = main's kernels): the branch's suites, then two interleaved rounds of
# bench --random-layers 40 --lengths 256,1024,2048,4096 --batch 1,8,16,32,64,128 (crates/cuda/scripts/ab-revisions.sh).
set -u
R=$PWD; S=$OUT/summary.txt; mkdir -p /tmp/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf $R/c60b.tar.xz -C /tmp/x && tar xJf $R/c59h.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
mv /tmp/x/g59h/main /tmp/x/g60/main
for d in /tmp/x/g60/*/; do echo "$(basename $d) $(cut -c1-8 $d/REVISION 2>/dev/null)" | tee -a $S; done
PREFILL="256,1024,2048,4096" BATCH="1,8,16,32,64,128" TEST_ONLY="s60-mbar-ring s60-lean-fold" timeout 560 bash /tmp/x/g60/ab-revisions.sh run /tmp/x/g60 $OUT/r2 2>&1 | tee -a $S
(cd $OUT && tar czf r2.tgz r2 && rm -rf r2)
