"""GPU: tiles of the warp-specialised forward (kernels/attn_fwd_ws.py) beside cuDNN, bf16, 16k tokens, 2048/d heads.

Usage on the H200: `python benchmarks/ws_sweep.py`. Prints one row per (d, causal, s): cuDNN's TFLOP/s, then each
(keys per step, K stages, V stages) variant's, marked ERR when its output strays from cuDNN's.
heuristics.fwd_ws_config holds the picks (runs 59 and 107 in benchmarks/RESULTS.md).
"""
import sys

import torch

sys.path.insert(0, ".")
from tileflash.bench import peers  # noqa: E402
from tileflash.bench.formulas import attn_fwd_flops  # noqa: E402
from tileflash.bench.timing import bench_ms  # noqa: E402
from tileflash.heuristics import WsFwdConfig  # noqa: E402
from tileflash.ops._launch import launch_attn_fwd_ws  # noqa: E402

VARIANTS = {128: [(128, 3, 3), (128, 4, 2)], 64: [(128, 3, 3), (128, 4, 4), (64, 4, 4)], 256: [(64, 2, 2), (64, 3, 2)]}
rows = []
for d in (128, 64, 256):
    for causal in (False, True):
        for s in (1024, 2048, 4096, 16384):
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = attn_fwd_flops(b, h, s, s, d, causal)
            cudnn = peers.sdpa_prefill(q, k, v, causal, "cudnn", print)
            ref = cudnn()
            row = [d, causal, s, flops / bench_ms(cudnn) / 1e9]
            for tiles in VARIANTS[d]:
                out = torch.full_like(q, float("nan"))
                lse = torch.empty(b, h, s, device="cuda")
                fn = lambda: launch_attn_fwd_ws(q, k, v, out, lse, causal=causal, softmax_scale=d ** -0.5,  # noqa
                                                config=WsFwdConfig(*tiles))
                fn()
                err = (out.float() - ref.float()).abs().max().item()
                t = flops / bench_ms(fn) / 1e9
                row.append(f"{t:.1f}" + ("" if err < 0.05 else f" ERR {err:.2f}"))
            rows.append(row)
            print(row, flush=True)
for r in rows:
    print("| " + " | ".join(str(x) if not isinstance(x, float) else f"{x:.1f}" for x in r) + " |")
