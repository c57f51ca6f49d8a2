"""Where a kernel's warps stall, by SASS line, from Nsight Compute's source page.

Usage: python3 ncu_sass_stalls.py source.csv [top]
where source.csv is `ncu --import REP --page source --print-source sass --csv`
(a report taken with `--section SourceCounters`). Prints the executed warp
instructions, the share of each stall reason over all samples, and the `top`
lines (default 25) with the most stall samples, each with its instructions
executed and its three largest reasons.
"""
import csv
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


path = sys.argv[1]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
with open(path, newline="") as f:
    reader = csv.reader(f)
    next(reader)  # "Kernel Name", name
    header = next(reader)
    rows = [dict(zip(header, r)) for r in reader if len(r) >= len(header) - 1]
SAMPLES = "Warp Stall Sampling (All Samples)"
stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
total = sum(num(r[SAMPLES]) for r in rows) or 1.0
print(f"{sum(num(r['Instructions Executed']) for r in rows):,.0f} warp instructions executed, {total:,.0f} stall samples, {len(rows)} SASS lines")
by_reason = sorted(((s[6:], sum(num(r[s]) for r in rows)) for s in stalls), key=lambda kv: -kv[1])
print("stalls: " + ", ".join(f"{s} {100 * v / total:.1f}%" for s, v in by_reason if v > 0.005 * total))
lines = sorted(range(len(rows)), key=lambda i: -num(rows[i][SAMPLES]))[:top]
for i in sorted(lines):
    r = rows[i]
    reasons = sorted(((s[6:], num(r[s])) for s in stalls), key=lambda kv: -kv[1])[:3]
    why = " ".join(f"{s}:{v:.0f}" for s, v in reasons if v > 0)
    print(f"{i:5d} {100 * num(r[SAMPLES]) / total:6.2f}% inst {num(r['Instructions Executed']):10,.0f}  {r['Source'].strip()[:60]:<60} {why}")
