"""Context-parallel benchmark: `torchrun --nproc-per-node 2 -m tileflash bench cp` (keep NCCL_NVLS_ENABLE=0).

Decode at batch 1 (32/8 heads, d=128, bf16) with 256k and 512k context: one GPU holding the whole cache vs the
group with each rank holding 1/world of it (cp_decode: local decode, all-gather of (out, lse), merge). Both are
timed as CUDA-graph replays when capture works (how serving engines call decode; NCCL collectives capture), else
eagerly; the table says which. Ring prefill, causal, s = 32k and 64k: TFLOP/s per GPU of ring_attention vs
flash_attn_func on one GPU, and the same for forward + backward at 64k. Rank 0 prints the table.

Every rank must run a collective the same number of times, so timing uses a fixed iteration count (do_bench picks
its count from a per-rank estimate and would deadlock).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tileflash.bench.formulas import attn_fwd_flops, tflops
from tileflash.bench.table import format_table


def fixed_iters_ms(fn, iters=30, warmup=5, all_ranks=True):
    """Mean milliseconds of fn() over `iters` back-to-back calls after `warmup`, the same count on every rank
    (all_ranks=False: a single-GPU baseline timed on one rank, no barrier)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if all_ranks:
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_or_eager(fn):
    """(callable, 'graph' | 'eager'): a CUDA-graph replay of fn when capture succeeds on every rank."""
    from tileflash.bench.timing import graphed

    try:
        replay, how = graphed(fn), "graph"
    except Exception as exc:  # capture support of collectives depends on the NCCL/torch build
        print(f"[rank {dist.get_rank()}] graph capture failed ({type(exc).__name__}: {exc}); timing eagerly")
        torch.cuda.synchronize()
        replay, how = fn, "eager"
    ok = torch.tensor([how == "graph"], device="cuda", dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return (replay, how) if ok.item() else (fn, "eager")


def main(argv=None) -> int:
    import tileflash
    import tileflash.distributed as tfd

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for ctx in (256 * 1024, 512 * 1024):
        q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.bfloat16)
        shard = ctx // world
        kc, vc = (torch.randn(1, shard, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((1,), shard, dtype=torch.int32, device=dev)
        cp_fn, how = graph_or_eager(lambda: tfd.cp_decode(q, kc, vc, lens))
        cp_ms = fixed_iters_ms(cp_fn)
        one_ms = 0.0
        if rank == 0:
            kf, vf = (torch.randn(1, ctx, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
            full = torch.full((1,), ctx, dtype=torch.int32, device=dev)
            one = lambda: tileflash.flash_attn_with_kvcache(q, kf, vf, cache_seqlens=full)  # noqa: E731
            if how == "graph":
                from tileflash.bench.timing import graphed

                one = graphed(one)
            one_ms = fixed_iters_ms(one, all_ranks=False)
            del kf, vf
        dist.barrier()
        if rank == 0:
            gbps = 2 * ctx * 8 * 128 * 2 / (cp_ms * 1e-3) / 1e9
            rows.append([f"decode b=1 ctx={ctx // 1024}k ({how})", f"{one_ms * 1e3:.1f} us",
                         f"{cp_ms * 1e3:.1f} us ({gbps:.0f} GB/s)", f"{one_ms / cp_ms:.2f}x"])
    for s in (32 * 1024, 64 * 1024):
        h = 16
        q, k, v = (torch.randn(1, s // world, h, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
        ring_ms = fixed_iters_ms(lambda: tfd.ring_attention(q, k, v, causal=True), iters=10, warmup=2)
        flops = attn_fwd_flops(1, h, s, s, 128, True)
        one = 0.0
        if rank == 0:
            from tileflash.bench.timing import bench_ms

            qf, kf, vf = (torch.randn(1, s, h, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
            one = tflops(flops, bench_ms(lambda: tileflash.flash_attn_func(qf, kf, vf, causal=True)))
        dist.barrier()
        if rank == 0:
            per_gpu = tflops(flops, ring_ms) / world
            rows.append([f"ring prefill causal s={s // 1024}k", f"{one:.0f} TFLOP/s", f"{per_gpu:.0f} TFLOP/s/GPU",
                         f"{per_gpu / one:.2f}"])
    # Forward + backward (training): 3.5 x the forward FLOPs (the backward counts 2.5, as in bench backward).
    s, h = 64 * 1024, 16
    q, k, v = (torch.randn(1, s // world, h, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(1, s // world, h, 128, device=dev, dtype=torch.bfloat16)
    ring_ms = fixed_iters_ms(
        lambda: torch.autograd.grad(tfd.ring_attention(q, k, v, causal=True), (q, k, v), dout), iters=5, warmup=1)
    flops = 3.5 * attn_fwd_flops(1, h, s, s, 128, True)
    one = 0.0
    if rank == 0:
        from tileflash.bench.timing import bench_ms

        qf, kf, vf = (torch.randn(1, s, h, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
                      for _ in range(3))
        dof = torch.randn(1, s, h, 128, device=dev, dtype=torch.bfloat16)
        one = tflops(flops, bench_ms(lambda: torch.autograd.grad(
            tileflash.flash_attn_func(qf, kf, vf, causal=True), (qf, kf, vf), dof)))
    dist.barrier()
    if rank == 0:
        per_gpu = tflops(flops, ring_ms) / world
        rows.append([f"ring fwd+bwd causal s={s // 1024}k", f"{one:.0f} TFLOP/s", f"{per_gpu:.0f} TFLOP/s/GPU",
                     f"{per_gpu / one:.2f}"])
    if rank == 0:
        print(format_table(["case", "1 GPU", f"{world} GPUs", "ratio"], rows,
                           title=f"Context parallel ({world} GPUs, bf16, d=128)"), flush=True)
    # The first run printed its table and then hung in teardown (graphs holding NCCL work were still alive):
    # drop them and let every rank finish its work before the group goes.
    del cp_fn
    import gc

    gc.collect()
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return 0
