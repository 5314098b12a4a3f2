"""GPU: device time of each kernel behind one nvfp4_matmul call (torch.profiler, mean of 20 calls), M = 1 / 16,
N = K = 4096 / 8192: the GEMM kernel apart from the split-K sum and cast that follow it.
Usage on the H200: `python benchmarks/gemm_kernel_times.py`."""
import sys, torch
sys.path.insert(0, ".")
from torch.profiler import profile, ProfilerActivity
import tileflash
for nk in (4096, 8192):
    for m in (1, 16):
        a = torch.randn(m, nk, device="cuda", dtype=torch.bfloat16)
        b_q = tileflash.nvfp4_quantize(torch.randn(nk, nk, device="cuda"))
        for _ in range(5): tileflash.nvfp4_matmul(a, *b_q)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20): tileflash.nvfp4_matmul(a, *b_q)
            torch.cuda.synchronize()
        ev = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                ev.setdefault(e.name[:40], []).append(e.device_time)
        print(nk, m, {k: round(sum(v) / len(v), 1) for k, v in ev.items()})
