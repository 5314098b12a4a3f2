"""Where an eager call's host time goes on the GPU machine: each piece of a decode call timed alone (no sync, the
GPU queue absorbs the kernels), then a cProfile of many calls. `bench host` gives the totals side by side with the
peers; this script splits them. Run on the GPU machine: `PYTHONPATH=$PWD python benchmarks/host_profile.py`.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl

import tileflash
from tileflash.ops import direct


@triton.jit
def _one_arg(x_ptr):
    tl.store(x_ptr, 1)


def _host_us(fn, calls):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=bf16)
    kc, vc = (torch.randn(1, 8192, 8, 128, device=dev, dtype=bf16) for _ in range(2))
    lens = torch.full((1,), 8192, dtype=torch.int32, device=dev)
    plan = tileflash.decode_plan(q, kc, vc, lens)
    plan.run(q, kc, vc)
    out = torch.empty_like(q)
    stream = direct.current_stream(q.device)
    ws = direct.WORKSPACE.get(q.device, stream, plan.schedule.workspace)
    slots = (q, kc, vc, None, None, lens, None, None, None, None, None, out, None, ws)
    attn, combine = plan.launches
    x = torch.zeros(1, device=dev)
    one = _one_arg[(1,)](x)
    pieces = {
        "flash_attn_with_kvcache": lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens),
        "plan.run": lambda: plan.run(q, kc, vc),
        "plan.run's Python without the launches": None,
        "torch.empty_like (out)": lambda: torch.empty_like(q),
        "torch.empty (shape, dtype, device)": lambda: torch.empty((1, 1, 32, 128), dtype=bf16, device=dev),
        "replayed attention launch (2 TMA descriptors)": lambda: attn.call(slots, stream, None),
        "replayed combine launch": lambda: combine.call(slots, stream, None),
        "compiled.run, 1-arg kernel": lambda: one.run(1, 1, 1, stream, one.function, one.packed_metadata, None,
                                                      None, None, x),
        "triton JIT launch, 1-arg kernel": lambda: _one_arg[(1,)](x),
        "sdpa decode": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True),
    }
    saved = plan.launches

    def without_launches():
        plan.launches = []
        try:
            plan.run(q, kc, vc)
        finally:
            plan.launches = saved

    pieces["plan.run's Python without the launches"] = without_launches
    for name, fn in pieces.items():
        print(f"{name}: {_host_us(fn, args.calls):.1f} us host time per call", flush=True)
    for name in ("plan.run", "flash_attn_with_kvcache"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            pieces[name]()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(f"== cProfile, {args.calls} calls of {name}\n{s.getvalue()}", flush=True)


if __name__ == "__main__":
    main()
