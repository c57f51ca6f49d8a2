"""Per-kernel GPU time from an Nsight Compute CSV (gpu__time_duration.sum).

Usage: python3 ncu_summary.py ncu.csv [decode_steps]
where ncu.csv is `ncu --import REP --csv --page details --print-metric-name
name` (raw metric names). Prints, per kernel name: launches, total and mean
microseconds, sorted by total, and where the report has them (sections
SpeedOfLight, LaunchStats, Occupancy) each kernel's mean DRAM, L2 and SM
throughput (% of peak), achieved occupancy (% of the SM's warps), grid size
and registers a thread; with decode_steps, also the decode kernels' time per
step.
"""
import csv
import sys
from collections import defaultdict

# Raw metric name -> column label, averaged over a kernel's launches.
EXTRA = [
    ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "dram%"),
    ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "l2%"),
    ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "sm%"),
    ("sm__warps_active.avg.pct_of_peak_sustained_active", "occ%"),
    ("launch__grid_size", "grid"),
    ("launch__registers_per_thread", "regs"),
]


def value(r):
    return float(r["Metric Value"].replace(",", ""))


path = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 0
with open(path, newline="") as f:
    lines = [l for l in f if l.startswith('"')]
rows = []  # (kernel, us)
extra = defaultdict(lambda: defaultdict(list))  # kernel -> label -> values
for r in csv.DictReader(lines):
    name = r["Kernel Name"].split("(")[0]
    metric = r.get("Metric Name")
    if metric == "gpu__time_duration.sum":
        v = value(r)
        unit = r.get("Metric Unit", "ns")
        us = v / 1000.0 if unit in ("ns", "nsecond") else v * 1000.0 if unit in ("ms", "msecond") else v
        rows.append((name, us))
    for raw, label in EXTRA:
        if metric == raw:
            extra[name][label].append(value(r))
agg = defaultdict(lambda: [0, 0.0])
for name, us in rows:
    agg[name][0] += 1
    agg[name][1] += us
total = sum(v[1] for v in agg.values())
labels = [label for _, label in EXTRA if any(label in extra[n] for n in agg)]
print(f"{len(rows)} kernels, {total / 1000:.2f} ms of GPU time")
print(f"{'kernel':<26} {'launches':>8} {'total ms':>9} {'mean us':>9} {'share':>6}" + "".join(f" {l:>7}" for l in labels))
for name, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    cols = ""
    for l in labels:
        vs = extra[name].get(l, [])
        cols += f" {sum(vs) / len(vs):>7.1f}" if vs else f" {'':>7}"
    print(f"{name:<26} {n:>8} {us / 1000:>9.3f} {us / n:>9.2f} {100 * us / total:>5.1f}%" + cols)
if steps:
    dec = {"xnorm", "qmm_dense", "qmm_moe", "moe_router", "gdn_decode", "attn_prep", "attn_decode", "attn_combine", "argmax_finish", "embed_q4", "sample_rows"}
    per = sum(us for name, us in rows if any(name.startswith(d) for d in dec)) / steps
    print(f"decode kernels (incl. the prefills' lm_head and embeds): {per:.1f} us per step over {steps} steps")
