"""Condense `ncu -i REP --page source --csv --print-source sass` output: stall reasons over the whole kernel, then
the instructions holding at least --min-pct percent of the warp-stall samples, in program order, with their offset,
share, two largest stall reasons and excess shared-memory wavefronts (bank conflicts). With --loops, each hot loop
(a backward branch executed more than --min-exec times) instead, with its share of the samples, every
synchronisation instruction (barriers, mbarrier waits/arrives, wgmma waits, fences, TMA) and every instruction
above --min-pct of the loop's samples, with the running share: where a step's time goes between its barriers.
Usage: `python benchmarks/ncu_source_summary.py SRC.csv [--min-pct 0.4] [--loops [--min-exec 100000]]`."""
import argparse
import csv

SYNC = ("BAR.SYNC", "TRYWAIT", "DEPBAR", "UTMA", "ARRIVE.TRANS", "FENCE", "MEMBAR")

parser = argparse.ArgumentParser()
parser.add_argument("csv")
parser.add_argument("--min-pct", type=float, default=0.4)
parser.add_argument("--loops", action="store_true")
parser.add_argument("--min-exec", type=int, default=100000)
args = parser.parse_args()
rows = list(csv.reader(open(args.csv, newline="")))
start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
header, body = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
col = {name: i for i, name in enumerate(header)}
reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
base = int(body[0][0], 16)


def num(r, name):
    try:
        return float(r[col[name]].replace(",", ""))
    except (KeyError, ValueError):
        return 0.0


def offset(r):
    return int(r[0], 16) - base


def samples(r):
    return num(r, "Warp Stall Sampling (All Samples)")


def why(r):
    v = samples(r)
    top = sorted(((num(r, c), c[6:]) for c in reasons), reverse=True)[:2]
    return " ".join(f"{c}:{100 * s / v:.0f}%" for s, c in top if s and v)


total = sum(samples(r) for r in body)
print(f"total samples {total:.0f} over {len(body)} instructions")
print("by reason:", ", ".join(f"{c[6:]} {100 * s / total:.1f}%" for s, c in
                              sorted(((sum(num(r, c) for r in body), c) for c in reasons), reverse=True)[:8]))
if not args.loops:
    for r in body:
        v = samples(r)
        if 100 * v / total >= args.min_pct:
            excess = num(r, "L1 Wavefronts Shared Excessive")
            print(f"{100 * v / total:5.1f}% {offset(r):6x} {r[1].strip()[:70]:70} {why(r)}"
                  + (f" smem-excess {excess:.0f}" if excess else ""))
else:
    loops = []
    for r in body:  # a loop: a branch back to a lower address, taken many times
        src = r[1].strip()
        if "BRA" in src and num(r, "Instructions Executed") > args.min_exec:
            try:
                target = int(src.split("BRA")[1].split()[0].rstrip(";"), 16) - base
            except ValueError:
                continue
            # innermost loops of more than a few instructions (not a wait's spin, not a partition's outer loop)
            if offset(r) - target > 0x80 and not any(target <= lo and hi <= offset(r) for lo, hi in loops):
                loops.append((target, offset(r)))
    for lo, hi in sorted(loops):
        inside = [r for r in body if lo <= offset(r) <= hi]
        loop_total = sum(samples(r) for r in inside)
        if loop_total < 0.05 * total:
            continue
        print(f"\nloop {lo:x}-{hi:x}: {100 * loop_total / total:.1f}% of all samples")
        running = 0.0
        for r in inside:
            v, src = samples(r), r[1].strip()
            running += v
            if 100 * v / loop_total >= args.min_pct or any(k in src for k in SYNC):
                print(f"{offset(r):6x} {100 * v / loop_total:5.1f}% cum {100 * running / loop_total:5.1f}% "
                      f"{src[:70]:70} {why(r)}")
