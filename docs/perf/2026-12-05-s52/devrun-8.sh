# Session 52, call 8 (H200 only; exits at once on another card): main's contract as the issues define it
# (`lily bench`, ten lengths, median of 2 rounds) and the qmm stage-math probe (which part of the expert and dense
# kernels' time the math holds on the H200, where the experts at 64 tokens stream at ~2.4 TB/s of ~4.3).
# c20.tar.xz: main51/{bench,lily} = main 582a5e2e (its kernels are main's: later commits are docs, probes and a
# SASS-identical mend); c52a.tar.xz: p52/qmm_probe with the QMM_PROBE_NO_{X,DEQ,FOLD} variants (main 01fa5bc7).
#   run(command="bash docs/perf/2026-12-05-s52/devrun-8.sh", carry=["c20.tar.xz", "c52a.tar.xz"], kind="nvidia-h200")
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); S=$OUT/summary.txt; echo "$GPU" | tee -a $S
case "$GPU" in *H200*) ;; *) echo "not an H200: nothing to do" | tee -a $S; exit 0;; esac
R=$PWD; for c in c20 c52a; do mkdir -p /tmp/$c && tar xJf $R/$c.tar.xz -C /tmp/$c; done
O=$OUT/r8; mkdir -p $O; M=/tmp/lily-full; export RUST_BACKTRACE=1
timeout 150 /tmp/c52a/p52/qmm_probe 1,8,64 0,2,11,12,13,14 > $O/qmm-probe-parts.txt 2>&1; grep -E "in_proj  |moe:" $O/qmm-probe-parts.txt | tee -a $S
(cd $OUT && tar czf r8.tgz r8)
[ -f $M/config.json ] || { RAYON_NUM_THREADS=14 /tmp/c20/main51/lily synth --preset full --out $M > $O/synth.log 2>&1; tail -1 $O/synth.log | tee -a $S; }
timeout 330 /tmp/c20/main51/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r8.tgz r8)
