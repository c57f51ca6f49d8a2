# Session 60, call 5 (any card): branch s60-mbar-ring2 (c60d.tar.xz: bench, gpu_kernels; history 207 v2: warps
# request k-tile it + S - 1 after k-tile it's math, the loop chosen block-uniformly) against main b7a77f2a
# (c59h.tar.xz; the same kernels as the branch's base): gpu_kernels, then two interleaved rounds of
# bench --random-layers 40 --lengths 256,1024,4096 --batch 16,32,64.
set -u
R=$PWD; S=$OUT/summary.txt; mkdir -p /tmp/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf $R/c60d.tar.xz -C /tmp/x && tar xJf $R/c59h.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
mv /tmp/x/g59h/main /tmp/x/g60d/main
for d in /tmp/x/g60d/*/; do echo "$(basename $d) $(cut -c1-8 $d/REVISION 2>/dev/null)" | tee -a $S; done
PREFILL="256,1024,4096" BATCH="16,32,64" TEST_ONLY="s60-mbar-ring2" timeout 500 bash /tmp/x/g60d/ab-revisions.sh run /tmp/x/g60d $OUT/r6 2>&1 | tee -a $S
(cd $OUT && tar czf r6.tgz r6 && rm -rf r6)
