"""GPU: flash_attn_varlen_func with the Gluon kernels' varlen paths off and on (heuristics.GLUON_VARLEN), forward and
backward, beside flash_attn_func over the same tokens where the lengths are equal. bf16, 2048/d heads, TFLOP/s of
the attention the sequences hold (per-sequence causal or full), backward = 2.5 x forward FLOPs / its time.

Usage on the H200: `python benchmarks/varlen_ab.py [--dims 128,64]`. Rows: equal lengths (the work of a dense
batch) and a serving-like mix; `off` is the Triton path varlen takes today, `on` the Gluon one, `dense`
flash_attn_func where the lengths are equal. `on` is compared with `off` (ERR: outputs or gradients differ by more
than 5% of the largest value).
"""
import argparse
import sys

import torch

sys.path.insert(0, ".")
import tileflash  # noqa: E402
from tileflash import heuristics  # noqa: E402
from tileflash.bench.formulas import attn_fwd_flops  # noqa: E402
from tileflash.bench.timing import bench_ms  # noqa: E402
from tileflash.ops import direct  # noqa: E402

direct.ENABLED = False  # this script swaps heuristics and launchers, which cached plans would outlive

parser = argparse.ArgumentParser()
parser.add_argument("--dims", default="128,64")
args = parser.parse_args()
MIXES = {"4 x 4096": [4096] * 4, "16 x 1024": [1024] * 16, "mixed": [5000, 3000, 2500, 2000, 1500, 1000, 700, 300]}


def timed(forward, inputs, dout, backward):
    """(ms, outputs): the forward alone, or the backward of one forward's output with gradient dout (dQ/dK/dV of
    inputs)."""
    if not backward:
        return bench_ms(forward), (forward(),)
    out = forward()
    grads = lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)  # noqa: E731
    return bench_ms(grads), grads()


def differs(got, ref):
    return max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item() for g, r in zip(got, ref)) > 0.05


rows = []
for d in map(int, args.dims.split(",")):
    h = 2048 // d
    for causal in (False, True):
        for name, lens in MIXES.items():
            packed = [torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                      for _ in range(3)]
            cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
            dout = torch.randn_like(packed[0])
            fwd_flops = sum(attn_fwd_flops(1, h, s, s, d, causal) for s in lens)
            row = [d, causal, name]
            for backward in (False, True):
                flops = fwd_flops * (2.5 if backward else 1)
                results = {}
                for mode in ("off", "on"):
                    heuristics.GLUON_VARLEN = mode == "on"
                    results[mode] = timed(lambda: tileflash.flash_attn_varlen_func(
                        *packed, cu, cu, max(lens), max(lens), causal=causal), packed, dout, backward)
                heuristics.GLUON_VARLEN = False
                bad = differs(results["on"][1], results["off"][1])
                row += [f"{flops / results['off'][0] / 1e9:.1f}",
                        f"{flops / results['on'][0] / 1e9:.1f}" + (" ERR" if bad else "")]
                if len(set(lens)) == 1:
                    dense = [t.detach().view(len(lens), lens[0], h, d).requires_grad_() for t in packed]
                    ms, _ = timed(lambda: tileflash.flash_attn_func(*dense, causal=causal), dense,
                                  dout.view(len(lens), lens[0], h, d), backward)
                    row.append(f"{flops / ms / 1e9:.1f}")
                else:
                    row.append("-")
            rows.append(row)
            print(row, flush=True)
print("| d | causal | lengths | fwd off | fwd on | fwd dense | bwd off | bwd on | bwd dense |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(str(x) for x in r) + " |")
