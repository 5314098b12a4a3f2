"""Temporary: split combine with and without PDL (graph replay, read flush)."""
import torch, tileflash
import tileflash.ops._launch as L
from tileflash.ops import decode as D
from tileflash.bench import timing
from tileflash.bench.timing import bench_ms, graphed
timing.flush_mode = "read"
orig = L.launch_combine
def no_pdl(*a):
    saved = L.sm90_target
    L.sm90_target = lambda: False
    try:
        orig(*a)
    finally:
        L.sm90_target = saved
for b, ctx, hq, hkv, d in [(1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128), (1, 131072, 32, 8, 128), (8, 8192, 32, 8, 128),
                           (32, 8192, 8, 1, 128), (1, 8192, 8, 1, 128), (1, 32768, 8, 1, 128), (8, 8192, 8, 1, 128),
                           (1, 8192, 32, 8, 64), (1, 32768, 32, 8, 64)]:
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, ctx, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    fn = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    ref = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=1).float()
    res = []
    for name, comb in (("pdl", orig), ("no-pdl", no_pdl), ("pdl", orig), ("no-pdl", no_pdl)):
        D.launch_combine = comb
        g = graphed(fn)
        err = (g().float() - ref).abs().max().item()
        res.append(f"{name} {bench_ms(g) * 1e3:.1f} (err {err:.0e})")
    D.launch_combine = orig
    print(f"b{b} ctx{ctx} {hq}/{hkv} d{d} splits {D._plan(q, kc, None, 0)[1]}: " + " | ".join(res), flush=True)
