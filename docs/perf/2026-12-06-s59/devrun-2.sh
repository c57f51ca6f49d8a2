# Session 59, call 2 (any card; ~2 min). Carries c59a.tar.xz (main d938678b's bench under g59a/main).
#   run(command="bash docs/perf/2026-12-06-s59/devrun-2.sh", carry=["c59a.tar.xz"])
# Nsight Compute of a 64-token decode step's dense GEMM tiles (gemm_q4_bm64_split: what holds the in- and
# out-projections at ~7x their bytes: L2 traffic of the re-read A tiles, DRAM latency, or issue), the split-K
# reduction, the router and the fp16 experts. Session 58's attempt matched no tile kernel inside the decode graph;
# `bench --profile` also runs the step without a graph (profile_decode), and the kernel list of what ncu profiled
# says which launches it saw.
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r2; mkdir -p $O /tmp/g
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee $S
[ -d /tmp/g/g59a ] || tar xJf $R/c59a.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g59a/main/bench; echo "main $(cut -c1-8 /tmp/g/g59a/main/REVISION)" | tee -a $S
timeout 240 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
  -k regex:"gemm_q4_bm64_split|moe_router|qmm_moe_f16" -c 24 -o $O/d64 \
  $B --random-layers 4 --lengths "" --batch 64 --profile > $O/ncu.log 2>&1; echo "ncu rc $? at ${SECONDS}s" | tee -a $S
grep "Profiling" $O/ncu.log | sed -E 's/.*Profiling "([^"]+)".*/\1/' | uniq -c | head -30 | tee -a $S
ncu --import $O/d64.ncu-rep --csv --page raw --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,l1tex__t_bytes.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active > $O/d64-raw.csv 2>&1
python3 - $O/d64-raw.csv >> $S <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
h = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if h is None:
    print("no rows"); sys.exit()
hdr = rows[h]; data = rows[h + 2:]
ix = {n: hdr.index(n) for n in hdr}
cols = ["gpu__time_duration.sum", "launch__grid_size", "launch__registers_per_thread", "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum", "l1tex__t_bytes.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__throughput.avg.pct_of_peak_sustained_elapsed", "sm__throughput.avg.pct_of_peak_sustained_elapsed", "sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active"]
print("kernel | us | grid | regs | dram rd MB | dram wr MB | L2 MB | L1 MB | dram% | L2% | SM% | warps% | issue%")
for r in data:
    v = []
    for c in cols:
        x = r[ix[c]] if c in ix else ""
        v.append(x)
    print(r[ix["Kernel Name"]][:22], "|", " | ".join(v))
PY
ncu --import $O/d64.ncu-rep --page details -k regex:gemm_q4_bm64_split -c 2 > $O/gemm-details.txt 2>&1
grep -E "Duration|Throughput|Hit Rate|Warp Cycles Per Issued|Issue Slots|Eligible|Stall|Achieved Occupancy|Block Limit|Mem Busy|Max Bandwidth|Mem Pipes" $O/gemm-details.txt | head -40 | tee -a $S
ncu --import $O/d64.ncu-rep --page raw -k regex:gemm_q4_bm64_split -c 1 --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio > $O/gemm-stalls.txt 2>&1
grep -E "stalled" $O/gemm-stalls.txt | sort -k3 -g -r | head -14 | tee -a $S
rm -f $O/*.ncu-rep
