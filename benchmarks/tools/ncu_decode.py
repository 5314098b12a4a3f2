"""One decode launch per KV format (bf16, fp8, nvfp4) at batch 256, ctx 2048, 32/8 heads, d 128, for Nsight
Compute: `ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy
-k regex:attn_fwd_kernel -c 3 python3 benchmarks/ncu_decode.py` (the first attn_fwd launch of each format)."""
import torch

import tileflash

b, ctx, hq, hkv, d = 256, 2048, 32, 8, 128
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
kh = torch.randn(b, ctx, hkv, d, device="cuda", dtype=torch.bfloat16)
lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
tileflash.flash_attn_with_kvcache(q, kh, kh, cache_seqlens=lens)
k8 = kh.to(torch.float8_e4m3fn)
ones = torch.ones(hkv, device="cuda")
tileflash.flash_attn_with_kvcache(q, k8, k8, cache_seqlens=lens, k_scale=ones, v_scale=ones)
data, scales, g = tileflash.nvfp4_quantize(kh)
tileflash.flash_attn_with_kvcache(q, data, data, cache_seqlens=lens, k_scale=scales, v_scale=scales,
                                  k_global_scale=g.reshape(1), v_global_scale=g.reshape(1))
torch.cuda.synchronize()
print("done")
