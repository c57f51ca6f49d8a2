# Session 60, call 3 (any card), c60c.tar.xz: gpu_model of s60-lean-fold (the fp16 fold of history 206 in the
# full-width model's GEMM-path test), then s60-bm16-occ5 (the 16-row GEMM tiles at 5 blocks an SM; gpu_kernels)
# against main (c59h.tar.xz: g59h/main): two interleaved rounds of bench --random-layers 40 --lengths 256,512,1024
# --batch 1,16,32.
set -u
R=$PWD; S=$OUT/summary.txt; mkdir -p /tmp/x $OUT/r3
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf $R/c60c.tar.xz -C /tmp/x && tar xJf $R/c59h.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
timeout 200 /tmp/x/g60c/s60-lean-fold/gpu_model --test-threads=2 > $OUT/r3/lean-gpu_model.log 2>&1; echo "s60-lean-fold gpu_model rc $?: $(grep 'test result' $OUT/r3/lean-gpu_model.log)" | tee -a $S
rm -rf /tmp/x/g60c/s60-lean-fold; mv /tmp/x/g59h/main /tmp/x/g60c/main
for d in /tmp/x/g60c/*/; do echo "$(basename $d) $(cut -c1-8 $d/REVISION 2>/dev/null)" | tee -a $S; done
PREFILL="256,512,1024" BATCH="1,16,32" TEST_ONLY="s60-bm16-occ5" timeout 400 bash /tmp/x/g60c/ab-revisions.sh run /tmp/x/g60c $OUT/r3 2>&1 | tee -a $S
(cd $OUT && tar czf r3.tgz r3 && rm -rf r3)
