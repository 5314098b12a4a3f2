"""GPU: small calls that take every Gluon kernel (kernels/gluon: the warp-specialised forward, with and without a sink,
the dK/dV kernel in both dQ modes, the register-operand NVFP4 decode, the MLA decode), for compute-sanitizer (the NVFP4
GEMM's cases: memcheck_gemm.py). Usage on the H200: `PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck
--error-exitcode 9 python benchmarks/tools/memcheck_ws.py` (without the environment variable, an access that lands in
another block of torch's caching allocator goes unreported). Shapes: one query and one key, partial tiles, MQA with Sq >
Sk (rows that see no key), d64 (128-row steps, one with whole row blocks that see no key), and keys that fit in one
tile. Then the forward alone with every tile of plan.fwd_ws_config launched directly (one CTA per tile and persistent
CTAs, d256's K/V rings), on shapes with partial tiles, an odd tile count and rows that see no key. The backward runs its
opt-in variants (BWD_VARIANTS) too, and packed (varlen) sequences through both kernels."""
import sys

import torch

sys.path.insert(0, ".")
import tileflash  # noqa: E402
from tileflash import config  # noqa: E402
from tileflash.launch.forward import launch_attn_fwd_ws  # noqa: E402
from tileflash.plan import WsBwdConfig, WsFwdConfig, ws_backward_config  # noqa: E402

CASES = [(1, 1, 1, 1, 1, 128, True), (2, 17, 17, 4, 4, 128, True), (1, 300, 97, 8, 1, 128, True),
         (2, 200, 1333, 4, 2, 64, False), (1, 1100, 1100, 2, 2, 64, True), (1, 1300, 1030, 2, 1, 64, True),
         (1, 700, 40, 4, 2, 128, True)]  # d64 needs more than 1024 keys (plan.bwd_ws_config)
# The backward's constexpr variants (plan.WsBwdConfig: two fences, dQ by columns or rows) on every case of
# their head dim, besides the heuristic's pick (None).
BWD_VARIANTS = {128: [None, WsBwdConfig(64, 2, True, False)],
                64: [None, WsBwdConfig(128, 2, True, True),
                     WsBwdConfig(128, 2, True, True, dq_by_rows=True)]}
runs = [(case, cfg, det) for case in CASES for cfg in BWD_VARIANTS[case[5]] for det in (False, True)]
for (b, sq, sk, hq, hkv, d, causal), cfg, deterministic in runs:
    forced = config.override(**({} if cfg is None else {"bwd_ws": cfg}))
    forced.__enter__()
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    assert ws_backward_config(q, k, v, q, varlen=False, window_left=-1, window_right=0 if causal else -1,
                              softcap=0.0) is not None, "this case no longer takes the Gluon backward"
    out = tileflash.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    finite = all(torch.isfinite(t.grad).all().item() for t in (q, k, v))
    print((b, sq, sk, hq, hkv, d, causal, deterministic), cfg or "heuristic", "finite" if finite else "NONFINITE",
          flush=True)
    forced.__exit__(None, None, None)

