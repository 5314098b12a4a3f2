"""The decode step with a one-token append (`bench host`'s paged 16 row: b=1 ctx 8k, 32/8 heads, d128), over a bf16
cache and over an FP8 one (per-tensor scales), with the append inside the attention launch against its own kv_append
launch (plan.decode.append_in_kernel forced off), side by side: eager wall time per call (bench.host.eager_us, four
alternating blocks) and graph replay. GPU only.
Usage: `PYTHONPATH=. python benchmarks/tools/append_host.py`."""
import torch

import tileflash
from tileflash.bench.host import eager_us, graph_us
from tileflash.launch import direct
from tileflash.plan import decode as plan_decode
from tileflash.reference import fp8_quantize_ref

bf = torch.bfloat16
qd, kc, vc = (torch.randn(*s, device="cuda", dtype=bf) for s in ((1, 1, 32, 128), (1, 8192, 8, 128), (1, 8192, 8, 128)))
lens = torch.full((1,), 8191, dtype=torch.int32, device="cuda")  # the append rewrites the last token: same result
table = torch.arange(512, dtype=torch.int32, device="cuda").view(1, 512)
kn, vn = kc[:, -1:].clone(), vc[:, -1:].clone()
scale = torch.full((1,), 0.02, device="cuda")
pools = {
    "bf16": (kc.view(512, 16, 8, 128).clone(), vc.view(512, 16, 8, 128).clone(), {}),
    "fp8": (fp8_quantize_ref(kc.view(512, 16, 8, 128), scale), fp8_quantize_ref(vc.view(512, 16, 8, 128), scale),
            dict(k_scale=scale, v_scale=scale)),
}
in_kernel = plan_decode.append_in_kernel
for fmt, (pool_k, pool_v, scales) in pools.items():
    def call():
        return tileflash.flash_attn_with_kvcache(qd, pool_k, pool_v, kn, vn, cache_seqlens=lens, block_table=table,
                                                 **scales)

    plan_decode.append_in_kernel = in_kernel
    direct.clear_all()
    ref = call().float()
    eager = {f"{fmt}: append in the attention launch": [], f"{fmt}: kv_append launch": []}
    for block in range(4):
        for name, rule in zip(eager, (in_kernel, lambda *args: False)):
            plan_decode.append_in_kernel = rule
            direct.clear_all()  # plan the call again under this rule
            assert (call().float() - ref).abs().max() < 2e-2, name
            eager[name].append(eager_us({name: call}, "cuda")[name])
            if block == 0:
                print(f"{name}: graph replay {graph_us(call):.1f} us")
    for name, times in eager.items():
        print(f"{name}: eager us per block {', '.join(f'{t:.1f}' for t in times)}")
plan_decode.append_in_kernel = in_kernel
