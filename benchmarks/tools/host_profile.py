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
from tileflash.launch import direct


@triton.jit
def _one_arg(x_ptr):
    tl.store(x_ptr, 1)


@triton.jit
def _many_args(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, p16, p17, p18, p19, p20, p21,
               p22, p23, p24, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15, n16, n17, n18,
               n19, n20, n21, n22, n23, n24, n25, n26, n27, n28, n29, n30, n31, n32, n33, n34, n35, n36, n37, n38,
               n39, n40, n41, n42, n43, n44, n45, n46, n47, n48, n49):
    """As many run-time arguments as the decode attention launch (25 pointers, 50 integers): against _one_arg, what
    the argument count alone costs Triton's launcher and the driver."""
    tl.store(p0, n0 + n49)


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
    p.add_argument("--backward", action="store_true", help="split forward + backward instead (s = 128, 512)")
    args = p.parse_args()
    if args.backward:
        return backward(args.calls)
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=bf16)
    kc, vc = (torch.randn(1, 8192, 8, 128, device=dev, dtype=bf16) for _ in range(2))
    lens = torch.full((1,), 8192, dtype=torch.int32, device=dev)
    plan = tileflash.decode_plan(q, kc, vc, lens)
    plan.run(q, kc, vc)
    captured = []  # the slots of one run, as its replay gets them
    plan.execute = lambda launch_fn, slots, stream: captured.append(slots)
    plan.run(q, kc, vc)
    del plan.execute
    slots, stream = captured[0], direct.current_stream(q.device)
    attn = plan.launches[0]  # the splits merge inside it (fused merge): one launch
    x = torch.zeros(1, device=dev)
    one = _one_arg[(1,)](x)
    many_args = [x.data_ptr()] * 25 + [1000 + i for i in range(50)]  # pointers as ints, as replays pass them
    many = _many_args[(1,)](*([x] * 25), *many_args[25:])
    pieces = {
        "flash_attn_with_kvcache": lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens),
        "plan.run": lambda: plan.run(q, kc, vc),
        "plan.run's Python without the launches": None,
        "torch.empty_like (out)": lambda: torch.empty_like(q),
        "torch.empty (shape, dtype, device)": lambda: torch.empty((1, 1, 32, 128), dtype=bf16, device=dev),
        "replayed attention launch (2 TMA descriptors, fused merge)": lambda: attn.call(slots, stream, None),
        "compiled.run, 1-arg kernel": lambda: one.run(1, 1, 1, stream, one.function, one.packed_metadata, None,
                                                      None, None, x),
        "compiled.run, 75-arg kernel (25 pointers as ints, 50 ints)": lambda: many.run(
            1, 1, 1, stream, many.function, many.packed_metadata, None, None, None, *many_args),
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


def _kernel_us(fn):
    """GPU time per kernel of one call of fn (torch.profiler), as 'name: us' strings."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [f"{e.name[:60]}: {e.device_time:.1f}" for e in prof.events() if e.device_time > 0 and not e.is_async]


def backward(calls):
    """Forward + backward at b=1, 32 heads d128 causal: host time (no sync) and GPU time of each part, ours and
    SDPA-flash's, so the gap of the autograd step splits into host and kernels."""
    from tileflash.bench.timing import bench_graph_ms
    from tileflash.launch.backward import attn_backward

    F = torch.nn.functional
    for s in (128, 512):
        q, k, v, dout = (torch.randn(1, s, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
        scale = 128 ** -0.5
        bwd = lambda: attn_backward(q, k, v, out, lse, dout, None, None, None, None, 0, 0, scale, -1, 0, 0.0, False)
        lt = [t.transpose(1, 2) for t in leaves]
        pieces = {
            "tileflash fwd": lambda: tileflash.flash_attn_func(q, k, v, causal=True),
            "tileflash fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(
                tileflash.flash_attn_func(*leaves, causal=True), leaves, dout),
            "tileflash attn_backward alone": bwd,
            "torch.zeros_like fp32 [dQ]": lambda: torch.zeros_like(q, dtype=torch.float32),
            "sdpa-flash fwd": lambda: F.scaled_dot_product_attention(*lt, is_causal=True),
            "sdpa-flash fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(
                F.scaled_dot_product_attention(*lt, is_causal=True), leaves, dout.transpose(1, 2)),
        }
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            for name, fn in pieces.items():
                print(f"s={s} {name}: {_host_us(fn, calls):.1f} us host time per call", flush=True)
            print(f"s={s} attn_backward graph replay: {bench_graph_ms(bwd) * 1e3:.1f} us GPU", flush=True)
            for name in ("tileflash fwd+bwd (autograd.grad)", "sdpa-flash fwd+bwd (autograd.grad)"):
                print(f"s={s} {name} kernels (us): {'; '.join(_kernel_us(pieces[name]))}", flush=True)


if __name__ == "__main__":
    main()