# Packed sequences through both kernels' varlen paths: an empty sequence, one past 1024 keys, rows and keys past
# each sequence's end belonging to the next one.
for d, causal in ((128, True), (64, False), (64, True)):
    cu = torch.tensor([0, 300, 300, 1700, 1777], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1777, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = tileflash.flash_attn_varlen_func(q, k, v, cu, cu, 1400, 1400, causal=causal)
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    finite = torch.isfinite(out).all().item() and all(torch.isfinite(t.grad).all().item() for t in (q, k, v))
    print("varlen", d, causal, "finite" if finite else "NONFINITE", flush=True)

FWD_TILES = {128: [(128, 3, 3, False), (128, 3, 3, True)], 64: [(128, 3, 3, False), (128, 3, 3, True)],
             256: [(64, 2, 2, False), (64, 3, 2, False), (64, 3, 2, True)]}
for b, sq, sk, hq, hkv, causal in [(1, 1, 1, 1, 1, True), (2, 1100, 1300, 16, 4, True), (1, 300, 97, 8, 1, True),
                                   (2, 17, 333, 4, 2, False)]:
    for d, tiles in FWD_TILES.items():
        for tile in tiles:
            q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            out = torch.full_like(q, float("nan"))
            lse = torch.full((b, hq, sq), float("nan"), device="cuda")
            launch_attn_fwd_ws(q, k, v, out, lse, causal=causal, softmax_scale=d ** -0.5, config=WsFwdConfig(*tile))
            torch.cuda.synchronize()
            written = not torch.isnan(out).any().item() and not torch.isnan(lse).any().item()
            print("forward", (b, sq, sk, hq, hkv, d, causal), tile, "written" if written else "UNWRITTEN", flush=True)

# The register-operand NVFP4 decode (kernels/gluon/decode_mma.py), both tiles, contiguous and paged (page 16), with
# splits, an append and a partial last block; outputs poisoned so an unwritten element shows.
from tileflash import _utils  # noqa: E402
from tileflash.plan import QuantDecodeConfig  # noqa: E402

_utils.POISON_OUTPUTS = True
for cfg in (QuantDecodeConfig(32, 4, 2), QuantDecodeConfig(16, 4, 3)):
    for page in (None, 16):
        b, ctx, hkv, d = 2, 1040, 2, 128
        kv = [torch.randn(b, ctx, hkv, d, device="cuda") for _ in range(2)]
        (kc, ks, kg), (vc, vs, vg) = (tileflash.nvfp4_quantize(t) for t in kv)
        table = None
        if page:
            kc, vc, ks, vs = (t.view(b * ctx // page, page, *t.shape[2:]) for t in (kc, vc, ks, vs))
            table = torch.arange(b * ctx // page, dtype=torch.int32, device="cuda").view(b, -1)
        q = torch.randn(b, 1, 8, d, device="cuda", dtype=torch.bfloat16)
        k_new = torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor([1000, 517], dtype=torch.int32, device="cuda")
        with config.override(quant_decode=cfg):
            out = tileflash.flash_attn_with_kvcache(q, kc, vc, k_new, k_new.clone(), cache_seqlens=lens,
                                                    block_table=table, k_scale=ks, v_scale=vs,
                                                    k_global_scale=kg.reshape(1), v_global_scale=vg.reshape(1),
                                                    num_splits=3)
        torch.cuda.synchronize()
        print("decode nvfp4", cfg, page, "finite" if torch.isfinite(out).all().item() else "NONFINITE", flush=True)

# The warp-specialised forward with a learnable sink (HAS_SINK, folded in the epilogue), one CTA per tile and
# persistent, rows that see no key (the sink alone). Outputs stay NaN-poisoned from here on (POISON_OUTPUTS above),
# so a finite output is a written one.
for b, sq, sk, causal in [(2, 300, 97, True), (1, 2048, 2048, True), (2, 17, 1333, False)]:
    q = torch.randn(b, sq, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = tileflash.flash_attn_func(q, k, v, causal=causal, return_lse=True,
                                         learnable_sink=torch.randn(8, device="cuda"))
    torch.cuda.synchronize()
    ok = torch.isfinite(out).all().item() and not torch.isnan(lse).any().item()
    print("forward sink", (b, sq, sk, causal), "written" if ok else "UNWRITTEN", flush=True)

# The Gluon MLA decode (kernels/gluon/mla_decode.py): H = 128 and 16, contiguous and paged (64, and 16 in random
# page order), split and whole, several query tokens with causal rows, lengths that end inside a step.
from tileflash.plan.decode import mla_gluon_config  # noqa: E402

for b, sq, h, ctx, page, splits in [(2, 1, 128, 1000, 0, 0), (1, 1, 128, 4100, 64, 5), (3, 2, 16, 777, 16, 3),
                                    (2, 4, 16, 130, 0, 1)]:
    q = torch.randn(b, sq, h, 64, device="cuda", dtype=torch.bfloat16)
    qv = torch.randn(b, sq, h, 512, device="cuda", dtype=torch.bfloat16)
    cap = -(-ctx // 64) * 64
    kc = torch.randn(b, cap, 1, 64, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(b, cap, 1, 512, device="cuda", dtype=torch.bfloat16)
    table = None
    if page:
        kc, vc = (t.view(b * cap // page, page, 1, t.shape[-1]) for t in (kc, vc))
        table = torch.randperm(b * cap // page, dtype=torch.int32, device="cuda").view(b, -1)
    lens = torch.randint(ctx // 2, ctx + 1, (b,), dtype=torch.int32, device="cuda")
    assert mla_gluon_config(q, kc, vc, table, extras=False, plain_mask=True) is not None, "not the Gluon MLA decode"
    out = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, qv=qv,
                                            causal=sq > 1, num_splits=splits)
    torch.cuda.synchronize()
    print("mla", (b, sq, h, ctx, page, splits), "finite" if torch.isfinite(out).all().item() else "NONFINITE",
          flush=True)
