# Session 55, call 3 (an H200 only; on another card it stops at once; ~6 min): main's ten-length `lily bench`
# (the contract JSON of issues 11 and 12, median of 2 rounds; the last on an H200 is session 41's). Carries c55a.tar.xz:
#   run(command="bash docs/perf/2026-12-06-s55/devrun-3.sh", carry=["c55a.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r3; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
case "$GPU" in *H200*) ;; *) echo "not an H200: nothing run" | tee -a $S; exit 0;; esac
tar xJf $R/c55a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
G=/tmp/g/g55/main; CK=/tmp/lily-full; echo "main $(cut -c1-8 $G/REVISION)" | tee -a $S
RAYON_NUM_THREADS=16 $G/lily synth --preset full --out $CK > $O/synth.log 2>&1; tail -1 $O/synth.log | tee -a $S
timeout $((590 - SECONDS)) $G/lily bench --model $CK --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r3.tgz r3)
