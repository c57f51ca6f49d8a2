# Session 45's prepared call for the next lease (bins49.tar.xz: main/ = main with served-graph merged,
# 4968d64e: bench, gpu_runahead, gpu_sampling, gpu_model, lily; base/ = main without it, 7d0e63af
# (code of 2f70df6b): lily). ~7 min:
#   run(command="bash scripts/.devrun49.sh", carry=["bins49.tar.xz","scripts/.devrun49.sh"])
# Suites (LILY_REQUIRE_GPU=1) of the merged code; the contract's decode at 256 and the served step at 1 and
# 8 (two rounds); serving (scripts/bench-serve.sh) 1 client x 4 requests, base / merged / base / merged
# (one A/B in one lease); then the merged code at 8 and 64 clients x 2 requests.
set -u
R=$PWD; mkdir -p /tmp/b && cd /tmp/b && tar xJf $R/bins49.tar.xz && cd $R; O=$OUT/c5; mkdir -p $O
export RUST_BACKTRACE=1; B=/tmp/b/main
(RAYON_NUM_THREADS=6 $B/lily synth --preset full --out /tmp/lily-full > $O/synth.log 2>&1) &
SYN=$!
for s in gpu_runahead gpu_sampling gpu_model; do LILY_REQUIRE_GPU=1 timeout 150 $B/$s --test-threads=2 --nocapture > $O/$s.log 2>&1; echo "$s rc $?: $(grep 'test result' $O/$s.log)"; done
for r in 1 2; do timeout 60 $B/bench --random-layers 40 --lengths 256 --batch 1,8 --served > $O/bench-$r.json 2>> $O/err.txt || echo "bench $r failed"; grep -h '^{' $O/bench-$r.json | cut -c1-200; done
wait $SYN; tail -1 $O/synth.log
for r in 1 2; do for v in base main; do LILY_BIN=/tmp/b/$v/lily BENCH_JSON=$O/serve1-$v-$r.json timeout 60 bash scripts/bench-serve.sh /tmp/lily-full 1 4 128 > $O/serve1-$v-$r.txt 2>&1 || echo "serve1 $v $r failed"; done; done
LILY_BIN=$B/lily BENCH_JSON=$O/serve-8-64.json timeout 90 bash scripts/bench-serve.sh /tmp/lily-full 8,64 2 128 > $O/serve-8-64.txt 2>&1 || echo "serve 8,64 failed"
for j in $O/serve1-*.json $O/serve-8-64.json; do python3 -c "
import json; j=json.load(open('$j')); print('$(basename $j)', ' | '.join('%d clients: %.1f tok/s, ttft p50 %.1f ms, itl p50 %.3f ms, errors %d' % (p['clients'], p['agg_output_tok_s'], 1000 * p['ttft_s']['p50'], 1000 * p['itl_s']['p50'], p['errors']) for p in j['phases']))" 2>&1; done
