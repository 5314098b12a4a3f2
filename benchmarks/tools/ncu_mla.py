"""One MLA decode (FA3's qv: 64-wide rotary key, 512-wide latent) through the Gluon MLA kernel for Nsight Compute:
`ncu --clock-control none --set full -k regex:mla_decode -c 1 -o REP python3 benchmarks/tools/ncu_mla.py B CTX H`,
then `ncu -i REP.ncu-rep --page source --csv --print-source sass` and benchmarks/tools/ncu_source_summary.py (--loops)
as for the backward (ncu_bwd.py)."""
import sys

import torch

import tileflash

b, ctx, h = (int(x) for x in sys.argv[1:4])
dev, bf = "cuda", torch.bfloat16
q, qv = torch.randn(b, 1, h, 64, device=dev, dtype=bf), torch.randn(b, 1, h, 512, device=dev, dtype=bf)
kc, vc = torch.randn(b, ctx, 1, 64, device=dev, dtype=bf), torch.randn(b, ctx, 1, 512, device=dev, dtype=bf)
lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, qv=qv)
torch.cuda.synchronize()
print("done")
