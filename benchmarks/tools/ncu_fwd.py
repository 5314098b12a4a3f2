"""One forward at 16k tokens, 2048/d heads, bf16 (the `bench prefill` shape) for Nsight Compute, to compare the
warp-specialised forward's consumer loop at short and long rows (s=1k: 59% tensor pipe, 4k: 71%; run 183):
`ncu --clock-control none --set full -k regex:attn_fwd_ws -c 1 -o REP python3 benchmarks/tools/ncu_fwd.py D CAUSAL S`,
then `ncu -i REP.ncu-rep --page source --csv --print-source sass > SRC.csv` and
`python benchmarks/tools/ncu_source_summary.py SRC.csv --loops` (where each consumer step spends its samples)."""
import sys

import torch

import tileflash

d, causal, s = int(sys.argv[1]), bool(int(sys.argv[2])), int(sys.argv[3])
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
tileflash.flash_attn_func(q, k, v, causal=causal)
torch.cuda.synchronize()
print("done")
