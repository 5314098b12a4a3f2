"""Where does decode time go? Eager vs CUDA-graph replay vs host time per call vs the attention kernel alone.

Run on the GPU machine: `python benchmarks/decode_probe.py`.
"""
import time

import torch
import torch.nn.functional as F

import tileflash
from tileflash.bench.formulas import decode_kv_bytes
from tileflash.bench.table import format_table
from tileflash.bench.timing import bench_ms, graphed
from tileflash.ops import decode as decode_ops
from tileflash.ops._launch import Mask, launch_attn_fwd
from sweep import sass_facts

SHAPES = [(1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128), (8, 32768, 32, 8, 128), (32, 8192, 32, 8, 128),
          (128, 1024, 32, 8, 128)]


def host_us(fn, n=200):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    rows = []
    for b, ctx, hq, hkv, d in SHAPES:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, ctx, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        call = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)  # noqa: E731
        cfg, splits, cap = decode_ops._plan(q, kc, None, 0)
        out = torch.empty_like(q)
        lse = torch.empty(b, hq, 1, device="cuda", dtype=torch.float32)
        o_part = torch.empty(splits, b * hq, d, device="cuda", dtype=torch.float32)
        l_part = torch.empty(splits, b * hq, device="cuda", dtype=torch.float32)

        def kernel_only():
            return launch_attn_fwd(q, kc, vc, out, lse, q_batch_stride0=False, k_batch_stride0=False,
                                   num_batches=b, seqlen_q=1, seqlen_k=cap, m_rows=hq // hkv,
                                   softmax_scale=d ** -0.5, mask=Mask.make(True, (-1, -1), 0.0), config=cfg,
                                   seqlens_k=lens, pack_gqa=True, num_splits=splits, sp_overlap=True,
                                   o_part=o_part if splits > 1 else None, lse_part=l_part if splits > 1 else None)
        compiled = kernel_only()
        sdpa = lambda: F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2),  # noqa: E731
                                                      vc.transpose(1, 2), enable_gqa=True)
        nbytes = decode_kv_bytes(b, ctx, hkv, d)
        res = dict(eager=bench_ms(call), graph=bench_ms(graphed(call)), kernel_graph=bench_ms(graphed(kernel_only)),
                   sdpa=bench_ms(sdpa), sdpa_graph=bench_ms(graphed(sdpa)))
        rows.append([b, ctx, splits, f"{cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}",
                     *(round(v * 1e3, 1) for v in res.values()), round(host_us(call), 1),
                     round(nbytes / (res["kernel_graph"] * 1e-3) / 1e9), sass_facts(compiled)])
        print(rows[-1], flush=True)
    print(format_table(["B", "ctx", "splits", "bn/w/st", "eager us", "graph us", "kernel graph us", "sdpa us",
                        "sdpa graph us", "host us/call", "kernel GB/s", "facts"], rows,
                       title="decode probe (bf16, Sq=1, contiguous)"))


if __name__ == "__main__":
    main()
