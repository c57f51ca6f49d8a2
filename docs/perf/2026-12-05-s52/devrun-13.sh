# Session 52, call 13: devrun-12.sh (the s52-xpf0 A/B) on whatever card comes, then on an H200 main's contract
# (`lily bench`, ten lengths) with c20's lily. Results are written as they come (a call cut by the device budget
# still returns them).
#   run(command="bash docs/perf/2026-12-05-s52/devrun-13.sh", carry=["c20.tar.xz", "c52e.tar.xz"])
set -u
R=$PWD; mkdir -p /tmp/c20b/main51 /tmp/c20 && tar xJf $R/c20.tar.xz -C /tmp/c20 && cp /tmp/c20/main51/bench /tmp/c20b/main51/bench
mkdir -p /tmp/c52e && tar xJf $R/c52e.tar.xz -C /tmp/c52e
sed -e 's/^R=\$PWD; for c in c20b c52e.*$/R=$PWD/' docs/perf/2026-12-05-s52/devrun-12.sh > /tmp/devrun-12-local.sh
bash /tmp/devrun-12-local.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); S=$OUT/summary.txt
case "$GPU" in *H200*) ;; *) exit 0;; esac
O=$OUT/r13; mkdir -p $O; M=/tmp/lily-full
RAYON_NUM_THREADS=14 /tmp/c20/main51/lily synth --preset full --out $M > $O/synth.log 2>&1; tail -1 $O/synth.log | tee -a $S
timeout 300 /tmp/c20/main51/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
