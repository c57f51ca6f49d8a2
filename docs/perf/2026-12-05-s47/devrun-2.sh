# Session 47's prepared calls, 2 of 3 (see devrun-1.sh for the binaries): the decode step with the fp16
# dense inputs off and from 5 sequences (`bench --decode-f16`), graph loop and served step, batch 1, 4, 5,
# 8, two interleaved rounds (digests: equal at 1 and 4, where the path does not change; at 5 and 8 they may
# differ); at 12 and 16 the GEMM path (default) against qmm on two fp16 n-tiles; and main's decode
# step at batch 1 and 8 against a090f5cd's (old/), two rounds. The full-shape synthetic checkpoint goes
# into .synth-full/ (git-ignored) meanwhile, kept for call 3 while the machine is warm.
#   run(command="bash docs/perf/2026-12-05-s47/devrun-2.sh", carry=["c2.tar.xz"])   ~7 min
set -u
R=$PWD; mkdir -p /tmp/b && for t in $R/binsnext.tar.xz $R/c[123].tar.xz; do [ -f $t ] && tar xJf $t -C /tmp/b; done
O=$OUT/c2; mkdir -p $O; export RUST_BACKTRACE=1; B=/tmp/b/main; M=$R/.synth-full
if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=6 $B/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; else SYN=; fi
for r in 1 2; do for f in off 5; do
  timeout 70 $B/bench --random-layers 40 --lengths 256 --batch 1,4,5,8 --served --decode-f16 $f > $O/bench-f16-$f-$r.json 2>> $O/err.txt || echo "bench $f $r failed"
  grep -h '^{' $O/bench-f16-$f-$r.json | cut -c1-150 | sed "s/^/f16=$f r$r /"
done; done
# 9-16 sequences: the GEMM path (default) against qmm on two fp16 n-tiles (--decode-gemm 17 --decode-f16 5).
for r in 1 2; do for a in "gemm:" "qmmf16:--decode-gemm 17 --decode-f16 5"; do
  timeout 50 $B/bench --random-layers 40 --lengths "" --batch 12,16 ${a#*:} > $O/bench-916-${a%%:*}-$r.json 2>> $O/err.txt || echo "bench 9-16 ${a%%:*} $r failed"
  grep -h '^{' $O/bench-916-${a%%:*}-$r.json | cut -c1-120 | sed "s/^/${a%%:*} r$r /"
done; done
# The hi/lo kernels before (a090f5cd, old/) and after session 47's change (same opcodes, registers moved).
for r in 1 2; do for v in old main; do
  timeout 50 /tmp/b/$v/bench --random-layers 40 --lengths "" --batch 1,8 > $O/bench-kernels-$v-$r.json 2>> $O/err.txt || echo "bench $v $r failed"
  grep -h '^{' $O/bench-kernels-$v-$r.json | cut -c1-120 | sed "s/^/$v r$r /"
done; done
[ -n "$SYN" ] && wait $SYN; tail -1 $O/synth.log 2>/dev/null
