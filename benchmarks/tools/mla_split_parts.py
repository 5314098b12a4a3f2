"""Where a split MLA decode's time goes (issue 28: H=128 b=1 ctx 32k is asked <= 20 us; run 317 measured 32.6).
`python3 benchmarks/tools/mla_split_parts.py [H] [B]` (default 128 1) on the GPU machine.

1. CUDA-graph replay over cache copies past twice the L2 (bench.timing.rotating_graph_ms, as `bench decode`) at
   ctx 2k..32k and 16 / 32 / 64 splits and the planner's count. At a fixed split count the grid is fixed and each
   CTA's share of blocks grows with ctx, so per split count the slope over ctx is the streaming + MMA cost per block
   and the intercept the fixed part: launch, first loads, partial writes and the combine.
2. The profiler's kernel times for one call of each (ctx, splits): the MLA kernel against the split combine."""
import sys

import torch

from tileflash.bench.sweep import FAMILIES
from tileflash.bench.timing import rotating_graph_ms

H = int(sys.argv[1]) if len(sys.argv) > 1 else 128  # query heads
B = int(sys.argv[2]) if len(sys.argv) > 2 else 1  # batch
CONTEXTS = (2048, 4096, 8192, 16384, 32768)
SPLITS = (16, 32, 64, 0)  # 0: the planner's count


def calls(ctx: int, num_splits: int):
    """One decode call per cache copy: the inputs `sweep decode-mla-gluon` times."""
    return FAMILIES["decode-mla-gluon"].make((B, ctx, H), {"num_splits": num_splits})[0]


def kernel_us(fn) -> dict:
    """us per call of each CUDA kernel fn launches (torch.profiler, 10 calls)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    return {e.key[:40]: round(e.device_time_total / 10, 2) for e in prof.key_averages() if e.device_time_total > 0}


def main():
    print(f"MLA H={H} b={B}: graph replay us per call (cache copies past twice the L2)", flush=True)
    firsts = {}
    for ctx in CONTEXTS:
        for ns in SPLITS:
            fns = calls(ctx, ns)
            us = rotating_graph_ms(fns) * 1e3
            firsts[(ctx, ns)] = (fns[0], us)
            print(f"ctx {ctx:6d} splits {ns or 'plan':>4}: {us:7.2f} us", flush=True)
        torch.cuda.empty_cache()
    for (ctx, ns), (fn, us) in firsts.items():  # after all timing: the profiler slows what runs beside it
        print(f"ctx {ctx:6d} splits {ns or 'plan':>4}: graph {us:7.2f} us, kernels {kernel_us(fn)}", flush=True)


if __name__ == "__main__":
    main()
