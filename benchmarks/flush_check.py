"""How the L2 state before a timed call moves decode times (GPU only): `python benchmarks/flush_check.py`.

triton's do_bench zeroes a 256 MB buffer before each timed call: the L2 (50 MB on the H200) is then full of dirty
lines, and the timed kernel pays their write-back (~50 MB, ~12 us at 4.25 TB/s) on top of its own reads. Two
other cold-L2 methods leave the L2 clean: reading the 256 MB buffer instead of writing it, and rotating over
several input sets whose total is several times the L2 (METHOD.md's advice), with no flush at all. Same CUDA
graphs, same inputs, tileflash and torch SDPA side by side.
"""
import sys

import torch
import torch.nn.functional as F

import tileflash
from tileflash.bench.table import format_table
from tileflash.bench.timing import bench_ms, graphed

SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 32768), (32, 8192)]  # (batch, ctx), 32 / 8 heads, d = 128
L2_BYTES = 50 * 2 ** 20


def _event_median_us(calls, before=None, reps=60):
    """Median of per-call device time; calls are cycled (rotation), before() runs untimed ahead of each."""
    times = []
    for i in range(reps + 5):
        fn = calls[i % len(calls)]
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def _sets(b, ctx, n):
    sets = []
    for _ in range(n):
        q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, ctx, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        kt, vt = (x.transpose(1, 2).contiguous() for x in (k, v))
        tf = graphed(lambda q=q, k=k, v=v, lens=lens: tileflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens))
        sd = graphed(lambda q=q, kt=kt, vt=vt: F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt,
                                                                             enable_gqa=True))
        sets.append((tf, sd))
        del kt, vt
    return sets


def main():
    flush = torch.empty(2 ** 26, device="cuda", dtype=torch.float32)  # 256 MB
    rows = []
    for b, ctx in SHAPES:
        nbytes = 2 * b * ctx * 8 * 128 * 2
        n = max(2, -(-3 * L2_BYTES // nbytes) + 1)  # rotation: >= 3x the L2 between two uses of one set
        sets = _sets(b, ctx, n)
        for name, pick in (("tileflash", 0), ("SDPA", 1)):
            calls = [s[pick] for s in sets]
            zero = bench_ms(calls[0]) * 1e3
            read = _event_median_us(calls[:1], before=lambda: flush.sum())
            rot = _event_median_us(calls)
            rows.append([b, ctx, name, *(f"{t:.1f} ({nbytes / t / 1e6:.2f})" for t in (zero, read, rot)), n])
            print(rows[-1], flush=True)
        del sets
        torch.cuda.empty_cache()
    print(format_table(["B", "ctx", "kernel", "zero-flush us (TB/s)", "read-flush us (TB/s)",
                        "rotating sets us (TB/s)", "sets"], rows,
                       title="decode graph replay vs L2 state before the call (bf16, 32/8 heads, d=128)"))


if __name__ == "__main__":
    sys.exit(main())
