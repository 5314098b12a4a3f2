"""Where an eager call's host time goes: wall time per call (host only, no sync) and a cProfile of many calls.

Eager decode calls measured 100-300 us in `bench decode` against ~22 us for SDPA and for our own CUDA-graph replay,
so the host, not the GPU, sets an eager call's time. Run on the GPU machine:
`PYTHONPATH=$PWD python benchmarks/host_profile.py [--calls N] [--top K]`.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

import tileflash


def _cases():
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=bf16)
    kc, vc = (torch.randn(1, 8192, 8, 128, device=dev, dtype=bf16) for _ in range(2))
    lens = torch.full((1,), 8192, dtype=torch.int32, device=dev)
    pool, table = kc.view(128, 64, 8, 128), torch.arange(128, dtype=torch.int32, device=dev).view(1, 128)
    kn = torch.randn(1, 1, 8, 128, device=dev, dtype=bf16)
    qp = torch.randn(1, 1024, 16, 128, device=dev, dtype=bf16)
    return {
        "decode b=1 ctx 8k": lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens),
        "decode paged 64": lambda: tileflash.flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lens,
                                                                     block_table=table),
        "decode + append": lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=lens - 1),
        "prefill s=1k": lambda: tileflash.flash_attn_func(qp, qp, qp, causal=True),
        "sdpa decode": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    cases = _cases()
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host_us = (time.perf_counter() - t0) / args.calls * 1e6  # the GPU queue absorbs the kernels
        torch.cuda.synchronize()
        print(f"{name}: {host_us:.1f} us host time per call", flush=True)
    for name in ("decode b=1 ctx 8k", "prefill s=1k"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            cases[name]()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(f"== cProfile, {args.calls} calls of {name}\n{s.getvalue()}", flush=True)


if __name__ == "__main__":
    main()
