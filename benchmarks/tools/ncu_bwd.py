"""One forward + backward at 16k tokens, 2048/d heads, bf16 (the `bench backward` shape) for Nsight Compute:
`ncu --clock-control none --set full -k regex:attn_bwd_ws -c 1 -o REP python3 benchmarks/ncu_bwd.py D CAUSAL S`,
then `ncu -i REP.ncu-rep --page source --csv --print-source sass` gives warp-stall samples per SASS instruction
(`benchmarks/ncu_source_summary.py SRC.csv --loops` condenses that CSV: where each consumer step spends its
samples between its barriers)."""
import sys

import torch

import tileflash

d, causal, s = int(sys.argv[1]), bool(int(sys.argv[2])), int(sys.argv[3])
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = tileflash.flash_attn_func(q, k, v, causal=causal)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("done", d, causal, s)
