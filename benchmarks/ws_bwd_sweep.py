"""GPU: variants of the warp-specialised dK/dV kernel (kernels/attn_bwd_ws.py) beside the Triton backward and
cuDNN, bf16, 16k tokens, 2048/d heads, TFLOP/s = 2.5 x forward FLOPs / t of the whole backward (preprocess, dK/dV,
dQ).

Usage on the H200: `python benchmarks/ws_bwd_sweep.py [--dims 128,64] [--seqlens 1024,4096,16384]
[--variants "triton;64,2,1;128,2,1,0"]`. One row per (d, causal, s): cuDNN, then each variant: `triton` (the Triton
kernels) or heuristics.WsBwdConfig's fields in order (query rows per step, stages, atomic dQ, one fence, keys-major,
dQ by rows; 0/1 for the flags, trailing ones may be left out), marked ERR when a gradient strays from cuDNN's by more than 5% of its largest value. The same config serves
every shape of a run, so pass one --dims per call when the rows per step differ. heuristics.bwd_ws_config holds
the picks.
"""
import argparse
import sys

import torch

sys.path.insert(0, ".")
from tileflash import flash_attn_func  # noqa: E402
from tileflash.bench import peers  # noqa: E402
from tileflash.bench.formulas import attn_bwd_flops  # noqa: E402
from tileflash.bench.timing import bench_ms  # noqa: E402
from tileflash.heuristics import WsBwdConfig  # noqa: E402
from tileflash.ops import backward  # noqa: E402
from tileflash.ops import direct  # noqa: E402

direct.ENABLED = False  # this script swaps heuristics and launchers, which cached plans would outlive

DEFAULT_VARIANTS = "triton;64,2,1;64,2,0"  # triton: the Triton kernels; else WsBwdConfig's fields

parser = argparse.ArgumentParser()
parser.add_argument("--dims", default="128,64")
parser.add_argument("--seqlens", default="1024,4096,16384")
parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="';'-separated: triton or WsBwdConfig fields")
args = parser.parse_args()
VARIANTS = [None if v == "triton" else tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")]
original = backward.bwd_ws_config
rows = []
for d in map(int, args.dims.split(",")):
    for causal in (False, True):
        for s in map(int, args.seqlens.split(",")):
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
            flops = attn_bwd_flops(b, h, s, s, d, causal)

            def timed(forward):
                out = forward()
                grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                ms = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                return grads, flops / ms / 1e9

            ref, t_ref = timed(peers.sdpa_prefill(q, k, v, causal, "cudnn", print))
            row = [d, causal, s, f"{t_ref:.1f}"]
            for var in VARIANTS:
                cfg = None if var is None else WsBwdConfig(*(bool(x) if i > 1 else x for i, x in enumerate(var)))
                backward.bwd_ws_config = lambda head_dim, c, sk, cfg=cfg: cfg
                try:
                    grads, t = timed(lambda: flash_attn_func(q, k, v, causal=causal))
                    err = max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                              for g, r in zip(grads, ref))
                    row.append(f"{t:.1f}" + ("" if err < 0.05 else f" ERR {err:.2f}"))
                except Exception as e:  # noqa: BLE001 - report the variant and go on
                    row.append(f"FAIL {type(e).__name__}")
                backward.bwd_ws_config = original
            rows.append(row)
            print(row, flush=True)
print("| d | causal | s | cuDNN | " + " | ".join(str(v or "triton") for v in VARIANTS) + " |")
for r in rows:
    print("| " + " | ".join(str(x) for x in r) + " |")
