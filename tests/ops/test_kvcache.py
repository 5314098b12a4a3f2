"""flash_attn_with_kvcache against a reference that gathers the pages into a contiguous cache."""
import dataclasses

import pytest
import torch

import tileflash
from helpers import DEVICE, ON_GPU, check_2x, check_lse, draw_queries_and_new_kv, force_trans, make_cache
from tileflash.reference import kvcache_ref


# (seqlens, Sq, Snew, Hq, Hkv, D, page_size, capacity, num_splits) — why each is here:
CASES = [
    ([0, 37, 63], 1, 1, 8, 2, 64, 16, 64, 0),  # GQA 4, page 16; empty cache; a full cache after the append
    ([13, 5], 3, 3, 4, 4, 64, 1, 24, 1),  # page size 1 (every token its own page), MHA, no split
    ([21, 0, 9], 2, 2, 8, 1, 32, 5, 30, 7),  # MQA, non-power-of-two page 5, append crosses page edges, 7 splits
    ([40], 16, 16, 8, 1, 128, 16, 64, 0),  # 16 query tokens (speculative verify) x GQA 8 = 128 packed rows
    ([50, 3], 4, 0, 16, 2, 80, None, 60, 3),  # contiguous cache, no append, head dim 80
    ([33], 1, 1, 32, 1, 64, 16, 48, 5),  # MQA with 32 query heads: pack-GQA needs several M tiles
    ([15, 31], 2, 2, 8, 2, 64, 16, 64, 4),  # appends straddling a step and split edge: two programs write one append
]
if ON_GPU:
    CASES += [
        ([8191, 4000], 1, 1, 32, 8, 128, 64, 8192, 0),
        ([30000], 1, 1, 32, 8, 128, None, 32768, 0),
        ([1000, 1, 255], 5, 5, 16, 2, 256, 256, 1280, 0),
    ]


# The S/P-overlapped loop (sp_overlap=True, a documented option no heuristic picks) on a representative subset: a
# paged GQA split with an append, MQA over odd pages with 7 splits, a contiguous cache with head dim 80.
OVERLAP_CASES = (0, 2, 4)
LOOPS = [(i, loop) for i in range(len(CASES)) for loop in ("plain", "trans")] + \
    [(i, loop) for i in OVERLAP_CASES for loop in ("overlap", "trans-overlap")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("index, loop", LOOPS, ids=[f"case{i}-{loop}" for i, loop in LOOPS])
def test_kvcache(index, loop, dtype, override):
    case = CASES[index]
    force_trans(override, loop.startswith("trans"))
    sp_overlap = loop.endswith("overlap")
    seqlens, sq, s_new, hq, hkv, d, page_size, capacity, num_splits = case
    b = len(seqlens)
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache, table = make_cache(b, capacity, hkv, d, dtype, page_size, g)
    q, k, v = draw_queries_and_new_kv(g, b, sq, s_new, hq, hkv, d, dtype)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    # causal, as engines decode (flash-attn's default is not: tests/ops/test_dropin.py)
    ref, ref_lse, ref_k, ref_v = kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens, table, causal=True)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens, table, causal=True, upcast=False)
    out, lse = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                 block_table=table, num_splits=num_splits, return_lse=True,
                                                 causal=True, sp_overlap=sp_overlap)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "appended cache contents differ"


@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("d", [64, 128])
def test_num_splits_agree(page_size, d):
    """No split, the heuristic and many forced splits give the same result within rounding (at d=128, 40 splits
    make the combine cut the head dim into two programs per row)."""
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, cap = 2, 8, 2, 96
    k_cache, v_cache, table = make_cache(b, cap, hkv, d, torch.float16, page_size, g)
    q = torch.randn(b, 1, hq, d, generator=g).to(DEVICE, torch.float16)
    seqlens = torch.tensor([96, 41], dtype=torch.int32, device=DEVICE)
    outs = [tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                              num_splits=n, return_lse=True) for n in (1, 0, 6, 40)]
    for out, lse in outs[1:]:
        assert (out.float() - outs[0][0].float()).abs().max().item() <= 2e-3
        assert (lse - outs[0][1]).abs().max().item() <= 1e-4


