"""How many KV splits should a decode call use? CUDA-graph replay time for forced num_splits on the shapes where
the heuristic matters (few sequences x KV heads). Run on the GPU: `python benchmarks/splits_sweep.py`.
`--quant`: the same for fp8 and nvfp4 caches. `--parts`: graph-replay time of a split call and of its two kernels
alone (attention with fp32 partials, combine), to see what the combine costs at small batch. `--small`: SMALL_SHAPES
(MQA 8/1 heads as in `bench decode`, batches near one program per SM, head dim 64, page 16). `--lengths`: batch-1
MQA from 8k to 128k tokens and small-batch GQA at counts up to 256 (how short a split may get). `--pdl`: the split
combine with and without programmatic dependent launch (ops.decode._combine_pdl forced each way, alternating, two
timings each) on contiguous and paged caches. `--flush-read`: time with bench.timing's read flush (clean L2)."""
import sys

import torch

import tileflash
from tileflash.bench.table import format_table
from tileflash.bench.timing import bench_ms, graphed

from config_sweep import _paged, quantized_caches  # benchmarks/ is the script's directory
from tileflash.ops import direct

direct.ENABLED = False  # this script swaps heuristics and launchers, which cached plans would outlive

SHAPES = [(1, 8192, 32, 8), (1, 32768, 32, 8), (1, 131072, 32, 8), (8, 32768, 32, 8), (1, 32768, 8, 1),
          (1, 131072, 8, 1), (32, 8192, 32, 8)]
SPLITS = [1, 2, 4, 8, 16, 33, 50, 66, 99, 132, 198, 256]


# The bench's MQA rows (8 query heads on 1 KV head), rows near one program per SM (where rounding the split count
# up doubles the programs), head dim 64, and paged page 16 at batch 1: (B, ctx, Hq, Hkv, head dim, page size).
SMALL_SHAPES = [(1, 8192, 8, 1, 128, 0), (1, 32768, 8, 1, 128, 0), (1, 131072, 8, 1, 128, 0),
                (8, 8192, 8, 1, 128, 0), (32, 2048, 8, 1, 128, 0), (128, 1024, 8, 1, 128, 0),
                (256, 2048, 8, 1, 128, 0), (32, 2048, 32, 8, 128, 0), (32, 2048, 32, 8, 64, 0),
                (128, 1024, 32, 8, 64, 0), (1, 8192, 32, 8, 128, 16), (1, 8192, 32, 8, 128, 0)]


def main(fmt="bf16", shapes=SHAPES, splits=SPLITS):
    rows = []
    for b, ctx, hq, hkv, *more in shapes:  # optional: head dim (128), page size (0: contiguous)
        d, page = more if more else (128, 0)
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kh, vh = (torch.randn(b, ctx, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kc, vc, kw, _, _, _ = quantized_caches(kh, vh, {"bf16": "16bit"}.get(fmt, fmt))
        if page:
            kc, vc, kw["block_table"] = _paged(kc, vc, page, torch.Generator().manual_seed(0))
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        times = {}
        for n in [0] + list(splits):
            if b * hkv * n > 8 * 132 * 4:
                continue
            fn = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=n,  # noqa: E731
                                                           **kw)
            times[n] = bench_ms(graphed(fn)) * 1e3
        best = min((t, n) for n, t in times.items() if n)
        heads = f"{hq}/{hkv} d{d}" + (f" page{page}" if page else "")
        rows.append([b, ctx, heads, f"{times[0]:.1f}", f"{best[0]:.1f} @ {best[1]}",
                     " ".join(f"{n}:{t:.1f}" for n, t in times.items() if n)])
        print(rows[-1], flush=True)
    print(format_table(["B", "ctx", "heads", "heuristic us", "best us @ splits", "all"], rows,
                       title=f"decode graph-replay time vs num_splits ({fmt} cache)"))


def parts():
    from tileflash.ops import _launch, decode as decode_ops

    rows = []
    for b, ctx, hq, hkv in SHAPES[:2] + [(32, 2048, 32, 8)]:
        q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, ctx, hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        cfg, splits, capacity = decode_ops._plan(q, kc, None, 0)
        out, lse = torch.empty_like(q), torch.empty(b, hq, 1, device="cuda")
        o_part = torch.empty(splits, b * hq, 128, device="cuda")
        lse_part = torch.empty(splits, b * hq, device="cuda")

        def attn():
            _launch.launch_attn_fwd(q, kc, vc, out, lse, q_batch_stride0=False, k_batch_stride0=False,
                                    num_batches=b, seqlen_q=1, seqlen_k=capacity, m_rows=hq // hkv,
                                    softmax_scale=128 ** -0.5, mask=_launch.Mask(-1, 0, 0.0), config=cfg,
                                    seqlens_k=lens, pack_gqa=True, num_splits=splits, o_part=o_part,
                                    lse_part=lse_part)

        full = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)  # noqa: E731
        t = [bench_ms(graphed(f)) * 1e3 for f in (full, attn, lambda: _launch.launch_combine(o_part, lse_part,
                                                                                              out, lse))]
        rows.append([b, ctx, splits, *(f"{x:.1f}" for x in t)])
        print(rows[-1], flush=True)
    print(format_table(["B", "ctx", "splits", "call us", "attention us", "combine us"], rows,
                       title="decode parts, CUDA-graph replay (bf16, d=128, 32/8 heads)"))


