# Session 58, call 2 (any card; ~6 min). Carries c58a.tar.xz (g58/s57-moe-f16: lily, bench, gpu_qmm, gpu_model of
# branch s57-moe-f16 at 39060271, fp16 decode experts on by default from 32 sequences):
#   run(command="bash docs/perf/2026-12-06-s58/devrun-1.sh", carry=["c58a.tar.xz"])
# 1. gpu_qmm (all) and gpu_model's full-width test (the GEMM path with fp16 experts against each sequence alone),
#    LILY_REQUIRE_GPU=1, while a full-shape synthetic checkpoint is written on the CPU.
# 2. ms a step at 1 / 8 / 32 / 64 / 128 sequences, --moe-f16 off against the default, two interleaved rounds.
# 3. 64 clients served (scripts/bench-serve.sh, 2 requests of 128 tokens each), LILY_MOE_F16=off against the
#    default, two interleaved rounds, with the engine's decode-wait and prefill seconds.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r1; mkdir -p $O /tmp/g; M=/tmp/lily-full
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c58a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g58/s57-moe-f16; echo "branch $(cut -c1-8 $B/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
(RAYON_NUM_THREADS=12 $B/lily synth --preset full --out $M > $O/synth.log 2>&1; echo "synth rc $? at ${SECONDS}s" >> $O/synth.log) &
SYN=$!
LILY_REQUIRE_GPU=1 timeout 150 $B/gpu_qmm > $O/gpu_qmm.log 2>&1; echo "gpu_qmm rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_qmm.log | tail -1)" | tee -a $S
LILY_REQUIRE_GPU=1 timeout 200 $B/gpu_model full_width_four_layer_model_matches_lily_cpu > $O/gpu_model.log 2>&1; echo "gpu_model rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_model.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL|fp16 experts|mean" $O/gpu_model.log $O/gpu_qmm.log | head -30 | tee -a $S
for r in 1 2; do
  for v in off 32; do
    timeout 100 $B/bench --random-layers 40 --lengths "" --batch 1,8,32,64,128 --moe-f16 $v > $O/bench-$v-r$r.json 2> $O/bench-$v-r$r.err; echo "bench $v round $r rc $? at ${SECONDS}s" >> $S
  done
done
python3 - $O >> $S <<'PY'
import json, sys
o = sys.argv[1]
for r in (1, 2):
    for v in ("off", "32"):
        try:
            rows = [json.loads(l) for l in open(f"{o}/bench-{v}-r{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        print("moe-f16", v, "round", r, " ".join(f"{x['batch']}: {x['step_ms']:.3f}" for x in rows if "batch" in x))
PY
wait $SYN; tail -2 $O/synth.log | tee -a $S
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft p50 %.1f p99 %.1f itl p50 %.3f p99 %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['ttft_s']['p99'], 1000*p['itl_s']['p50'], 1000*p['itl_s']['p99'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
for r in 1 2; do
  for v in off default; do
    [ $SECONDS -lt 500 ] || { echo "out of time before $v round $r" | tee -a $S; continue; }
    E=""; [ $v = off ] && E=off
    env ${E:+LILY_MOE_F16=$E} LILY_BIN=$B/lily BENCH_JSON=$O/serve64-$v-r$r.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64-$v-r$r.txt 2>&1 || echo "serve64 $v round $r failed" | tee -a $S
    J $O/serve64-$v-r$r.json; grep -a "prefill_seconds_total\|decode_wait_seconds_total\|decode_steps_total" $O/serve64-$v-r$r.txt | tr '\n' ' ' | tee -a $S; echo | tee -a $S
  done
done
(cd $OUT && tar czf r1.tgz r1)
