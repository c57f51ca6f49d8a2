# Session 46's prepared call for the next lease (no device in session 46). Build the binaries first (a
# new session's checkout has no untracked files, so earlier sessions' tarballs are gone), ~10-15 min:
#   git branch served-graph-next main && git worktree add /tmp/sg served-graph-next &&
#     (cd /tmp/sg && git revert --no-edit d60eb67b)         # re-applies served-graph (2720503b)
#   TESTS="gpu_runahead gpu_sampling gpu_model" LILY=1 bash crates/cuda/scripts/ab-revisions.sh \
#     collect /tmp/binsnext served-graph-next main
#   mkdir -p /tmp/pk/main /tmp/pk/base && cp /tmp/binsnext/served-graph-next/{bench,gpu_runahead,gpu_sampling,gpu_model,lily} /tmp/pk/main/ &&
#     cp /tmp/binsnext/main/lily /tmp/pk/base/ && tar cJf binsnext.tar.xz -C /tmp/pk main base   # in the checkout root,
#     git-ignored (add it to .git/info/exclude); copy this script to scripts/.devrun-next.sh (ignored too)
#   run(command="bash scripts/.devrun-next.sh", carry=["binsnext.tar.xz","scripts/.devrun-next.sh"])   ~8 min
# It runs: the merged code's suites (LILY_REQUIRE_GPU=1); the contract's decode at 256 and the served step
# at 1 and 8 (two rounds); one client x 4 requests served by base (main) and merged in turn, two rounds,
# with the server's debug log (each request's preparation, since_arrival_us, on the H200 host: 842-1,301 us
# in session 36, 304 us median on the CPU demo after session 46's ASCII split and inline preparation);
# then the merged code at 8 and 64 clients x 2 requests with the engine's debug log (the arrival gathers:
# session 46's Burst should hold each 8-client round's first prefill for all 8, history 159).
set -u
R=$PWD; mkdir -p /tmp/b && cd /tmp/b && tar xJf $R/binsnext.tar.xz && cd $R; O=$OUT/next; mkdir -p $O
export RUST_BACKTRACE=1; B=/tmp/b/main
(RAYON_NUM_THREADS=6 $B/lily synth --preset full --out /tmp/lily-full > $O/synth.log 2>&1) &
SYN=$!
for s in gpu_runahead gpu_sampling gpu_model; do LILY_REQUIRE_GPU=1 timeout 150 $B/$s --test-threads=2 --nocapture > $O/$s.log 2>&1; echo "$s rc $?: $(grep 'test result' $O/$s.log)"; done
for r in 1 2; do timeout 60 $B/bench --random-layers 40 --lengths 256 --batch 1,8 --served > $O/bench-$r.json 2>> $O/err.txt || echo "bench $r failed"; grep -h '^{' $O/bench-$r.json | cut -c1-200; done
wait $SYN; tail -1 $O/synth.log
for r in 1 2; do for v in base main; do RUST_LOG=lily_server=debug,lily_engine=debug LILY_SERVE_LOG=$O/serve1-$v-$r.log LILY_BIN=/tmp/b/$v/lily BENCH_JSON=$O/serve1-$v-$r.json timeout 60 bash scripts/bench-serve.sh /tmp/lily-full 1 4 128 > $O/serve1-$v-$r.txt 2>&1 || echo "serve1 $v $r failed"; echo "$v $r since_arrival_us: $(sed 's/\x1b\[[0-9;]*m//g' $O/serve1-$v-$r.log | grep -a -o 'since_arrival_us=[0-9]*' | cut -d= -f2 | tr '\n' ' ')"; done; done
RUST_LOG=lily_engine=debug LILY_SERVE_LOG=$O/serve-8-64.log LILY_BIN=$B/lily BENCH_JSON=$O/serve-8-64.json timeout 90 bash scripts/bench-serve.sh /tmp/lily-full 8,64 2 128 > $O/serve-8-64.txt 2>&1 || echo "serve 8,64 failed"
echo "gathers (gathered/expected@waited_us): $(sed 's/\x1b\[[0-9;]*m//g' $O/serve-8-64.log | grep -a 'held the first prefill' | grep -a -o 'gathered=[0-9]* expected=[0-9]* waited_us=[0-9]*' | sed 's/gathered=//;s/ expected=/\//;s/ waited_us=/@/' | tr '\n' ' ')"
echo "first passes: $(sed 's/\x1b\[[0-9;]*m//g' $O/serve-8-64.log | grep -a 'prefill pass' | grep -a -o 'parts=[0-9]* tokens=[0-9]* ms=[0-9.]*' | head -12 | tr '\n' ' ')"
for j in $O/serve1-*.json $O/serve-8-64.json; do python3 -c "
import json; j=json.load(open('$j')); print('$(basename $j)', ' | '.join('%d clients: %.1f tok/s, ttft p50 %.1f ms, itl p50 %.3f ms, errors %d' % (p['clients'], p['agg_output_tok_s'], 1000 * p['ttft_s']['p50'], 1000 * p['itl_s']['p50'], p['errors']) for p in j['phases']))" 2>&1; done
