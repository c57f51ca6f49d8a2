# Session 58, call 5 (any card; ~1.5 min on an H100, up to ~9.5 min on an H200). Carries c58a.tar.xz (g58/s57-moe-f16:
# lily, bench at 39060271 = main's code since the fp16-experts merge) and c58b.tar.xz (g58b/s58-gdn-stream: bench of
# history 199):
#   run(command="bash docs/perf/2026-12-06-s58/devrun-4.sh", carry=["c58a.tar.xz", "c58b.tar.xz"])
# Every card: main's step timelines at 1 / 8 / 64 sequences (bench --timeline, 40 random layers: what each kernel
#   adds to the step now that the experts of 32+ sequences read fp16 x).
# An H200 also: history 199's A/B (gdn_decode_stream against gdn_decode, --gdn-stream 16 / off at 16-128 sequences:
#   the H100 is near its copy rate there, the H200's DeltaNet step is not); 1, 8 and 64 clients served by main;
#   main's ten-length `lily bench` (the contract JSON of issues 11 and 12) with the time left.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r4; mkdir -p $O /tmp/g; M=/tmp/lily-full
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c58a.tar.xz -C /tmp/g && tar xJf $R/c58b.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g58/s57-moe-f16; G=/tmp/g/g58b/s58-gdn-stream; echo "main $(cut -c1-8 $B/REVISION), gdn-stream $(cut -c1-8 $G/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
H200=0; case "$GPU" in *H200*) H200=1;; esac
[ $H200 = 1 ] && { (RAYON_NUM_THREADS=12 $B/lily synth --preset full --out $M > $O/synth.log 2>&1; echo "synth rc $? at ${SECONDS}s" >> $O/synth.log) & }
timeout 120 $B/bench --random-layers 40 --lengths "" --batch 1,8,64 --timeline > $O/timeline.jsonl 2> $O/timeline.err; echo "timeline rc $? at ${SECONDS}s" | tee -a $S
grep -A14 "timeline of batch 64" $O/timeline.err | tee -a $S
if [ $H200 = 0 ]; then (cd $OUT && tar czf r4.tgz r4); exit 0; fi
for r in 1 2; do
  for v in off 16; do
    timeout 100 $G/bench --random-layers 40 --lengths "" --batch 16,32,64,128 --gdn-stream $v > $O/gdn-$v-r$r.json 2> $O/gdn-$v-r$r.err; echo "gdn-stream $v round $r rc $? at ${SECONDS}s" >> $S
  done
done
python3 - $O >> $S <<'PY'
import json, sys
o = sys.argv[1]
for r in (1, 2):
    for v in ("off", "16"):
        try:
            rows = [json.loads(l) for l in open(f"{o}/gdn-{v}-r{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        print("gdn-stream", v, "round", r, " ".join(f"{x['batch']}: {x['step_ms']:.3f} {x.get('seq0_digest', '')[:8]}" for x in rows if "batch" in x))
PY
tail -4 $S
wait; tail -2 $O/synth.log | tee -a $S
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft p50 %.1f p99 %.1f itl p50 %.3f p99 %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['ttft_s']['p99'], 1000*p['itl_s']['p50'], 1000*p['itl_s']['p99'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=$B/lily BENCH_JSON=$O/serve-1-8-64.json timeout 100 bash scripts/bench-serve.sh $M 1,8,64 2 128 > $O/serve-1-8-64.txt 2>&1 || echo "serve failed" | tee -a $S
J $O/serve-1-8-64.json; grep -a "prefill_seconds_total\|decode_wait_seconds_total\|decode_steps_total" $O/serve-1-8-64.txt | tr '\n' ' ' | tee -a $S; echo | tee -a $S
(cd $OUT && tar czf r4.tgz r4)
LEFT=$((585 - SECONDS)); echo "contract with ${LEFT}s left" | tee -a $S
timeout $LEFT $B/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r4.tgz r4)
