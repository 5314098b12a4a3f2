"""GPU: the register-operand quantized-cache decode (kernels/decode_quant_mma.py) over tile variants, beside the
Triton decode kernel, CUDA-graph replay of the whole flash_attn_with_kvcache call (split combine included), us.

Usage on the H200: `python benchmarks/decode_quant_sweep.py [--fmt fp8,nvfp4] [--grid "1,8192;8,32768"]
[--variants "32,2;16,3"]`. A variant is (tokens per warp step, programs per SM the split count aims at) for
heuristics.QuantDecodeConfig; `triton` is attn_fwd's decode with its own tiles. 32/8
heads, d=128, bf16 queries, cache_seqlens = ctx. Each variant's output is checked against the Triton kernel's
(max |diff| <= 1e-2 * max |out|, else ERR).
"""
import argparse
import sys

import torch

sys.path.insert(0, ".")
import tileflash  # noqa: E402
from tileflash.bench.timing import bench_graph_ms  # noqa: E402
from tileflash.heuristics import QuantDecodeConfig  # noqa: E402
from tileflash.ops import decode as decode_ops  # noqa: E402
from tileflash.ops.quant import fp8_quantize, nvfp4_quantize  # noqa: E402
from tileflash.ops import direct  # noqa: E402

direct.ENABLED = False  # this script swaps heuristics and launchers, which cached plans would outlive

parser = argparse.ArgumentParser()
parser.add_argument("--fmt", default="fp8,nvfp4")
parser.add_argument("--grid", default="1,8192;1,32768;1,131072;8,8192;8,32768;32,2048;32,8192;64,4096;128,1024;"
                                      "256,2048")
parser.add_argument("--variants", default="32,2;16,3")
parser.add_argument("--hq", type=int, default=32)
parser.add_argument("--hkv", type=int, default=8)
args = parser.parse_args()
VARIANTS = [tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")]
HQ, HKV, D = args.hq, args.hkv, 128


def caches(fmt, b, ctx):
    k = torch.randn(b, ctx, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if fmt == "fp8":
        (kc, ks), (vc, vs) = fp8_quantize(k), fp8_quantize(v)
        return kc, vc, dict(k_scale=ks.reshape(1), v_scale=vs.reshape(1))
    (kc, kbs, kg), (vc, vbs, vg) = nvfp4_quantize(k), nvfp4_quantize(v)
    return kc, vc, dict(k_scale=kbs, v_scale=vbs, k_global_scale=kg.reshape(1), v_global_scale=vg.reshape(1))


def with_config(cfg, fn):
    saved = decode_ops._quant_mma_config
    decode_ops._quant_mma_config = lambda *a, **k: cfg
    try:
        return fn()
    finally:
        decode_ops._quant_mma_config = saved


rows = []
for fmt in args.fmt.split(","):
    for b, ctx in (tuple(int(x) for x in s.split(",")) for s in args.grid.split(";")):
        kc, vc, scales = caches(fmt, b, ctx)
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        call = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **scales)  # noqa: E731
        row = {"fmt": fmt, "b": b, "ctx": ctx}
        ref = with_config(None, call)
        row["triton"] = bench_graph_ms(lambda: with_config(None, call)) * 1e3
        for bn, per_sm in VARIANTS:
            cfg = QuantDecodeConfig(block_n=bn, num_warps=4, programs_per_sm=per_sm)
            out = with_config(cfg, call)
            good = (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
            row[f"{bn},{per_sm}"] = bench_graph_ms(lambda: with_config(cfg, call)) * 1e3 if good else "ERR"
        rows.append(row)
        print(row, flush=True)
        del kc, vc, scales

keys = list(rows[0])
print(f"\nQuantized decode, {HQ}/{HKV} heads, d={D}, graph replay, us (variant = tokens per warp step, programs per "
      f"SM)")
print(" | ".join(f"{k:>10}" for k in keys))
for r in rows:
    print(" | ".join(f"{c:>10.1f}" if isinstance(c, float) else f"{str(c):>10}" for c in (r.get(k) for k in keys)))
