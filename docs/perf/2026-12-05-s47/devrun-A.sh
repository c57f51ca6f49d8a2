# Session 47's first call when the device came back late in the session (two calls instead of devrun-1..3):
# the merged code's suites (LILY_REQUIRE_GPU=1), then the decode step with the fp16 dense inputs off and from
# 5 sequences (graph loop and served step at 1, 5 and 8, with the contract's decode at 256), while the
# full-shape synthetic checkpoint is written into .synth-full/ for the second call. cA.tar.xz: main/{gpu_qmm,
# gpu_model,gpu_runahead,gpu_sampling,bench,lily} of served-graph-next (devrun-1.sh's header).
#   run(command="bash docs/perf/2026-12-05-s47/devrun-A.sh", carry=["cA.tar.xz"])
set -u
R=$PWD; mkdir -p /tmp/b && tar xJf $R/cA.tar.xz -C /tmp/b; O=$OUT/A; mkdir -p $O
export RUST_BACKTRACE=1; B=/tmp/b/main; M=$R/.synth-full
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader > $O/gpu.txt; cat $O/gpu.txt
if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=6 nice -n 19 $B/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; else SYN=; fi
for s in gpu_qmm gpu_model gpu_runahead gpu_sampling; do
  LILY_REQUIRE_GPU=1 timeout 150 $B/$s --test-threads=2 --nocapture > $O/$s.log 2>&1
  echo "$s rc $?: $(grep -a 'test result' $O/$s.log)"
done
grep -h -a 'fp16\|qmm on fp16\|GEMM decode path: batch\|FAILED\|panicked' $O/gpu_qmm.log $O/gpu_model.log | cut -c1-200 | head -24
for f in off 5; do
  timeout 70 $B/bench --random-layers 40 --lengths 256 --batch 1,5,8 --served --decode-f16 $f > $O/bench-f16-$f.json 2>> $O/err.txt || echo "bench $f failed"
  grep -h '^{' $O/bench-f16-$f.json | cut -c1-150 | sed "s/^/f16=$f /"
done
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log; }
