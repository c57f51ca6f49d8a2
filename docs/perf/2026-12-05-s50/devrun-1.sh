# Session 50's first call (c10.tar.xz: main/{bench,lily} = main 9b21b0da; s50/{bench,lily,gpu_kernels,gpu_qmm,gpu_model}
# = branch s50-kernels cc2a62c7: gemm_splitk_reduce 4 columns a thread, moe_router's chunks converted once and
# its tokens staged by cp.async; both bit-identical by construction).
#  1. the full-shape checkpoint written in the background (for call 2's serving);
#  2. s50's GPU suites with LILY_REQUIRE_GPU=1 (gpu_kernels, gpu_qmm, gpu_model);
#  3. bench --random-layers 40 --lengths 256 --batch 1,8,64, main and s50 interleaved, two rounds (digests must agree);
#  4. bench --timeline on s50 at 1, 8, 64 and the 256-token prefill.
#   run(command="bash docs/perf/2026-12-05-s50/devrun-1.sh", carry=["c10.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; rm -rf /tmp/b10; mkdir -p /tmp/b10 && tar xJf $R/c10.tar.xz -C /tmp/b10; B=/tmp/b10
O=$OUT/r1; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee -a $S
SYN=; if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=10 nice -n 19 $B/main/lily synth --preset full --out $M > /tmp/synth.log 2>&1) & SYN=$!; fi
for t in gpu_kernels gpu_qmm gpu_model; do
  LILY_REQUIRE_GPU=1 timeout 170 $B/s50/$t --test-threads=2 > $O/$t.log 2>&1; echo "$t rc $?: $(grep -a 'test result' $O/$t.log)" | tee -a $S
  grep -a 'FAILED\|panicked' $O/$t.log | head -5 | tee -a $S
done
for r in 1 2; do
  for b in main s50; do
    timeout 70 $B/$b/bench --random-layers 40 --lengths 256 --batch 1,8,64 > $O/bench-$b-$r.json 2>> $O/bench-err.txt || echo "bench $b $r failed" | tee -a $S
    grep -h '^{' $O/bench-$b-$r.json | cut -c1-150 | sed "s/^/$b $r /" | tee -a $S
  done
done
L=$(find /usr/local -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3)
LD_LIBRARY_PATH=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')${LD_LIBRARY_PATH:-} timeout 90 $B/s50/bench --random-layers 40 --lengths 256 --batch 1,8,64 --timeline > $O/tl-s50.jsonl 2> $O/tl-s50.err; echo "timeline rc $?" | tee -a $S
grep -a -A16 'timeline of\|prefill of' $O/tl-s50.err | cut -c1-90 >> $S
[ -n "$SYN" ] && { wait $SYN; tail -1 /tmp/synth.log | tee -a $S; }
cd $OUT && tar czf r1.tgz r1 && rm -rf r1
