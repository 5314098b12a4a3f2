"""Condense `ncu -i REP --page source --csv --print-source sass` output: stall reasons over the whole kernel, then
the instructions holding at least --min-pct percent of the warp-stall samples, in program order, with their offset,
share, two largest stall reasons and excess shared-memory wavefronts (bank conflicts).
Usage: `python benchmarks/ncu_source_summary.py SRC.csv [--min-pct 0.4]`."""
import argparse
import csv

parser = argparse.ArgumentParser()
parser.add_argument("csv")
parser.add_argument("--min-pct", type=float, default=0.4)
args = parser.parse_args()
rows = list(csv.reader(open(args.csv, newline="")))
start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
header, body = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
col = {name: i for i, name in enumerate(header)}


def num(r, name):
    try:
        return float(r[col[name]].replace(",", ""))
    except (KeyError, ValueError):
        return 0.0


reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
total = sum(num(r, "Warp Stall Sampling (All Samples)") for r in body)
base = int(body[0][0], 16)
print(f"total samples {total:.0f} over {len(body)} instructions")
print("by reason:", ", ".join(f"{c[6:]} {100 * s / total:.1f}%" for s, c in
                              sorted(((sum(num(r, c) for r in body), c) for c in reasons), reverse=True)[:8]))
for r in body:
    v = num(r, "Warp Stall Sampling (All Samples)")
    if 100 * v / total < args.min_pct:
        continue
    top = sorted(((num(r, c), c[6:]) for c in reasons), reverse=True)[:2]
    why = " ".join(f"{c}:{100 * s / v:.0f}%" for s, c in top if s)
    excess = num(r, "L1 Wavefronts Shared Excessive")
    print(f"{100 * v / total:5.1f}% {int(r[0], 16) - base:6x} {r[1].strip()[:70]:70} {why}"
          + (f" smem-excess {excess:.0f}" if excess else ""))
