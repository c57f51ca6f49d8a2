# Session 49's H200 call, if one comes (c7.tar.xz: main/bench and main/lily built from main 5a04b428):
# the serving targets of issue 10 on main, and the decode and prefill timelines on the H200.
#  1. the full-shape checkpoint written in the background; meanwhile bench --random-layers 40 --lengths 256
#     --batch 1,8,64, two rounds (the decode at 256 is the contract's, for the one-client ratio);
#     then bench --timeline --lengths 256,4096 --batch 1,8,64 (CUPTI: every kernel of a step and of a prefill);
#  2. bench-serve.sh: 1 client (4 requests), 8 clients (2 requests each) twice, 64 clients once.
#   run(command="bash docs/perf/2026-12-05-s49/devrun-4.sh", carry=["c7.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; rm -rf /tmp/b8; mkdir -p /tmp/b8 && tar xJf $R/c7.tar.xz -C /tmp/b8; B=/tmp/b8; O=/tmp/r8; rm -rf $O; mkdir -p $O; M=/tmp/lily-full
S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $S
SYN=; if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=12 nice -n 19 $B/main/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
for r in 1 2; do
  timeout 60 $B/main/bench --random-layers 40 --lengths 256 --batch 1,8,64 > $O/bench-main-$r.json 2>> $O/err.txt || echo "bench $r failed" | tee -a $S
  grep -h '^{' $O/bench-main-$r.json | cut -c1-140 | sed "s/^/main $r /" | tee -a $S
done
L=$(find /usr/local -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3)
LD_LIBRARY_PATH=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')${LD_LIBRARY_PATH:-} timeout 90 $B/main/bench --random-layers 40 --lengths 256,4096 --batch 1,8,64 --timeline > $O/timeline.jsonl 2> $O/timeline.err; echo "timeline rc $?" | tee -a $S
grep -a -A12 'timeline of\|prefill of' $O/timeline.err | cut -c1-90 >> $S
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=$B/main/lily BENCH_JSON=$O/serve1.json timeout 50 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1.txt 2>&1 || echo "serve1 failed" | tee -a $S; J $O/serve1.json
for r in 1 2; do
  LILY_BIN=$B/main/lily BENCH_JSON=$O/serve8-$r.json timeout 45 bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8-$r.txt 2>&1 || echo "serve8 $r failed" | tee -a $S; J $O/serve8-$r.json
done
LILY_BIN=$B/main/lily BENCH_JSON=$O/serve64.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64.txt 2>&1 || echo "serve64 failed" | tee -a $S; J $O/serve64.json
cd /tmp && tar czf $OUT/r8.tgz r8
