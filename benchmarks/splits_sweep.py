"""How many KV splits should a decode call use? CUDA-graph replay time for forced num_splits on the shapes where
the heuristic matters (few sequences x KV heads). Run on the GPU: `python benchmarks/splits_sweep.py`."""
import torch

import tileflash
from tileflash.bench.table import format_table
from tileflash.bench.timing import bench_ms, graphed

SHAPES = [(1, 8192, 32, 8), (1, 32768, 32, 8), (1, 131072, 32, 8), (8, 32768, 32, 8), (1, 32768, 8, 1),
          (1, 131072, 8, 1), (32, 8192, 32, 8)]
SPLITS = [1, 2, 4, 8, 16, 33, 50, 66, 99, 132, 198, 256]


def main():
    rows = []
    for b, ctx, hq, hkv in SHAPES:
        q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, ctx, hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        times = {}
        for n in [0] + SPLITS:
            if b * hkv * n > 8 * 132 * 4:
                continue
            fn = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=n)  # noqa: E731
            times[n] = bench_ms(graphed(fn)) * 1e3
        best = min((t, n) for n, t in times.items() if n)
        rows.append([b, ctx, hkv, f"{times[0]:.1f}", f"{best[0]:.1f} @ {best[1]}",
                     " ".join(f"{n}:{t:.1f}" for n, t in times.items() if n)])
        print(rows[-1], flush=True)
    print(format_table(["B", "ctx", "Hkv", "heuristic us", "best us @ splits", "all"], rows,
                       title="decode graph-replay time vs num_splits (bf16, d=128)"))


if __name__ == "__main__":
    main()
