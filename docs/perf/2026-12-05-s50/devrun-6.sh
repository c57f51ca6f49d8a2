# Session 50's closing call, on an H200 only (exits at once on another card). c14.tar.xz: main/bench = main
# 46a742e8 (the code of main 1bbbc3a5: the later commits change comments and docs only).
# The contract lengths on main: bench --random-layers 40 --lengths 256,4096,32768,131072 --batch 1,8,64.
#   run(command="bash docs/perf/2026-12-05-s50/devrun-6.sh", carry=["c14.tar.xz"], kind="nvidia-h200")
set -u
S=$OUT/summary.txt; nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee -a $S
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || exit 0
mkdir -p /tmp/b14 && tar xJf c14.tar.xz -C /tmp/b14
timeout 240 /tmp/b14/main/bench --random-layers 40 --lengths 256,4096,32768,131072 --batch 1,8,64 > $OUT/contract-main.jsonl 2> $OUT/contract-main.err; echo "contract rc $?" | tee -a $S
grep -a '^{' $OUT/contract-main.jsonl | cut -c1-170 | tee -a $S
