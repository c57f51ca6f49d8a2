# Session 52, call 11 (on the H100 the H200 requests kept getting): main's contract (`lily bench`, ten lengths, the
# median of 2 rounds) and 1 and 8 clients, as an H100 reference for later H100-only leases. Not the issues' H200 line.
#   run(command="bash docs/perf/2026-12-05-s52/devrun-11.sh", carry=["c20.tar.xz"])
set -u
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); S=$OUT/summary.txt; echo "$GPU" | tee -a $S
R=$PWD; mkdir -p /tmp/c20 && tar xJf $R/c20.tar.xz -C /tmp/c20
O=$OUT/r11; mkdir -p $O; M=/tmp/lily-full; export RUST_BACKTRACE=1
[ -f $M/config.json ] || { RAYON_NUM_THREADS=14 /tmp/c20/main51/lily synth --preset full --out $M > $O/synth.log 2>&1; tail -1 $O/synth.log | tee -a $S; }
timeout 330 /tmp/c20/main51/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r11.tgz r11)
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft p50 %.1f itl p50 %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
for c in 1 8; do [ $SECONDS -lt 470 ] && { LILY_BIN=/tmp/c20/main51/lily BENCH_JSON=$O/serve$c.json timeout 45 bash scripts/bench-serve.sh $M $c 2 128 > $O/serve$c.txt 2>&1 || echo "serve$c failed" | tee -a $S; J $O/serve$c.json; }; done
(cd $OUT && tar czf r11.tgz r11)
