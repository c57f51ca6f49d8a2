# Session 47's prepared calls, 2 of 3 (see devrun-1.sh for the binaries): the decode step with the fp16
# dense inputs off and from 5 sequences (`bench --decode-f16`), graph loop and served step, batch 1, 4, 5,
# 8, two interleaved rounds (digests: equal at 1 and 4, where the path does not change; at 5 and 8 they may
# differ); then one client served by main (base) and by the merged code (served-graph) in turn, two
# rounds, with the server's debug log (each request's preparation, since_arrival_us); and main's decode
# step at batch 1 and 8 against a090f5cd's (old/), two rounds. The full-shape
# synthetic checkpoint goes into .synth-full/ (git-ignored), kept for call 3 while the machine is warm.
#   run(command="bash scripts/.devrun-2.sh", carry=["binsnext.tar.xz","scripts/.devrun-2.sh"])   ~8 min
set -u
R=$PWD; [ -x /tmp/b/main/bench ] || { mkdir -p /tmp/b && cd /tmp/b && tar xJf $R/binsnext.tar.xz && cd $R; }
O=$OUT/c2; mkdir -p $O; export RUST_BACKTRACE=1; B=/tmp/b/main; M=$R/.synth-full
if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=6 $B/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; else SYN=; fi
for r in 1 2; do for f in off 5; do
  timeout 70 $B/bench --random-layers 40 --lengths 256 --batch 1,4,5,8 --served --decode-f16 $f > $O/bench-f16-$f-$r.json 2>> $O/err.txt || echo "bench $f $r failed"
  grep -h '^{' $O/bench-f16-$f-$r.json | cut -c1-150 | sed "s/^/f16=$f r$r /"
done; done
# The hi/lo kernels before (a090f5cd, old/) and after session 47's change (same opcodes, registers moved).
for r in 1 2; do for v in old main; do
  timeout 50 /tmp/b/$v/bench --random-layers 40 --lengths "" --batch 1,8 > $O/bench-kernels-$v-$r.json 2>> $O/err.txt || echo "bench $v $r failed"
  grep -h '^{' $O/bench-kernels-$v-$r.json | cut -c1-120 | sed "s/^/$v r$r /"
done; done
[ -n "$SYN" ] && wait $SYN; tail -1 $O/synth.log 2>/dev/null
for r in 1 2; do for v in base main; do
  RUST_LOG=lily_server=debug,lily_engine=debug LILY_SERVE_LOG=$O/serve1-$v-$r.log LILY_BIN=/tmp/b/$v/lily BENCH_JSON=$O/serve1-$v-$r.json timeout 70 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1-$v-$r.txt 2>&1 || echo "serve1 $v $r failed"
  echo "$v $r since_arrival_us: $(sed 's/\x1b\[[0-9;]*m//g' $O/serve1-$v-$r.log | grep -a -o 'since_arrival_us=[0-9]*' | cut -d= -f2 | tr '\n' ' ')"
done; done
for j in $O/serve1-*.json; do python3 -c "
import json; j=json.load(open('$j')); print('$(basename $j)', ' | '.join('%d clients: %.1f tok/s, ttft p50 %.1f ms, itl p50 %.3f ms, errors %d' % (p['clients'], p['agg_output_tok_s'], 1000 * p['ttft_s']['p50'], 1000 * p['itl_s']['p50'], p['errors']) for p in j['phases']))" 2>&1; done
