"""Context-parallel benchmark: `torchrun --nproc-per-node 2 -m tileflash bench cp` (keep NCCL_NVLS_ENABLE=0).

Decode at batch 1 (32/8 heads, d=128, bf16) with 256k and 512k context: one GPU holding the whole cache vs the
group with each rank holding 1/world of it (cp_decode, CUDA-graph free eager timing of the whole call including
the all-gather). Ring prefill, causal, s = 32k and 64k: TFLOP/s per GPU of ring_attention vs flash_attn_func on
one GPU. Rank 0 prints the table.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tileflash.bench.formulas import attn_fwd_flops, tflops
from tileflash.bench.table import format_table
from tileflash.bench.timing import bench_ms


def _time(fn):
    dist.barrier()
    return bench_ms(fn)


def main(argv=None) -> int:
    import tileflash
    import tileflash.distributed as tfd

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for ctx in (256 * 1024, 512 * 1024):
        q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.bfloat16)
        shard = ctx // world
        kc, vc = (torch.randn(1, shard, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((1,), shard, dtype=torch.int32, device=dev)
        cp_ms = _time(lambda: tfd.cp_decode(q, kc, vc, lens))
        one_ms = None
        if rank == 0:
            kf, vf = (torch.randn(1, ctx, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
            full = torch.full((1,), ctx, dtype=torch.int32, device=dev)
            one_ms = bench_ms(lambda: tileflash.flash_attn_with_kvcache(q, kf, vf, cache_seqlens=full))
            del kf, vf
        dist.barrier()
        if rank == 0:
            rows.append([f"decode b=1 ctx={ctx // 1024}k", f"{one_ms * 1e3:.1f} us", f"{cp_ms * 1e3:.1f} us",
                         f"{one_ms / cp_ms:.2f}x"])
    for s in (32 * 1024, 64 * 1024):
        h = 16
        q, k, v = (torch.randn(1, s // world, h, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
        ring_ms = _time(lambda: tfd.ring_attention(q, k, v, causal=True))
        flops = attn_fwd_flops(1, h, s, s, 128, True)
        one = None
        if rank == 0:
            qf, kf, vf = (torch.randn(1, s, h, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
            one = tflops(flops, bench_ms(lambda: tileflash.flash_attn_func(qf, kf, vf, causal=True)))
        dist.barrier()
        if rank == 0:
            per_gpu = tflops(flops, ring_ms) / world
            rows.append([f"ring prefill causal s={s // 1024}k", f"{one:.0f} TFLOP/s", f"{per_gpu:.0f} TFLOP/s/GPU",
                         f"{per_gpu / one:.2f}"])
    if rank == 0:
        print(format_table(["case", "1 GPU", f"{world} GPUs", "ratio"], rows,
                           title=f"Context parallel ({world} GPUs, bf16, d=128)"))
    dist.destroy_process_group()
    return 0
