# Session 47's prepared calls, 3 of 3: the merged code serving 8 clients with the fp16 dense inputs off
# and from 5 sequences (LILY_DECODE_F16), two interleaved rounds; one client served by main (base) and by
# the merge (served-graph) in turn, two rounds, with the server's debug log (each request's preparation,
# since_arrival_us); then 64 clients once. The engine's debug log gives the 8-client rounds' gathers
# (history 159) and every 64-client prefill pass (how many, how many prompts and tokens each, their ms:
# where the 64-client round's ~0.4 s of prefill goes). Needs .synth-full/ from call 2 (else ~2 min more).
#   run(command="bash docs/perf/2026-12-05-s47/devrun-3.sh", carry=["c3.tar.xz"])   ~8 min
set -u
R=$PWD; mkdir -p /tmp/b && for t in $R/binsnext.tar.xz $R/c[123].tar.xz; do [ -f $t ] && tar xJf $t -C /tmp/b; done
O=$OUT/c3; mkdir -p $O; export RUST_BACKTRACE=1; B=/tmp/b/main; M=$R/.synth-full
[ -f $M/config.json ] || RAYON_NUM_THREADS=12 $B/lily synth --preset full --out $M > $O/synth.log 2>&1
strip_log() { sed 's/\x1b\[[0-9;]*m//g' "$1"; }
for r in 1 2; do for f in off 5; do
  RUST_LOG=lily_engine=debug LILY_DECODE_F16=$f LILY_SERVE_LOG=$O/serve8-f16-$f-$r.log LILY_BIN=$B/lily BENCH_JSON=$O/serve8-f16-$f-$r.json timeout 80 bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8-f16-$f-$r.txt 2>&1 || echo "serve8 $f $r failed"
  echo "f16=$f r$r gathers: $(strip_log $O/serve8-f16-$f-$r.log | grep -a 'held the first prefill' | grep -a -o 'gathered=[0-9]* expected=[0-9]* waited_us=[0-9]*' | sed 's/gathered=//;s/ expected=/\//;s/ waited_us=/@/' | tr '\n' ' ')"
done; done
for r in 1 2; do for v in base main; do
  RUST_LOG=lily_server=debug,lily_engine=debug LILY_SERVE_LOG=$O/serve1-$v-$r.log LILY_BIN=/tmp/b/$v/lily BENCH_JSON=$O/serve1-$v-$r.json timeout 70 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1-$v-$r.txt 2>&1 || echo "serve1 $v $r failed"
  echo "$v $r since_arrival_us: $(sed 's/\x1b\[[0-9;]*m//g' $O/serve1-$v-$r.log | grep -a -o 'since_arrival_us=[0-9]*' | cut -d= -f2 | tr '\n' ' ')"
done; done
RUST_LOG=lily_engine=debug LILY_SERVE_LOG=$O/serve64.log LILY_BIN=$B/lily BENCH_JSON=$O/serve64.json timeout 120 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64.txt 2>&1 || echo "serve64 failed"
strip_log $O/serve64.log | grep -a 'prefill pass' | grep -a -o 'parts=[0-9]* tokens=[0-9]* ms=[0-9.]*' > $O/serve64-passes.txt
echo "64-client passes: $(wc -l < $O/serve64-passes.txt), parts/tokens/ms: $(awk -F'[= ]' '{p+=$2; t+=$4; m+=$6} END {printf "%d / %d / %.0f", p, t, m}' $O/serve64-passes.txt)"
head -20 $O/serve64-passes.txt | tr '\n' ' '; echo
for j in $O/serve8-*.json $O/serve1-*.json $O/serve64.json; do python3 -c "
import json; j=json.load(open('$j')); print('$(basename $j)', ' | '.join('%d clients: %.1f tok/s, ttft p50 %.1f ms, itl p50 %.3f ms, errors %d' % (p['clients'], p['agg_output_tok_s'], 1000 * p['ttft_s']['p50'], 1000 * p['itl_s']['p50'], p['errors']) for p in j['phases']))" 2>&1; done
