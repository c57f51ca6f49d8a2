# Session 47's second call (after devrun-A.sh): the merged code serving 8 clients with the fp16 dense inputs
# off and from 5 sequences (LILY_DECODE_F16), one client served by main (base) and by the merge
# (served-graph), 64 clients with every prefill pass logged; then, if time is left, 12 and 16 sequences on
# the GEMM path against qmm on two fp16 n-tiles, and main's step at 1 and 8 against a090f5cd's.
# cB.tar.xz: main/{lily,bench}, base/lily, old/bench (devrun-1.sh's header).
#   run(command="bash docs/perf/2026-12-05-s47/devrun-B.sh", carry=["cB.tar.xz"])
set -u
R=$PWD; mkdir -p /tmp/b && tar xJf $R/cB.tar.xz -C /tmp/b; O=$OUT/B; mkdir -p $O
export RUST_BACKTRACE=1; B=/tmp/b/main; M=$R/.synth-full
[ -f $M/config.json ] || { echo "writing the checkpoint"; RAYON_NUM_THREADS=14 $B/lily synth --preset full --out $M > $O/synth.log 2>&1; }
strip_log() { sed 's/\x1b\[[0-9;]*m//g' "$1"; }
summary() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d clients: %.1f tok/s, ttft p50 %.1f ms, itl p50 %.3f ms, errors %d' % (p['clients'], p['agg_output_tok_s'], 1000 * p['ttft_s']['p50'], 1000 * p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" 2>&1; }
for f in off 5 off 5; do r=$([ -f $O/serve8-f16-$f-1.json ] && echo 2 || echo 1)
  RUST_LOG=lily_engine=debug LILY_DECODE_F16=$f LILY_SERVE_LOG=$O/serve8-f16-$f-$r.log LILY_BIN=$B/lily BENCH_JSON=$O/serve8-f16-$f-$r.json timeout 75 bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8-f16-$f-$r.txt 2>&1 || echo "serve8 $f $r failed"
  summary $O/serve8-f16-$f-$r.json; echo "  gathers: $(strip_log $O/serve8-f16-$f-$r.log | grep -a 'held the first prefill' | grep -a -o 'gathered=[0-9]* expected=[0-9]*' | tr '\n' ' ')"
done
for v in base main; do
  RUST_LOG=lily_server=debug,lily_engine=debug LILY_SERVE_LOG=$O/serve1-$v.log LILY_BIN=/tmp/b/$v/lily BENCH_JSON=$O/serve1-$v.json timeout 70 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1-$v.txt 2>&1 || echo "serve1 $v failed"
  summary $O/serve1-$v.json; echo "  since_arrival_us: $(strip_log $O/serve1-$v.log | grep -a -o 'since_arrival_us=[0-9]*' | cut -d= -f2 | tr '\n' ' ')"
done
RUST_LOG=lily_engine=debug LILY_SERVE_LOG=$O/serve64.log LILY_BIN=$B/lily BENCH_JSON=$O/serve64.json timeout 100 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64.txt 2>&1 || echo "serve64 failed"
summary $O/serve64.json
strip_log $O/serve64.log | grep -a 'prefill pass' | grep -a -o 'parts=[0-9]* tokens=[0-9]* ms=[0-9.]*' > $O/serve64-passes.txt
echo "64-client passes: $(wc -l < $O/serve64-passes.txt), parts/tokens/ms: $(awk -F'[= ]' '{p+=$2; t+=$4; m+=$6} END {printf "%d / %d / %.0f", p, t, m}' $O/serve64-passes.txt)"
head -16 $O/serve64-passes.txt | tr '\n' ' '; echo
for a in "gemm:" "qmmf16:--decode-gemm 17 --decode-f16 5"; do
  timeout 45 $B/bench --random-layers 40 --lengths "" --batch 12,16 ${a#*:} > $O/bench-916-${a%%:*}.json 2>> $O/err.txt || echo "bench 9-16 ${a%%:*} failed"
  grep -h '^{' $O/bench-916-${a%%:*}.json | cut -c1-120 | sed "s/^/${a%%:*} /"
done
for v in old main; do
  timeout 45 /tmp/b/$v/bench --random-layers 40 --lengths "" --batch 1,8 > $O/bench-kernels-$v.json 2>> $O/err.txt || echo "bench $v failed"
  grep -h '^{' $O/bench-kernels-$v.json | cut -c1-120 | sed "s/^/$v /"
done
