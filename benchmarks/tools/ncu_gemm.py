"""One W4A16 nvfp4_matmul (bf16 a [M, K] times an NVFP4 weight [N, K]) for Nsight Compute:
`ncu --clock-control none --set full -k regex:nvfp4_matmul -c 1 -o REP python3 benchmarks/tools/ncu_gemm.py M N K`,
then `ncu -i REP.ncu-rep --page source --csv --print-source sass` and benchmarks/tools/ncu_source_summary.py (--loops)
as for the backward (ncu_bwd.py). Also prints each kernel's share of the call from torch's profiler (the activation
prep pass, the GEMM, the split-K sum) when run without ncu and --profile is given. --wgmma: decline the
register-operand kernel, so M <= 16 takes the wgmma kernel too."""
import sys

import torch

import tileflash
from tileflash import config

m, n, k = (int(x) for x in sys.argv[1:4])
forced = config.override(gemm_mma=None) if "--wgmma" in sys.argv else config.override()
forced.__enter__()  # held for the whole script (a dropped context manager would restore the planners' choice)
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
w = tileflash.nvfp4_quantize(torch.randn(n, k, device="cuda"))
tileflash.nvfp4_matmul(a, *w)
torch.cuda.synchronize()
if "--profile" in sys.argv:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            tileflash.nvfp4_matmul(a, *w)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
print("done")