# (seqlens, Sq, Hq, Hkv, D, page_size, capacity, num_splits, sink) — the fused merge (the last split of each tile
# merges its rows) against the combine launch:
FUSED_CASES = [
    ([700, 3, 0], 1, 8, 2, 64, None, 704, 5, False),  # GQA 4, a short and an empty sequence (empty splits)
    ([90], 3, 6, 2, 40, 16, 96, 7, True),  # 9 rows (3 tokens x GQA 3), head dim 40, paged, a sink
    ([60, 64], 4, 32, 1, 32, None, 64, 3, False),  # MQA 32 heads x 4 tokens = 128 rows: two 64-row tiles
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=[f"case{i}" for i in range(len(FUSED_CASES))])
def test_fused_merge_matches_combine(case, override):
    """Both merges give the reference's result and agree to fp32 rounding; every arrival counter is zero after the
    call (the next call's counting starts from it)."""
    from tileflash.launch import direct

    seqlens, sq, hq, hkv, d, page_size, capacity, num_splits, sink = case
    g = torch.Generator().manual_seed(21)
    k_cache, v_cache, table = make_cache(len(seqlens), capacity, hkv, d, torch.bfloat16, page_size, g)
    q, _, _ = draw_queries_and_new_kv(g, len(seqlens), sq, 0, hq, hkv, d, torch.bfloat16)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    learnable_sink = torch.randn(hq, generator=g).to(DEVICE) if sink else None
    results = []
    for fused in (True, False):
        override(decode=lambda cfg, fused=fused: dataclasses.replace(cfg, fused_combine=fused))
        results.append(tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                         num_splits=num_splits, return_lse=True, causal=True,
                                                         learnable_sink=learnable_sink))
        assert all(not t.any() for t in direct.COUNTERS.buffers.values()), "an arrival counter was left non-zero"
    (out, lse), (out_combine, lse_combine) = results
    assert (out.float() - out_combine.float()).abs().max().item() <= 1e-2  # one bf16 rounding apart at most
    torch.testing.assert_close(lse, lse_combine, atol=1e-5, rtol=0)  # -inf where a sequence is empty
    ref, ref_lse, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, causal=True,
                                     learnable_sink=learnable_sink)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, causal=True,
                                    upcast=False, learnable_sink=learnable_sink)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
def test_window_and_softcap_in_decode(trans, override):
    force_trans(override, trans)
    g = torch.Generator().manual_seed(9)
    k_cache, v_cache, table = make_cache(2, 80, 2, 64, torch.bfloat16, 16, g)
    q = torch.randn(2, 4, 8, 64, generator=g).to(DEVICE, torch.bfloat16)
    seqlens = torch.tensor([70, 12], dtype=torch.int32, device=DEVICE)
    kw = dict(window_size=(24, 0), softcap=8.0)
    out, lse = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                                 num_splits=3, return_lse=True, **kw)
    ref, ref_lse, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, **kw)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, upcast=False,
                                    **kw)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
@pytest.mark.parametrize("page_size", [None, 16, 5])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cache_rows_past_each_sequence_may_hold_nan(fp8, page_size, trans, override):
    """Cache rows at and past each sequence's length (the next sequence's rows, unused pages, a step's tail) hold
    NaN and inf (an FP8 cache: NaN bytes): no output reads them, whichever loop runs (a masked step's V tile is
    zeroed there or its box kept inside the sequence, its keys' scores are -inf) and wherever the splits fall.
    (Triton's interpreter widens the e4m3 NaN byte to 480: the FP8 rows check on the GPU only.)"""
    force_trans(override, trans)
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache, table = make_cache(3, 70, 2, 64, torch.float32 if fp8 else torch.bfloat16, page_size, g)
    scales = {}
    if fp8:
        scales = dict(k_scale=torch.full((1,), 0.02, device=DEVICE), v_scale=torch.full((1,), 0.03, device=DEVICE))
        k_cache = (k_cache / scales["k_scale"]).to(torch.float8_e4m3fn)
        v_cache = (v_cache / scales["v_scale"]).to(torch.float8_e4m3fn)
    seqlens = torch.tensor([70, 33, 1], dtype=torch.int32, device=DEVICE)
    for cache in (k_cache, v_cache):
        if table is None:
            for i, n in enumerate(seqlens.tolist()):
                cache[i, n:] = float("nan")
                cache[i, n + 1:] = float("inf")
        else:
            used = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=DEVICE)
            for i, n in enumerate(seqlens.tolist()):
                pos = torch.arange(n, device=DEVICE)
                used[table[i, pos // page_size].long() * page_size + pos % page_size] = True
            bits = cache.view(torch.uint8) if fp8 else cache  # (no masked stores into e4m3 tensors; 0x7F is NaN)
            bits.view(-1, *cache.shape[2:])[~used] = 0x7F if fp8 else float("nan")
    q = torch.randn(3, 2, 8, 64, generator=g).to(DEVICE, torch.bfloat16)
    out, lse = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                                 num_splits=3, return_lse=True, causal=True, **scales)
    ref, ref_lse, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True,
                                     **scales)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True,
                                    upcast=False, **scales)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("page_size", [None, 16])
