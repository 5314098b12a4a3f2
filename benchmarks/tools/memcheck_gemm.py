"""GPU: nvfp4_matmul calls that take the wgmma Gluon GEMM (lowp/kernels/gemm_wgmma.py), for compute-sanitizer:
`PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 python
benchmarks/tools/memcheck_gemm.py`. Shapes: decode-sized M (16-row tiles), N tails, persistent CTAs taking several
work units (N = 28672), K slices, and stages of one and of two MMA steps."""
import sys

import torch

sys.path.insert(0, ".")
import tileflash  # noqa: E402
from tileflash import config  # noqa: E402
from tileflash.plan import GemmWgmmaConfig  # noqa: E402

CASES = [((1, 4096, 4096), None), ((7, 1000, 1024), None), ((20, 28672, 512), None), ((100, 320, 1024), None),
         ((200, 1000, 2048), None), ((64, 512, 4096), GemmWgmmaConfig(64, 2, 6, 2, steps=1)),
         ((5, 28672, 1024), GemmWgmmaConfig(16, 2, 6, 4))]
for (m, n, k), cfg in CASES:
    forced = {"gemm_mma": None, **({"gemm_wgmma": cfg} if cfg else {})}
    with config.override(**forced):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = tileflash.nvfp4_matmul(a, *tileflash.nvfp4_quantize(torch.randn(n, k, device="cuda")))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), (m, n, k)
print(f"{len(CASES)} cases done")
