"""Per-kernel GPU time from an Nsight Compute CSV (gpu__time_duration.sum).

Usage: python3 ncu_summary.py ncu.csv [decode_steps]
Prints, per kernel name: launches, total and mean microseconds, sorted by
total; with decode_steps, also the decode kernels' time per step.
"""
import csv
import sys
from collections import defaultdict

path = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 0
rows = []
with open(path, newline="") as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "ns")
    us = v / 1000.0 if unit in ("ns", "nsecond") else v * 1000.0 if unit in ("ms", "msecond") else v
    rows.append((r["Kernel Name"].split("(")[0], us))
agg = defaultdict(lambda: [0, 0.0])
for name, us in rows:
    agg[name][0] += 1
    agg[name][1] += us
total = sum(v[1] for v in agg.values())
print(f"{len(rows)} kernels, {total / 1000:.2f} ms of GPU time")
print(f"{'kernel':<22} {'launches':>8} {'total ms':>9} {'mean us':>9} {'share':>6}")
for name, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(f"{name:<22} {n:>8} {us / 1000:>9.3f} {us / n:>9.2f} {100 * us / total:>5.1f}%")
if steps:
    dec = {"xnorm", "qmm_dense", "qmm_moe", "moe_router", "gdn_decode", "attn_prep", "attn_decode", "attn_combine", "argmax_finish", "embed_q4", "sample_rows"}
    per = sum(us for name, us in rows if any(name.startswith(d) for d in dec)) / steps
    print(f"decode kernels (incl. the prefills' lm_head and embeds): {per:.1f} us per step over {steps} steps")
