"""Attention-output error of FP8 and NVFP4 KV caches against the bf16 cache, on LLM-like K/V statistics.

K has a few outlier channels (10x the others, as in LLM keys before RoPE), V is Gaussian, queries are Gaussian;
the exact answer is fp32 attention over the unquantized K/V. Each cache format is stored the way
flash_attn_with_kvcache reads it (bf16; fp8 e4m3 with per-KV-head scales; NVFP4 with e4m3 block scales and a
global scale) and the kernel's output is compared with the exact one. Runs anywhere (the interpreter on a CPU):
`python benchmarks/lowp_error.py`.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)

import tileflash  # noqa: E402
from tileflash.bench.table import format_table  # noqa: E402
from tileflash.reference import attention_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def llm_like_kv(b, ctx, hkv, d, gen):
    k = torch.randn(b, ctx, hkv, d, generator=gen)
    outliers = torch.randperm(d, generator=gen)[: d // 16]
    k[..., outliers] *= 10.0
    v = torch.randn(b, ctx, hkv, d, generator=gen)
    return k, v


def main():
    gen = torch.Generator().manual_seed(0)
    b, ctx, hq, hkv, d = 2, 1024, 8, 2, 128
    k, v = llm_like_kv(b, ctx, hkv, d, gen)
    q = torch.randn(b, 1, hq, d, generator=gen)
    exact, _ = attention_ref(q, k, v)  # fp32
    lens = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        qd = q.to(DEVICE, dtype)
        caches = {"bf16/fp16 (same as q)": dict(k_cache=k.to(DEVICE, dtype), v_cache=v.to(DEVICE, dtype))}
        k8, ks = tileflash.fp8_quantize(k.to(DEVICE), per_head_dim=-2)
        v8, vs = tileflash.fp8_quantize(v.to(DEVICE), per_head_dim=-2)
        caches["fp8 e4m3, per-head scale"] = dict(k_cache=k8, v_cache=v8, k_scale=ks, v_scale=vs)
        kd, kbs, kg = tileflash.nvfp4_quantize(k.to(DEVICE))
        vd, vbs, vg = tileflash.nvfp4_quantize(v.to(DEVICE))
        caches["nvfp4 (e2m1 + e4m3/16 + fp32)"] = dict(k_cache=kd, v_cache=vd, k_scale=kbs, v_scale=vbs,
                                                       k_global_scale=kg.reshape(1), v_global_scale=vg.reshape(1))
        for name, kw in caches.items():
            out = tileflash.flash_attn_with_kvcache(qd, cache_seqlens=lens, **kw).float().cpu()
            err = (out - exact).abs()
            rel = err.norm() / exact.norm()
            nbytes = sum(t.numel() * t.element_size() for key, t in kw.items() if key in ("k_cache", "v_cache",
                                                                                        "k_scale", "v_scale")
                         and t.dim() == 4)
            rows.append([str(dtype).replace("torch.", ""), name, f"{err.max().item():.2e}", f"{err.mean().item():.2e}",
                         f"{rel.item():.2e}", f"{nbytes / (2 * b * ctx * hkv * d):.3f}"])
            print(rows[-1], flush=True)
    print(format_table(["q dtype", "cache", "max |err|", "mean |err|", "rel. L2 err", "bytes / value"], rows,
                       title=f"Decode output error vs fp32 attention on unquantized K/V (B={b}, ctx={ctx}, "
                             f"Hq={hq}, Hkv={hkv}, d={d}; K with 10x outlier channels)"))


if __name__ == "__main__":
    main()