# (B, ctx, Hq, Hkv, page size): contiguous (PDL taken, session 14) and paged caches (PDL not taken, run 107).
PDL_SHAPES = [(1, 8192, 32, 8, 0), (1, 32768, 32, 8, 0), (8, 8192, 32, 8, 0), (1, 8192, 32, 8, 16),
              (1, 32768, 32, 8, 16), (8, 8192, 32, 8, 16), (8, 8192, 32, 8, 64), (1, 32768, 32, 8, 64),
              (8, 32768, 32, 8, 16)]


def pdl_sweep():
    from tileflash.ops import decode as decode_ops

    picked = decode_ops._combine_pdl
    rows = []
    for b, ctx, hq, hkv, page in PDL_SHAPES:
        q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, ctx, hkv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kw = {}
        if page:
            kc, vc, kw["block_table"] = _paged(kc, vc, page, torch.Generator().manual_seed(0))
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        fn = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **kw)  # noqa: E731
        times = {True: [], False: []}
        for on in (True, False, True, False):
            decode_ops._combine_pdl = lambda table, on=on: on
            times[on].append(bench_ms(graphed(fn)) * 1e3)
        decode_ops._combine_pdl = picked
        splits = decode_ops._plan(q, kc, kw.get("block_table"), 0)[1]
        rows.append([b, ctx, f"{hq}/{hkv}", page or "-", splits, picked(kw.get("block_table")),
                     *(" / ".join(f"{t:.1f}" for t in times[on]) for on in (True, False))])
        print(rows[-1], flush=True)
    print(format_table(["B", "ctx", "heads", "page", "splits", "PDL taken?", "PDL us", "no PDL us"], rows,
                       title="split combine with / without programmatic dependent launch (bf16, d=128, graph replay)"))


if __name__ == "__main__":
    if "--flush-read" in sys.argv:
        from tileflash.bench import timing

        timing.flush_mode = "read"
    if "--pdl" in sys.argv:
        pdl_sweep()
    elif "--parts" in sys.argv:
        parts()
    elif "--quant" in sys.argv:  # the quantized caches on the shapes where splits matter
        for fmt in ("fp8", "nvfp4"):
            main(fmt, [(1, 32768, 32, 8), (8, 32768, 32, 8), (32, 8192, 32, 8), (64, 4096, 32, 8),
                       (256, 2048, 32, 8)])
    elif "--lengths" in sys.argv:  # the shortest split worth a program: b=1 MQA at growing contexts, GQA beside
        main("bf16", [(1, ctx, 8, 1, 128, 0) for ctx in (8192, 16384, 32768, 65536, 131072)]
             + [(1, 8192, 32, 8, 128, 0), (1, 32768, 32, 8, 128, 0), (8, 8192, 32, 8, 128, 0),
                (8, 32768, 32, 8, 128, 0)], (4, 5, 8, 16, 32, 33, 64, 66, 96, 128, 132, 192, 256))
    elif "--small" in sys.argv:
        main("bf16", SMALL_SHAPES, (1, 2, 3, 4, 8, 16, 33, 66, 132))
    else:
        main()
