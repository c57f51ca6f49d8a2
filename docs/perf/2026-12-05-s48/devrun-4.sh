# Session 48's fourth call (devrun-3.sh's machine was taken back mid-call; ~270 s of device time left):
# bench --random-layers 40 --lengths "" --batch 1,8,64 of main, xp (x-prefetch) and xp2 (x-prefetch-task)
# in two interleaved rounds (equal digests = the same greedy tokens), then xp2's gpu_model
# (LILY_REQUIRE_GPU=1). The summary is written into $OUT as it grows. c3.tar.xz as devrun-3.sh.
#   run(command="bash docs/perf/2026-12-05-s48/devrun-4.sh", carry=["c3.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b3; mkdir -p /tmp/b3 && tar xJf $R/c3.tar.xz -C /tmp/b3; B=/tmp/b3; S=$OUT/summary.txt
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
for r in 1 2; do for v in main xp xp2; do
  timeout 40 $B/$v/bench --random-layers 40 --lengths "" --batch 1,8,64 2>> $OUT/err.txt | grep -h '^{' | cut -c1-130 | sed "s/^/$v $r /" | tee -a $S
done; done
LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1 timeout 100 $B/xp2/gpu_model --test-threads=2 --nocapture > /tmp/gpu_model.log 2>&1; echo "xp2 gpu_model rc $?: $(grep -a 'test result' /tmp/gpu_model.log)" | tee -a $S
grep -a 'FAILED\|panicked\|digest' /tmp/gpu_model.log | head | tee -a $S
gzip -c /tmp/gpu_model.log > $OUT/gpu_model.log.gz
