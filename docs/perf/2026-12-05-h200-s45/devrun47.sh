# Session 45's device calls (bins47.tar.xz: main c84e54db's bench; sample-chunks128 2ad44f15's bench,
# gpu_sampling, gpu_runahead; route-fused's bench, gpu_qmm, gpu_model, lily; gdn-blocked 745b9050's bench,
# gpu_gdn, gpu_model, lily).
#   run(command="bash scripts/.devrun47.sh one", carry=["bins47.tar.xz","scripts/.devrun47.sh"])   ~7 min
#   run(command="bash scripts/.devrun47.sh two", ...)                                               ~8 min
# one: route-fused's gpu_qmm and gpu_model, sample-chunks128's gpu_sampling and gpu_runahead (LILY_REQUIRE_GPU=1);
#   steps with --fused-route on / off in route-fused's bench (two interleaved rounds, batch 1, 2, 4, 8, prefill
#   and decode at 256); the served step (bench --served, batch 1 and 8) of main, sample-chunks128 and
#   route-fused, two interleaved rounds.
# two: serving (scripts/bench-serve.sh) with route-fused's lily, LILY_FUSED_ROUTE on / off: 1 client (4
#   requests), 8 and 64 clients (2 requests each); then gdn-blocked's suites and its f32 / f24 steps.
set -u
R=$PWD; mkdir -p /tmp/b && cd /tmp/b && { [ -d route-fused ] || tar xJf $R/bins47.tar.xz; } && cd $R
O=$OUT/r; mkdir -p $O; export LILY_REQUIRE_GPU=1 RUST_BACKTRACE=1
B=/tmp/b
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $O/gpu-$1.txt 2>&1
suite() { timeout ${3:-200} $B/$1/$2 --test-threads=2 --nocapture > $O/$1-$2.log 2>&1; echo "$1 $2 rc $?: $(grep 'test result' $O/$1-$2.log)" | tee -a $O/tests.txt; }
case "${1:-}" in
  one)
    suite route-fused gpu_qmm; suite route-fused gpu_model
    suite sample-chunks128 gpu_sampling 60; suite sample-chunks128 gpu_runahead 100
    for r in 1 2; do for f in on off; do timeout 60 $B/route-fused/bench --random-layers 40 --lengths 256 --batch 1,2,4,8 --fused-route $f > $O/steps-$f-$r.json 2>> $O/err.txt || echo "steps $f $r failed" | tee -a $O/err.txt; done; done
    for r in 1 2; do for v in main sample-chunks128 route-fused; do timeout 60 $B/$v/bench --random-layers 40 --lengths "" --batch 1,8 --served > $O/served-$v-$r.json 2>> $O/err.txt || echo "served $v $r failed" | tee -a $O/err.txt; done; done
    for f in $O/steps-*.json $O/served-*.json; do echo "== $(basename $f)"; grep -h '^{' $f | cut -c1-220; done ;;
  two)
    [ -f /tmp/lily-full/config.json ] || RAYON_NUM_THREADS=14 $B/route-fused/lily synth --preset full --out /tmp/lily-full > $O/synth.log 2>&1
    for f in on off; do LILY_FUSED_ROUTE=$f LILY_BIN=$B/route-fused/lily BENCH_JSON=$O/serve1-$f.json timeout 60 bash scripts/bench-serve.sh /tmp/lily-full 1 4 128 > $O/serve1-$f.txt 2>&1 || echo "serve1 $f failed"; done
    for f in on off; do LILY_FUSED_ROUTE=$f LILY_BIN=$B/route-fused/lily BENCH_JSON=$O/serve-$f.json timeout 80 bash scripts/bench-serve.sh /tmp/lily-full 8,64 2 128 > $O/serve-$f.txt 2>&1 || echo "serve $f failed"; done
    for j in $O/serve1-*.json $O/serve-*.json; do python3 -c "
import json; j=json.load(open('$j')); print('$(basename $j)', ' '.join('%d: %.1f tok/s ttft50 %.1f ms' % (p['clients'], p['agg_output_tok_s'], 1000 * p['ttft_s']['p50']) for p in j['phases']))" 2>&1; done
    suite gdn-blocked gpu_gdn 60; suite gdn-blocked gpu_model
    for f in f32 f24; do timeout 45 $B/gdn-blocked/bench --random-layers 40 --batch 1,8,16,64 --lengths 256 --gdn-state $f > $O/gdn-steps-$f.json 2>> $O/err.txt || echo "gdn $f failed"; done
    for f in $O/gdn-steps-*.json; do echo "== $(basename $f)"; grep -h '^{' $f | cut -c1-200; done ;;
  *) echo "usage: devrun47.sh one|two" >&2; exit 2 ;;
esac
