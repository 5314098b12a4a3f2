"""GPU: the register-operand NVFP4 GEMM (kernels/gemm_nvfp4_mma.py) at decode-sized M, its split / N-tiles-per-
program choices beside the Triton kernel and torch's bf16 matmul, CUDA-graph replay, microseconds.

Usage on the H200: `python benchmarks/gemm_mma_sweep.py [--m 1,16] [--nk 4096,8192] [--variants "0,0;2,1;4,2"]`.
A variant is (split_k, tiles per program) for heuristics.gemm_mma_config (0: the heuristic's choice); `triton` in
the table is the Triton kernel (gemm_blockscaled.py) with its own heuristic tiles. Every result is checked against
a.float() @ dequant(b).T first (ERR when the 2x rule fails).
"""
import argparse
import sys

import torch

sys.path.insert(0, ".")
from tileflash.bench.timing import bench_graph_ms  # noqa: E402
from tileflash.formats import nvfp4_dequantize_ref  # noqa: E402
from tileflash.heuristics import gemm_mma_config  # noqa: E402
from tileflash.ops import gemm  # noqa: E402
from tileflash.ops.quant import nvfp4_quantize  # noqa: E402
from tileflash.ops import direct  # noqa: E402

direct.ENABLED = False  # this script swaps heuristics and launchers, which cached plans would outlive

parser = argparse.ArgumentParser()
parser.add_argument("--m", default="1,16")
parser.add_argument("--nk", default="4096,8192")
parser.add_argument("--variants", default="0,0;8,1;8,4;16,2;16,4")
args = parser.parse_args()
VARIANTS = [tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")]


def ok(out, a, w):
    ref = a.float() @ w.T
    lowp = (a @ w.to(a.dtype).T).float()
    return (out.float() - ref).abs().max() <= 2 * (lowp - ref).abs().max() + 1e-5 * ref.abs().max()


def triton_path(a, b_q):
    saved = gemm.sm90_target
    gemm.sm90_target = lambda: False
    try:
        return gemm._nvfp4_matmul_impl(a, *b_q)
    finally:
        gemm.sm90_target = saved


rows = []
for nk in map(int, args.nk.split(",")):
    w_full = torch.randn(nk, nk, device="cuda")
    b_q = nvfp4_quantize(w_full)
    w = nvfp4_dequantize_ref(*b_q)
    for m in map(int, args.m.split(",")):
        a = torch.randn(m, nk, device="cuda", dtype=torch.bfloat16)
        row = {"m": m, "nk": nk}
        wb = w_full.to(torch.bfloat16)
        row["bf16"] = bench_graph_ms(lambda: a @ wb.T) * 1e3
        out = triton_path(a, b_q)
        row["triton"] = bench_graph_ms(lambda: triton_path(a, b_q)) * 1e3 if ok(out, a, w) else "ERR"
        for split, per in VARIANTS:
            cfg = gemm_mma_config(m, nk, nk, tiles_per_program=per, split_k=split)
            plan = gemm.GemmPlan(a, b_q[0], b_q[1], mma_config=cfg)
            out = plan.run(a, *b_q)
            fn = lambda plan=plan: plan.run(a, *b_q)  # noqa: E731
            row[f"{split},{per}"] = bench_graph_ms(fn) * 1e3 if ok(out, a, w) else "ERR"
        rows.append(row)
        print(row, flush=True)

keys = list(rows[0])
print("\nNVFP4 GEMM, graph replay, us (variant = split_k,tiles per program asked; 0 = heuristic)")
print(" | ".join(f"{k:>14}" for k in keys))
for r in rows:
    cells = (r.get(k) for k in keys)
    print(" | ".join(f"{c:>14.1f}" if isinstance(c, float) else f"{str(c):>14}" for c in cells))
