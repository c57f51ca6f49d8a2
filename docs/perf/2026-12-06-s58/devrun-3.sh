# Session 58, call 4 (any card; ~4 min). Carries c58b.tar.xz (g58b/s58-gdn-stream: bench, gpu_gdn, gpu_model of
# branch s58-gdn-stream, 50c3640c: gdn_decode_stream, persistent blocks streaming each next item's DeltaNet state):
#   run(command="bash docs/perf/2026-12-06-s58/devrun-3.sh", carry=["c58b.tar.xz"])
# 1. gpu_gdn whole and gpu_model's full-width test (LILY_REQUIRE_GPU=1; the streamed kernel bit for bit against
#    gdn_decode, and in the model's default path from 16 tokens).
# 2. ms a step at 2 / 8 / 16 / 32 / 64 / 128 sequences, --gdn-stream off against 2 (streamed at every size), two
#    interleaved rounds, with the greedy digests (equal = the same bits).
# 3. Nsight Compute of the DeltaNet decode kernels of a 64-token step, both ways (duration, DRAM throughput).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r3; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c58b.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g58b/s58-gdn-stream; echo "branch $(cut -c1-8 $B/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
LILY_REQUIRE_GPU=1 timeout 120 $B/gpu_gdn > $O/gpu_gdn.log 2>&1; echo "gpu_gdn rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_gdn.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL" $O/gpu_gdn.log | head -10 | tee -a $S
for r in 1 2; do
  for v in off 2; do
    timeout 100 $B/bench --random-layers 40 --lengths "" --batch 2,8,16,32,64,128 --gdn-stream $v > $O/bench-$v-r$r.json 2> $O/bench-$v-r$r.err; echo "bench $v round $r rc $? at ${SECONDS}s" >> $S
  done
done
python3 - $O >> $S <<'PY'
import json, sys
o = sys.argv[1]
for r in (1, 2):
    for v in ("off", "2"):
        try:
            rows = [json.loads(l) for l in open(f"{o}/bench-{v}-r{r}.json") if l.strip().startswith("{")]
        except OSError:
            continue
        print("gdn-stream", v, "round", r, " ".join(f"{x['batch']}: {x['step_ms']:.3f} {x.get('seq0_digest', '')[:8]}" for x in rows if "batch" in x))
PY
tail -4 $S
for v in off 2; do
  timeout 90 ncu --clock-control none --section SpeedOfLight -k regex:gdn_decode --launch-skip 40 -c 6 -o $O/gdn64-$v $B/bench --random-layers 4 --lengths "" --batch 64 --gdn-stream $v > $O/ncu-$v.log 2>&1; echo "ncu $v rc $? at ${SECONDS}s" | tee -a $S
  ncu --import $O/gdn64-$v.ncu-rep --csv --page raw --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum,launch__grid_size > $O/gdn64-$v.csv 2>&1
  python3 - $O/gdn64-$v.csv >> $S <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
h = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if h is not None:
    hd = rows[h]
    for r in rows[h + 2:]:
        d = dict(zip(hd, r))
        print(d.get("Kernel Name", "")[:20], "grid", d.get("launch__grid_size"), "us", d.get("gpu__time_duration.sum"), "dram%", d.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"), "bytes", d.get("dram__bytes.sum"))
else:
    print(open(sys.argv[1]).read()[:500])
PY
done
LILY_REQUIRE_GPU=1 timeout 200 $B/gpu_model full_width_four_layer_model_matches_lily_cpu > $O/gpu_model.log 2>&1; echo "gpu_model rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_model.log | tail -1)" | tee -a $S
grep -aE "panicked|FAIL" $O/gpu_model.log | head -10 | tee -a $S
rm -f $O/*.ncu-rep
(cd $OUT && tar czf r3.tgz r3)
