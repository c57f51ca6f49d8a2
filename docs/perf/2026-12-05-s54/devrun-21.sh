# Session 54, call 4 (an H200 only; on another card it stops at once): main's contract (`lily bench`, ten lengths,
# median of 2 rounds: the JSON issues 11 and 12 ask for; the last on record on an H200 is session 41's) and qmm_probe's
# stage-math parts at 1 / 8 / 64 tokens (history 184's question on this card). Carries c54d.tar.xz (git-ignored):
#   g54/main/{lily,qmm_probe,REVISION}   main 648ed673 (its kernels: 1d1802c9's)
#   run(command="bash docs/perf/2026-12-05-s54/devrun-21.sh", carry=["c54d.tar.xz"], kind="nvidia-h200")
set -u
O=$OUT/r21; mkdir -p $O; S=$OUT/summary.txt
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee -a $S
case "$GPU" in *H200*) ;; *) echo "not an H200: nothing run" | tee -a $S; exit 0;; esac
R=$PWD; mkdir -p /tmp/c54d; tar xJf $R/c54d.tar.xz -C /tmp/c54d || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/c54d/g54/main; CK=/tmp/lily-full
echo "main $(cut -c1-8 $G/REVISION)" | tee -a $S
RAYON_NUM_THREADS=14 $G/lily synth --preset full --out $CK > $O/synth.log 2>&1 &
timeout 60 $G/qmm_probe 1,8,64 0,2,11,12,13,14 > $O/qmm-probe-parts.txt 2>&1; grep -E "device copy|in_proj  |moe:" $O/qmm-probe-parts.txt | tee -a $S
(cd $OUT && tar czf r21.tgz r21)
wait; tail -1 $O/synth.log | tee -a $S
timeout 330 $G/lily bench --model $CK --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r21.tgz r21)
