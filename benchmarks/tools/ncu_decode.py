"""One 16-bit decode call for Nsight Compute, its splits merged in the attention launch (fused=1) or by the combine's
own launch (fused=0): `ncu --clock-control none --set full -k regex:attn_fwd --launch-skip 1 -c 1 -o REP python3
benchmarks/tools/ncu_decode.py B CTX HQ HKV FUSED`, then `ncu -i REP.ncu-rep --page source --csv --print-source sass`
and benchmarks/tools/ncu_source_summary.py as for the MLA kernel (ncu_mla.py). What it is for: the fused merge's
tail cost ~3-5 us per load of partials in run 217's profiles (b=1 ctx 8k 32/8 heads: attention kernel 27.0 us fused
vs 14.5 + 4.9 with the combine launch), far more than one L2 round trip a load; the source view shows where the
merging program waits."""
import dataclasses
import sys

import torch

import tileflash
from tileflash import config

b, ctx, hq, hkv, fused = (int(x) for x in sys.argv[1:6])
dev, bf = "cuda", torch.bfloat16
q = torch.randn(b, 1, hq, 128, device=dev, dtype=bf)
kc, vc = (torch.randn(b, ctx, hkv, 128, device=dev, dtype=bf) for _ in range(2))
lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
with config.override(decode=lambda cfg: dataclasses.replace(cfg, fused_combine=bool(fused))):
    for _ in range(2):  # --launch-skip 1: the second call, its arrival counters already made
        tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
torch.cuda.synchronize()
print("done")
