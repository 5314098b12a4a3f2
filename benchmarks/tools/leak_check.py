"""1,000 decode calls (paged, split-KV, append) must not grow torch.cuda.memory_allocated (GPU only)."""
import torch

import tileflash


def main():
    dev = "cuda"
    q = torch.randn(4, 1, 32, 128, device=dev, dtype=torch.bfloat16)
    k_cache = torch.randn(256, 16, 8, 128, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(256, device=dev).to(torch.int32).view(4, 64)
    knew = torch.randn(4, 1, 8, 128, device=dev, dtype=torch.bfloat16)
    for i in range(1000):
        lens = torch.full((4,), 500 + i % 200, dtype=torch.int32, device=dev)
        tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, knew, knew, cache_seqlens=lens, block_table=table)
        torch.cuda.synchronize()
        if i == 9:
            base = torch.cuda.memory_allocated()
    grown = torch.cuda.memory_allocated() - base
    print(f"memory_allocated after 10 calls: {base} B; growth over the next 990: {grown} B")
    assert grown == 0, grown


if __name__ == "__main__":
    main()