def test_append_outside_every_window(page_size):
    """A left window narrower than the append: the first new tokens are keys no query attends to (no program reads
    their block), and they must still land in the cache."""
    g = torch.Generator().manual_seed(8)
    k_cache, v_cache, table = make_cache(2, 64, 2, 64, torch.bfloat16, page_size, g)
    q, k, v = draw_queries_and_new_kv(g, 2, 1, 6, 8, 2, 64, torch.bfloat16)
    seqlens = torch.tensor([12, 40], dtype=torch.int32, device=DEVICE)  # new tokens 12..17 and 40..45
    kw = dict(cache_seqlens=seqlens, block_table=table, window_size=(1, 0))
    ref, _, ref_k, ref_v = kvcache_ref(q, k_cache, v_cache, k, v, causal=True, **kw)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, k, v, causal=True, upcast=False, **kw)
    out = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, causal=True, num_splits=3, **kw)
    check_2x(out, ref, ref_lowp)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "appended cache contents differ"


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_follows_new_seqlens_and_table():
    g = torch.Generator().manual_seed(2)
    b, hq, hkv, d, cap = 4, 32, 8, 128, 4096
    k_cache, v_cache, table = make_cache(b, cap, hkv, d, torch.bfloat16, 16, g, spare_pages=64)
    q = torch.randn(b, 1, hq, d, generator=g).to(DEVICE, torch.bfloat16)
    seqlens = torch.tensor([4000, 10, 2049, 1], dtype=torch.int32, device=DEVICE)
    call = lambda: tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,  # noqa: E731
                                                     block_table=table)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for new_lens in ([17, 4096, 300, 0], [1, 1, 1, 1]):
        seqlens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        table.copy_(table[torch.randperm(b)])
        graph.replay()
        torch.cuda.synchronize()
        ref, _, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
        ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                        upcast=False)
        check_2x(out, ref, ref_lowp)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("warm_stream", [True, False], ids=["stream-ran-a-call", "fresh-stream"])
def test_cuda_graph_replay_of_a_split_call(warm_stream, monkeypatch):
    """b=1 ctx 8k splits its keys 33 ways. Eager calls merge the splits in the attention launch (arrival counters);
    a captured call takes the combine launch (direct.Counters), also on a stream whose eager calls made counters.
    Replays follow new lengths, and no arrival counter is left non-zero."""
    from tileflash.launch import direct

    monkeypatch.setattr(direct, "COUNTERS", direct.Counters())
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache, _ = make_cache(1, 8192, 8, 128, torch.bfloat16, None, g)
    q = torch.randn(1, 1, 32, 128, generator=g).to(DEVICE, torch.bfloat16)
    seqlens = torch.tensor([8192], dtype=torch.int32, device=DEVICE)
    call = lambda: tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    if warm_stream:
        with torch.cuda.stream(s):
            call()
    torch.cuda.current_stream().wait_stream(s)
    assert len(direct.COUNTERS.buffers) == int(warm_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        out = call()
    assert len(direct.COUNTERS.buffers) == int(warm_stream)  # the capture made none
    for new_len in (5000, 8192, 1):
        seqlens.fill_(new_len)
        graph.replay()
        torch.cuda.synchronize()
        ref, _, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens)
        ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, cache_seqlens=seqlens, upcast=False)
        check_2x(out, ref, ref_lowp)
        check_2x(call(), ref, ref_lowp)  # the eager call's fused merge
    assert all(not t.any() for t in direct.COUNTERS.buffers.values())
