# Session 58, call 3 (any card; ~6-8 min). Carries c58a.tar.xz (g58/s57-moe-f16: lily, bench, gpu_qmm, gpu_model at
# 39060271 = main's code since session 58's merge) and c55a.tar.xz (g55/main: 9673c2f9's qmm_probe):
#   run(command="bash docs/perf/2026-12-06-s58/devrun-2.sh", carry=["c58a.tar.xz", "c55a.tar.xz"])
# Every card: a full-shape synthetic checkpoint written on the CPU while the GPU runs the rest; 1, 8 and 64 clients
#   served by main (scripts/bench-serve.sh, 2 requests of 128 tokens each).
# An H200: first the stream probe and qmm_probe 64 (default against no math: session 55's waiting question), last
#   main's ten-length `lily bench` (the contract JSON of issues 11 and 12) with the time left.
# Another card: Nsight Compute of the 64-token decode step's dense GEMM tiles and split-K reductions (gemm_q4_bm64,
#   gemm_splitk_reduce; 4 random layers), then gpu_qmm whole (LILY_REQUIRE_GPU=1; call 2 cut it at 150 s).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r2; mkdir -p $O /tmp/g; M=/tmp/lily-full
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
tar xJf $R/c58a.tar.xz -C /tmp/g && tar xJf $R/c55a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g58/s57-moe-f16; G=/tmp/g/g55/main; echo "main $(cut -c1-8 $B/REVISION), probe $(cut -c1-8 $G/REVISION)" | tee -a $S
export RUST_BACKTRACE=1
[ -f $M/config.json ] || (RAYON_NUM_THREADS=12 $B/lily synth --preset full --out $M > $O/synth.log 2>&1; echo "synth rc $? at ${SECONDS}s" >> $O/synth.log) &
SYN=$!
H200=0; case "$GPU" in *H200*) H200=1;; esac
if [ $H200 = 1 ]; then
  nvcc -O3 -arch=sm_90a -o /tmp/expert_stream crates/cuda/scripts/probes/expert_stream.cu > $O/expert-stream.txt 2>&1 && timeout 40 /tmp/expert_stream >> $O/expert-stream.txt 2>&1; echo "expert_stream rc $? at ${SECONDS}s" | tee -a $S
  cat $O/expert-stream.txt >> $S
  timeout 60 $G/qmm_probe 64 0,2 > $O/qmm-probe-64.txt 2>&1; echo "qmm_probe rc $? at ${SECONDS}s" | tee -a $S
  grep -E "copy|moe" $O/qmm-probe-64.txt | tee -a $S
else
  timeout 150 ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats -k regex:"gemm_q4_bm64|gemm_splitk_reduce" --launch-skip 60 -c 34 -o $O/d64 $B/bench --random-layers 4 --lengths "" --batch 64 > $O/ncu.log 2>&1; echo "ncu rc $? at ${SECONDS}s" | tee -a $S
  ncu --import $O/d64.ncu-rep --csv --page details --print-metric-name name > $O/d64-details.csv 2>&1
  python3 crates/cuda/scripts/ncu_summary.py $O/d64-details.csv > $O/d64-summary.txt 2>&1; cat $O/d64-summary.txt | tee -a $S
  ncu --import $O/d64.ncu-rep --csv --page raw --print-metric-name name --metrics gpu__time_duration.sum,launch__grid_size,dram__bytes.sum,sm__warps_active.avg.pct_of_peak_sustained_active > $O/d64-raw.csv 2>&1
  python3 - $O/d64-raw.csv >> $S <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
h = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if h is not None:
    hd = rows[h]
    for r in rows[h + 2:]:
        d = dict(zip(hd, r))
        print(d.get("Kernel Name", "")[:28], "grid", d.get("launch__grid_size"), "us", d.get("gpu__time_duration.sum"), "dram B", d.get("dram__bytes.sum"), "warps %", d.get("sm__warps_active.avg.pct_of_peak_sustained_active"))
PY
fi
wait $SYN; tail -2 $O/synth.log | tee -a $S
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft p50 %.1f p99 %.1f itl p50 %.3f p99 %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['ttft_s']['p99'], 1000*p['itl_s']['p50'], 1000*p['itl_s']['p99'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
LILY_BIN=$B/lily BENCH_JSON=$O/serve-1-8-64.json timeout 100 bash scripts/bench-serve.sh $M 1,8,64 2 128 > $O/serve-1-8-64.txt 2>&1 || echo "serve failed" | tee -a $S
J $O/serve-1-8-64.json; grep -a "prefill_seconds_total\|decode_wait_seconds_total\|decode_steps_total" $O/serve-1-8-64.txt | tr '\n' ' ' | tee -a $S; echo | tee -a $S
(cd $OUT && tar czf r2.tgz r2)
if [ $H200 = 1 ]; then
  LEFT=$((585 - SECONDS)); echo "contract with ${LEFT}s left" | tee -a $S
  timeout $LEFT $B/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
  cat $O/contract-main.md 2>/dev/null | tee -a $S
else
  LILY_REQUIRE_GPU=1 timeout $((580 - SECONDS)) $B/gpu_qmm > $O/gpu_qmm.log 2>&1; echo "gpu_qmm rc $? at ${SECONDS}s: $(grep 'test result' $O/gpu_qmm.log | tail -1)" | tee -a $S
fi
(cd $OUT && tar czf r2.tgz r2)
