# For the next H200 lease (session 50 left it unrun). c15.tar.xz: main/{bench,lily} built from main ff98d920
# (the code of 1bbbc3a5: the split-K reduction and the GEMM path's programmatic launch, histories 171 and 173);
# /work/lease-next/c15.tar.xz on the development machine; rebuild if main's code changed since.
#  1. the full-shape checkpoint written in the background;
#  2. the contract: bench --random-layers 40 --lengths 256,4096,32768,131072 --batch 1,8,64;
#  3. bench --timeline --lengths 256,4096 --batch 1,8,64 (main's in-graph breakdown on the H200);
#  4. serving: 1 client (4 requests), 8 clients (2 each), 64 clients (2 each).
#   run(command="bash docs/perf/2026-12-05-s50/devrun-next.sh", carry=["c15.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; rm -rf /tmp/b15; mkdir -p /tmp/b15 && tar xJf $R/c15.tar.xz -C /tmp/b15; B=/tmp/b15/main
O=/tmp/r15; rm -rf $O; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee -a $S
SYN=; if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=10 nice -n 19 $B/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
timeout 200 $B/bench --random-layers 40 --lengths 256,4096,32768,131072 --batch 1,8,64 > $O/contract.jsonl 2> $O/contract.err; echo "contract rc $?" | tee -a $S
grep -a '^{' $O/contract.jsonl | cut -c1-170 | tee -a $S
L=$(find /usr/local -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3); TLP=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')
LD_LIBRARY_PATH=$TLP${LD_LIBRARY_PATH:-} timeout 100 $B/bench --random-layers 40 --lengths 256,4096 --batch 1,8,64 --timeline > $O/timeline.jsonl 2> $O/timeline.err; echo "timeline rc $?" | tee -a $S
grep -a -A12 'timeline of\|prefill of' $O/timeline.err | cut -c1-90 >> $S
(cd /tmp && tar czf $OUT/r15.tgz r15)
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=$B/lily BENCH_JSON=$O/serve1.json timeout 50 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1.txt 2>&1 || echo "serve1 failed" | tee -a $S; J $O/serve1.json
LILY_BIN=$B/lily BENCH_JSON=$O/serve8.json timeout 45 bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8.txt 2>&1 || echo "serve8 failed" | tee -a $S; J $O/serve8.json
LILY_BIN=$B/lily BENCH_JSON=$O/serve64.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64.txt 2>&1 || echo "serve64 failed" | tee -a $S; J $O/serve64.json
(cd /tmp && tar czf $OUT/r15.tgz r15)
