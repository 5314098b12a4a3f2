"""flash_attn_varlen_func against a per-sequence reference: empty sequences, seqused_k, masks."""
import pytest
import torch

import tileflash
from helpers import DEVICE, ON_GPU, check_2x, check_lse, packed_inputs
from tileflash.reference import attention_varlen_ref

# (query lengths, key lengths, heads_q, heads_kv, head_dim, causal, window, seqused_k) — why each is here:
CASES = [
    ([5, 0, 17, 33], [5, 3, 40, 33], 4, 2, 64, True, (-1, -1), None),  # an empty query sequence; Sq != Sk
    ([1, 20, 7], [0, 20, 31], 4, 4, 40, False, (-1, -1), None),  # an empty key sequence: out 0, lse -inf
    ([9, 31], [50, 31], 8, 1, 128, True, (8, 0), [41, 17]),  # seqused_k < stored keys; MQA; sliding window
    ([16, 16, 16], [16, 16, 16], 2, 2, 80, False, (-1, -1), [16, 0, 5]),  # seqused_k = 0 for one sequence
]
if ON_GPU:
    CASES += [([300, 0, 1025, 77], [400, 12, 1025, 2000], 8, 2, 128, True, (-1, -1), None)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_flash_attn_varlen_func(case, dtype):
    lens_q, lens_k, hq, hkv, d, causal, window, seqused = case
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hkv, d, dtype, seed=7)
    used = None if seqused is None else torch.tensor(seqused, dtype=torch.int32, device=DEVICE)
    out, lse = tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=used,
                                                causal=causal, window_size=window, return_lse=True)
    kw = dict(causal=causal, window_size=window)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, used, **kw)
    ref_lowp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, used, upcast=False, **kw)
    assert lse.shape == (hq, sum(lens_q))
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("page_size", [1, 16, 5, 272])  # 272: past 256 (flash-attn 2.x pages are 256 x n)
def test_varlen_over_paged_keys(page_size):
    """vLLM-style chunked prefill: packed new queries attend to each sequence's keys held in pages."""
    from tileflash.reference import gather_cache

    g = torch.Generator().manual_seed(9)
    lens_q, used = [5, 0, 12, 1], [20, 7, 12, 33]  # queries are the last lens_q tokens of used keys
    hq, hkv, d, max_pages = 4, 2, 32, 40 // page_size + 1
    num_pages = len(used) * max_pages + 3
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(DEVICE, torch.float16)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(DEVICE, torch.float16)
    table = torch.randperm(num_pages, generator=g)[: len(used) * max_pages].reshape(len(used), max_pages)
    table = table.to(DEVICE, torch.int32)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(DEVICE, torch.float16)
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(DEVICE, torch.int32)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    out, lse = tileflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max(lens_q), max(used),
                                                seqused_k=seqused, causal=True, block_table=table, return_lse=True)
    k = torch.cat([gather_cache(k_cache, table, n, i) for i, n in enumerate(used)])
    v = torch.cat([gather_cache(v_cache, table, n, i) for i, n in enumerate(used)])
    cu_k = torch.tensor([0] + used).cumsum(0).to(DEVICE, torch.int32)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    ref_lowp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)
