"""Where an eager call's host time goes: wall time per call (host only, no sync) and a cProfile of many calls.

Eager decode calls measured 100-300 us in `bench decode` against ~22 us for SDPA and for our own CUDA-graph replay,
so the host, not the GPU, sets an eager call's time. Run on the GPU machine:
`PYTHONPATH=$PWD python benchmarks/host_profile.py [--calls N] [--top K]`.
"""
import argparse
import cProfile
import dataclasses
import io
import pstats
import time

import torch
import triton
import triton.language as tl

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


@triton.jit
def _one_arg(x_ptr):
    tl.store(x_ptr, 1)


@triton.jit
def _sixty_args(x_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
                a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39,
                a40, a41, a42, a43, a44, a45, a46, a47, a48, a49, a50, a51, a52, a53, a54, a55, a56, a57, a58):
    tl.store(x_ptr, a0 + a58)


@triton.jit
def _two_descriptors(x_ptr, a_desc, b_desc):
    tl.store(x_ptr, 1)


def _host_us(fn, calls):
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def pieces(calls):
    """Host time of each step of a decode call (b=1 ctx 8k, bf16, 32/8 heads), timed alone without a profiler."""
    from tileflash.ops import _launch, decode as dec

    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=bf16)
    kc, vc = (torch.randn(1, 8192, 8, 128, device=dev, dtype=bf16) for _ in range(2))
    lens = torch.full((1,), 8192, dtype=torch.int32, device=dev)
    cfg, splits, capacity = dec._plan(q, kc, None, 0)
    out, lse = torch.empty_like(q), torch.empty(1, 32, 1, device=dev)
    o_part, lse_part = torch.empty(splits, 32, 128, device=dev), torch.empty(splits, 32, device=dev)
    x = torch.zeros(1, device=dev)
    descs = _launch.row_descriptors((kc, vc), 8192, 64)
    pointer_cfg = dataclasses.replace(cfg, tma=False)
    steps = {
        "checks": lambda: dec._check_kvcache(q, kc, vc, None, None, lens, None, 0, None, None, None, None),
        "plan": lambda: dec._plan(q, kc, None, 0),
        "torch.empty x4": lambda: [torch.empty(64, device=dev) for _ in range(4)],
        "two TMA descriptors": lambda: _launch.row_descriptors((kc, vc), 8192, 64),
        "launch attention": lambda: _launch.launch_attn_fwd(
            q, kc, vc, out, lse, q_batch_stride0=False, k_batch_stride0=False, num_batches=1, seqlen_q=1,
            seqlen_k=capacity, m_rows=4, softmax_scale=128 ** -0.5, mask=_launch.Mask(-1, 0, 0.0), config=cfg,
            seqlens_k=lens, pack_gqa=True, num_splits=splits, o_part=o_part, lse_part=lse_part),
        "launch attention, pointers (no TMA descriptors)": lambda: _launch.launch_attn_fwd(
            q, kc, vc, out, lse, q_batch_stride0=False, k_batch_stride0=False, num_batches=1, seqlen_q=1,
            seqlen_k=capacity, m_rows=4, softmax_scale=128 ** -0.5, mask=_launch.Mask(-1, 0, 0.0),
            config=pointer_cfg, seqlens_k=lens, pack_gqa=True, num_splits=splits, o_part=o_part,
            lse_part=lse_part),
        "launch combine": lambda: _launch.launch_combine(o_part, lse_part, out, lse),
        "triton launch, 2 TMA descriptors": lambda: _two_descriptors[(1,)](x, *descs),
        "triton launch, 2 tensors": lambda: _two_descriptors[(1,)](x, kc, vc),
        "triton launch, 1 arg": lambda: _one_arg[(1,)](x),
        "triton launch, 60 args": lambda: _sixty_args[(1,)](x, *range(1, 60)),
    }
    for name, fn in steps.items():
        print(f"piece {name}: {_host_us(fn, calls):.1f} us", flush=True)


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
    pieces(args.calls)
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
