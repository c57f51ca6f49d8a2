# Session 47's fourth call: the arrival gather's fix (958eb067: until the first expected follow-up has
# come, only the limit bounds the wait) against main before it (4e56d7f8), both with LILY_DECODE_F16=5:
# 8 clients, two interleaved rounds, with the engine's gathers and first passes; then 64 clients once each.
# cD.tar.xz: new/lily (958eb067), base/lily (4e56d7f8).
#   run(command="bash docs/perf/2026-12-05-s47/devrun-D.sh", carry=["cD.tar.xz"])
set -u
R=$PWD; mkdir -p /tmp/d && tar xJf $R/cD.tar.xz -C /tmp/d; O=$OUT/D; mkdir -p $O; M=/tmp/lily-full
nvidia-smi --query-gpu=name --format=csv,noheader
[ -f $M/config.json ] || { RAYON_NUM_THREADS=14 /tmp/d/new/lily synth --preset full --out $M > $O/synth.log 2>&1; tail -1 $O/synth.log; }
S() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1"; }
for r in 1 2; do for v in base new; do
  RUST_LOG=lily_engine=debug LILY_DECODE_F16=5 LILY_SERVE_LOG=$O/s8-$v-$r.log LILY_BIN=/tmp/d/$v/lily BENCH_JSON=$O/s8-$v-$r.json timeout 60 bash scripts/bench-serve.sh $M 8 2 128 > $O/s8-$v-$r.txt 2>&1 || echo "s8 $v $r failed"
  S $O/s8-$v-$r.json; sed 's/\x1b\[[0-9;]*m//g' $O/s8-$v-$r.log | grep -a -o 'held the first prefill.*\|prefill pass parts=[0-9]* tokens=[0-9]*' | tail -4 | tr '\n' ';' | cut -c1-400; echo
done; done
for v in base new; do
  RUST_LOG=lily_engine=debug LILY_DECODE_F16=5 LILY_SERVE_LOG=$O/s64-$v.log LILY_BIN=/tmp/d/$v/lily BENCH_JSON=$O/s64-$v.json timeout 90 bash scripts/bench-serve.sh $M 64 2 128 > $O/s64-$v.txt 2>&1 || echo "s64 $v failed"
  S $O/s64-$v.json
done
cd $OUT && tar czf D.tgz D && rm -rf D
