# Session 49's H200 call: issue 10's serving lines on main, and the kernel timelines.
# c7.tar.xz: main/lily = 55e0124e (main 8391c4e9..41dfade1's serving code); c8.tar.xz: main/bench = 41dfade1
# (main with kernel_trace), m2d/bench = moe-m2 a5cb031d.
#  1. the full-shape checkpoint in the background; meanwhile the contract's decode at 256 (bench, two rounds) and
#     bench --timeline at 1, 8, 64 (CUPTI records of 5 traced steps a size);
#  2. bench-serve.sh: 1 client (4 requests), 8 clients (2 each) twice, 64 clients once;
#  3. m2d's timeline at 8 and 32 (why its step was slower), if time is left.
#   run(command="bash docs/perf/2026-12-05-s49/devrun-6.sh", carry=["c7.tar.xz", "c8.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b7 /tmp/b9; mkdir -p /tmp/b7 /tmp/b9 && tar xJf $R/c7.tar.xz -C /tmp/b7 && tar xJf $R/c8.tar.xz -C /tmp/b9
O=/tmp/r10; rm -rf $O; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee -a $S
SYN=; if [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=12 nice -n 19 /tmp/b7/main/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
for r in 1 2; do
  timeout 60 /tmp/b9/main/bench --random-layers 40 --lengths 256 --batch 1,8,64 > $O/bench-main-$r.json 2>> $O/err.txt || echo "bench $r failed" | tee -a $S
  grep -h '^{' $O/bench-main-$r.json | cut -c1-140 | sed "s/^/main $r /" | tee -a $S
done
L=$(find /usr/local /usr/lib /opt -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3); echo "cupti: $L" | tee -a $S
TLP=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')
LD_LIBRARY_PATH=$TLP${LD_LIBRARY_PATH:-} timeout 90 /tmp/b9/main/bench --random-layers 40 --lengths 256 --batch 1,8,64 --timeline > $O/tl-main.jsonl 2> $O/tl-main.err; echo "timeline main rc $?" | tee -a $S
tail -2 $O/tl-main.err | tee -a $S; grep -a -A14 'timeline of' $O/tl-main.err | head -48 >> $S
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=/tmp/b7/main/lily BENCH_JSON=$O/serve1.json timeout 50 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1.txt 2>&1 || echo "serve1 failed" | tee -a $S; J $O/serve1.json
for r in 1 2; do
  LILY_BIN=/tmp/b7/main/lily BENCH_JSON=$O/serve8-$r.json timeout 45 bash scripts/bench-serve.sh $M 8 2 128 > $O/serve8-$r.txt 2>&1 || echo "serve8 $r failed" | tee -a $S; J $O/serve8-$r.json
done
LILY_BIN=/tmp/b7/main/lily BENCH_JSON=$O/serve64.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64.txt 2>&1 || echo "serve64 failed" | tee -a $S; J $O/serve64.json
(cd /tmp && tar czf $OUT/r10.tgz r10)
LD_LIBRARY_PATH=$TLP${LD_LIBRARY_PATH:-} timeout 60 /tmp/b9/m2d/bench --random-layers 40 --lengths 256 --batch 8,32 --timeline > $O/tl-m2d.jsonl 2> $O/tl-m2d.err; echo "timeline m2d rc $?" | tee -a $S
grep -a -A14 'timeline of' $O/tl-m2d.err | head -32 >> $S
(cd /tmp && tar czf $OUT/r10.tgz r10)
