"""flash-attn drop-in behaviour: its defaults (flash_attn_with_kvcache is not causal unless asked), its argument
forms (dropout_p as a keyword, cache_seqlens as an int, window_size as a tensor), its packed entry points, and
errors a flash-attn caller catches (RuntimeError for a cache too small)."""
import pytest
import torch

import tileflash
from helpers import DEVICE, attention_inputs, check_2x, check_kvcache_call
from tileflash.reference import attention_ref, kvcache_ref


def _cache(b=2, ctx=40, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, torch.float16)  # noqa: E731
    return mk(b, 4, 4, d), mk(b, ctx, hkv, d), mk(b, ctx, hkv, d)


def test_kvcache_is_not_causal_by_default():
    """flash-attn's default: with Sq = 4 new queries and no causal argument every query sees every cached key."""
    q, kc, vc = _cache()
    lens = torch.tensor([30, 17], dtype=torch.int32, device=DEVICE)
    out = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    ref, *_ = kvcache_ref(q, kc, vc, cache_seqlens=lens, causal=False)
    ref_lowp, *_ = kvcache_ref(q, kc, vc, cache_seqlens=lens, causal=False, upcast=False)
    check_2x(out, ref, ref_lowp)
    causal = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    assert not torch.allclose(out.float(), causal.float(), atol=1e-3)


def test_cache_seqlens_as_an_int_and_window_as_a_tensor():
    q, kc, vc = _cache(seed=1)
    lens = torch.full((2,), 25, dtype=torch.int32, device=DEVICE)
    want = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, window_size=(8, 0))
    got = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=25, causal=True,
                                            window_size=torch.tensor([8, 0]))
    assert torch.equal(want, got)


def test_dropout_p_as_a_keyword():
    q, k, v = attention_inputs(1, 33, 33, 2, 2, 64, torch.float16)
    assert torch.equal(tileflash.flash_attn_func(q, k, v, dropout_p=0.0, causal=True),
                       tileflash.flash_attn_func(q, k, v, causal=True))
    with pytest.raises(ValueError, match="dropout_p"):
        tileflash.flash_attn_func(q, k, v, dropout_p=1.0)  # 0 < p < 1: tests/ops/test_dropout.py


def test_cache_too_small_is_a_runtime_error_too():
    q, kc, vc = _cache(ctx=8, seed=2)
    new = torch.zeros(2, 9, 2, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(RuntimeError, match="capacity"):
        tileflash.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=0)
    with pytest.raises(ValueError, match="capacity"):
        tileflash.flash_attn_with_kvcache(q, kc, vc, new[:, :2], new[:, :2], cache_seqlens=7, validate=True)


def test_packed_entry_points_match_and_differentiate_into_the_packed_tensor():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 37, 3, 2, 64, generator=g).to(DEVICE, torch.float16).requires_grad_()
    out = tileflash.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    ref = tileflash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, ref)
    dout = torch.randn(out.shape, generator=g).to(DEVICE, torch.float16)
    out.backward(dout)
    ref.backward(dout)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2))

    kv = qkv.detach()[:, :, 1:]
    out, lse, probs = tileflash.flash_attn_kvpacked_func(q.detach(), kv, return_attn_probs=True)
    ref32, ref_lse = attention_ref(q.detach(), *kv.unbind(2))
    assert probs is None and torch.allclose(lse, ref_lse, atol=1e-3)
    check_2x(out, ref32, attention_ref(q.detach(), *kv.unbind(2), upcast=False)[0])

    cu = torch.tensor([0, 20, 37], dtype=torch.int32, device=DEVICE)
    flat = qkv.detach()[0]
    out = tileflash.flash_attn_varlen_qkvpacked_func(flat, cu, 20, causal=True)
    assert torch.equal(out, tileflash.flash_attn_varlen_func(*flat.unbind(1), cu, cu, 20, 20, causal=True))
    out = tileflash.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu, cu, 20, 20)
    assert torch.equal(out, tileflash.flash_attn_varlen_func(*flat.unbind(1), cu, cu, 20, 20))
    slopes = torch.tensor([0.5, 0.125], device=DEVICE)  # forwarded to flash_attn_varlen_func
    out = tileflash.flash_attn_varlen_qkvpacked_func(flat, cu, 20, causal=True, alibi_slopes=slopes)
    assert torch.equal(out, tileflash.flash_attn_varlen_func(*flat.unbind(1), cu, cu, 20, 20, causal=True,
                                                             alibi_slopes=slopes))
    with pytest.raises(ValueError, match="alibi_slopes"):
        tileflash.flash_attn_qkvpacked_func(qkv, alibi_slopes=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="qkv"):
        tileflash.flash_attn_qkvpacked_func(qkv[:, :, :2])


# ---- flash_attn_with_kvcache's extras: cache_batch_idx, cache_leftpad, rotary ------------------------------------

def _extras_case(dtype, b=3, rows=5, ctx=48, hq=4, hkv=2, d=64, s_new=2, sq=2, seed=4):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    q, k, v = mk(b, sq, hq, d), mk(b, s_new, hkv, d), mk(b, s_new, hkv, d)
    kc, vc = mk(rows, ctx, hkv, d), mk(rows, ctx, hkv, d)
    return q, k, v, kc, vc


def _rotary_tables(rows, rotary_dim, dtype, seed=5):
    angle = torch.rand(rows, rotary_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6.2832
    return angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("leftpad", [True, False])  # without: the append inside the attention launch
@pytest.mark.parametrize("num_splits", [1, 3])  # 3: split-KV partials and their merge
@pytest.mark.parametrize("causal", [False, True])
def test_cache_batch_idx_and_leftpad(causal, num_splits, leftpad):
    """Sequences read cache rows 4, 0, 2 of 5 (rows 1 and 3 stay untouched), keys from a left pad on (0 keeps the
    whole sequence, 13 is mid-block, 20 leaves one cached key before the append)."""
    q, k, v, kc, vc = _extras_case(torch.float16)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([30, 17, 21], dtype=torch.int32, device=DEVICE)
    pad = torch.tensor([0, 13, 20], dtype=torch.int32, device=DEVICE) if leftpad else None
    check_kvcache_call(q, k, v, kc, vc, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad, causal=causal,
                       num_splits=num_splits)


@pytest.mark.parametrize("interleaved", [False, True])  # GPT-NeoX halves, GPT-J pairs
@pytest.mark.parametrize("causal,rotary_dim", [(False, 64), (True, 32)])  # 32: half the head dim passes through
def test_rotary_embedding_of_q_and_the_new_keys(causal, rotary_dim, interleaved):
    dtype = torch.bfloat16
    q, k, v, kc, vc = _extras_case(dtype, b=2, rows=2, seed=6)
    cos, sin = _rotary_tables(48, rotary_dim, dtype)
    lens = torch.tensor([0, 29], dtype=torch.int32, device=DEVICE)  # 0: the new keys are the whole sequence
    check_kvcache_call(q, k, v, kc, vc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, causal=causal,
                       rotary_interleaved=interleaved, num_splits=2)


def test_rotary_with_an_fp8_cache_and_a_window():
    """The append rotates before it quantizes; a window rotates q per token like causal does."""
    q, k, v, kc, vc = _extras_case(torch.float16, b=2, rows=2, seed=7)
    scale = torch.tensor([0.05], device=DEVICE)
    from tileflash.reference import fp8_quantize_ref
    kc8, vc8 = fp8_quantize_ref(kc, scale), fp8_quantize_ref(vc, scale)
    cos, sin = _rotary_tables(64, 64, torch.float32)
    lens = torch.tensor([11, 40], dtype=torch.int32, device=DEVICE)
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, window_size=(9, 0), k_scale=scale, v_scale=scale)
    kc_got, vc_got = kc8.clone(), vc8.clone()
    out = tileflash.flash_attn_with_kvcache(q, kc_got, vc_got, k, v, **kw)
    ref, _, kc_ref, vc_ref = kvcache_ref(q, kc8, vc8, k, v, **kw)
    ref_lowp, *_ = kvcache_ref(q, kc8, vc8, k, v, upcast=False, **kw)
    check_2x(out, ref, ref_lowp)
    assert (kc_got.float() - kc_ref.float()).abs().max() <= 0.125 * kc_ref.float().abs().max()  # one e4m3 step
    assert torch.equal(vc_got.view(torch.uint8), vc_ref.view(torch.uint8))


def test_decode_plan_takes_the_extras():
    q, k, v, kc, vc = _extras_case(torch.float16, seed=8)
    idx = torch.tensor([1, 3, 0], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([9, 30, 5], dtype=torch.int32, device=DEVICE)
    pad = torch.tensor([2, 0, 5], dtype=torch.int32, device=DEVICE)
    cos, sin = _rotary_tables(48, 64, torch.float16)
    kw = dict(cache_batch_idx=idx, cache_leftpad=pad, rotary_cos=cos, rotary_sin=sin, causal=True)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want = tileflash.flash_attn_with_kvcache(q, kc1, vc1, k, v, cache_seqlens=lens, **kw)
    plan = tileflash.decode_plan(q, kc2, vc2, lens, k=k, v=v, **kw)
    assert torch.equal(plan.run(q, kc2, vc2, k, v), want)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)


def test_flash_attn_2x_positional_order_and_fa3_names():
    """flash-attn 2.x's order: (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, softmax_scale, causal, ...); FA3 calls block_table page_table."""
    q, kc, vc = _cache(seed=9)
    lens = torch.tensor([30, 17], dtype=torch.int32, device=DEVICE)
    table = torch.arange(2, dtype=torch.int32, device=DEVICE).view(2, 1)
    want = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True)
    got = tileflash.flash_attn_with_kvcache(q, kc, vc, None, None, None, None, lens, None, None, table, None, True)
    assert torch.equal(want, got)
    assert torch.equal(want, tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table,
                                                               causal=True))
    with pytest.raises(ValueError, match="page_table"):
        tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, block_table=table)


def test_extras_input_errors():
    q, k, v, kc, vc = _extras_case(torch.float16, seed=10)
    lens = torch.full((3,), 4, dtype=torch.int32, device=DEVICE)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    cos, sin = _rotary_tables(48, 64, torch.float16)
    call = lambda **kw: tileflash.flash_attn_with_kvcache(q, kc, vc, **{"cache_seqlens": lens, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="k_cache: expected batch 3"):
        call()  # 5 cache rows for 3 sequences without cache_batch_idx
    with pytest.raises(ValueError, match="cache_batch_idx: expected values in"):
        call(cache_batch_idx=idx + 1, validate=True)
    with pytest.raises(ValueError, match="cache_batch_idx: expected a contiguous"):
        call(cache_batch_idx=idx[:2])
    with pytest.raises(ValueError, match="cache_leftpad: expected 0 <="):
        call(cache_batch_idx=idx, cache_leftpad=lens + 1, validate=True)
    with pytest.raises(ValueError, match="rotary_cos: rotary embedding applies to new keys"):
        call(cache_batch_idx=idx, rotary_cos=cos, rotary_sin=sin)
    with pytest.raises(ValueError, match="pass both or neither"):
        call(cache_batch_idx=idx, k=k, v=v, rotary_cos=cos)
    with pytest.raises(ValueError, match="at least 48 rows"):
        call(cache_batch_idx=idx, k=k, v=v, rotary_cos=cos[:40], rotary_sin=sin[:40])
    with pytest.raises(ValueError, match="rotary_dim"):
        call(cache_batch_idx=idx, k=k, v=v, rotary_cos=torch.cat([cos, cos], 1), rotary_sin=torch.cat([sin, sin], 1))
    pages = kc.view(-1, 16, 2, 64)
    table = torch.arange(9, dtype=torch.int32, device=DEVICE).view(3, 3)
    with pytest.raises(ValueError, match="cache_leftpad: expected 0 <="):
        tileflash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table,
                                          cache_leftpad=lens + 1, validate=True)


# (batch, Sq, Hq, Hkv, capacity, page size, causal, splits, new tokens, rotary) — why each is here:
LEFTPAD_PAGED_CASES = [
    (3, 1, 8, 2, 96, 16, True, 0, 0, False),  # decode: pack-GQA tiles, pads that cross pages
    (2, 3, 4, 1, 80, 5, True, 3, 2, False),  # pages of 5 (no power of two), three splits, an append
    (2, 4, 4, 2, 64, 8, False, 1, 2, True),  # rotary over the append, not causal
    (2, 20, 4, 2, 96, 16, True, 0, 3, False),  # extend: the prefill tiles
]


@pytest.mark.parametrize("case", LEFTPAD_PAGED_CASES, ids=[f"case{i}" for i in range(len(LEFTPAD_PAGED_CASES))])
def test_leftpad_over_pages(case):
    """cache_leftpad with a page table (FA3 takes the pair; its kvcache tests draw both): sequence b's keys are cache
    positions [pad, cache_seqlens + Snew), read through its pages with positions counted from the pad; the append
    lands at cache_seqlens as without a pad."""
    b, sq, hq, hkv, cap, page, causal, splits, s_new, rotary = case
    g = torch.Generator().manual_seed(cap + sq)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, torch.bfloat16)  # noqa: E731
    q, pages = mk(b, sq, hq, 64), b * cap // page
    kc, vc = mk(pages + 2, page, hkv, 64), mk(pages + 2, page, hkv, 64)
    table = torch.randperm(pages + 2, generator=g)[:pages].view(b, -1).to(DEVICE, torch.int32)
    lens = torch.randint(sq + 1, cap - s_new, (b,), generator=g)
    pad = (lens * torch.rand(b, generator=g)).to(DEVICE, torch.int32)
    lens = lens.to(DEVICE, torch.int32)
    k, v = (mk(b, s_new, hkv, 64) if s_new else None for _ in range(2))
    kw = dict(cache_seqlens=lens, block_table=table, causal=causal, cache_leftpad=pad)
    if rotary:
        cos, sin = _rotary_tables(cap, 32, torch.bfloat16)
        kw.update(rotary_cos=cos, rotary_sin=sin)
    check_kvcache_call(q, k, v, kc, vc, num_splits=splits, **kw)


# ---- any number of new query tokens: an extend / chunked prefill through flash_attn_with_kvcache ----------------

@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_extend_with_many_query_tokens(paged, causal):
    """Sq = 37 new tokens (past the 16 decode rows: prefill tiles) appended to caches of 0 and 23 tokens, GQA 2,
    paged with pages of 16 (a 37-token append crosses pages), with rotary."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    q, k, v = mk(2, 37, 4, 64), mk(2, 37, 2, 64), mk(2, 37, 2, 64)
    kc, vc = mk(2, 80, 2, 64), mk(2, 80, 2, 64)
    lens = torch.tensor([0, 23], dtype=torch.int32, device=DEVICE)
    cos, sin = _rotary_tables(80, 32, dtype)
    kw = dict(cache_seqlens=lens, causal=causal, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
    if paged:  # each sequence's 80 tokens on 5 pages of 16, in shuffled order
        perm = torch.randperm(10, generator=g)
        pool_k, pool_v = (torch.empty(10, 16, 2, 64, dtype=dtype, device=DEVICE) for _ in range(2))
        pool_k[perm], pool_v[perm] = kc.reshape(10, 16, 2, 64), vc.reshape(10, 16, 2, 64)
        table = perm.view(2, 5).to(DEVICE, torch.int32)
        kc, vc = pool_k, pool_v
        kw["block_table"] = table
    check_kvcache_call(q, k, v, kc, vc, **kw)


def test_kvcache_extend_over_an_fp8_cache():
    q, k, v, kc, vc = _extras_case(torch.float16, b=2, rows=2, ctx=64, s_new=20, sq=20, seed=12)
    scale = torch.tensor([0.05, 0.04], device=DEVICE)
    from tileflash.reference import fp8_quantize_ref
    kc8, vc8 = fp8_quantize_ref(kc, scale), fp8_quantize_ref(vc, scale)
    lens = torch.tensor([40, 3], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, causal=True, k_scale=scale, v_scale=scale)
    out = tileflash.flash_attn_with_kvcache(q, kc8.clone(), vc8.clone(), k, v, **kw)
    ref, *_ = kvcache_ref(q, kc8, vc8, k, v, **kw)
    ref_lowp, *_ = kvcache_ref(q, kc8, vc8, k, v, upcast=False, **kw)
    check_2x(out, ref, ref_lowp)


def test_kvcache_packed_queries_fa3():
    """FA3's cu_seqlens_q / max_seqlen_q over a paged cache (SGLang's extend): ragged query counts 5, 0, 19 with a
    3-token append each, causal; per sequence against the padded reference. One query per sequence (its decode)
    runs as the padded call, bitwise."""
    dtype = torch.float16
    g = torch.Generator().manual_seed(13)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    lens_q = [5, 0, 19]
    cu = torch.tensor([0, 5, 5, 24], dtype=torch.int32, device=DEVICE)
    q, k, v = mk(24, 4, 64), mk(3, 3, 2, 64), mk(3, 3, 2, 64)
    pool_k, pool_v = mk(12, 16, 2, 64), mk(12, 16, 2, 64)
    table = torch.randperm(12, generator=g).view(3, 4).to(DEVICE, torch.int32)
    lens = torch.tensor([10, 4, 30], dtype=torch.int32, device=DEVICE)
    kc, vc = pool_k.clone(), pool_v.clone()
    out, lse = tileflash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, page_table=table, causal=True,
                                                 cu_seqlens_q=cu, max_seqlen_q=19, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (4, 24)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    for i, n in enumerate(lens_q):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        args = (ref_k, ref_v, k[i:i + 1], v[i:i + 1])
        kw = dict(cache_seqlens=lens[i:i + 1], block_table=table[i:i + 1], causal=True)
        ref, ref_lse, new_k, new_v = kvcache_ref(q[None, rows], *args, **kw)
        ref_k.copy_(new_k), ref_v.copy_(new_v)
        if n:
            ref_lowp, *_ = kvcache_ref(q[None, rows], *args, upcast=False, **kw)
            check_2x(out[rows], ref[0], ref_lowp[0])
            assert (lse[:, rows] - ref_lse[0]).abs().max() < 2e-2
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    one = q[:3]
    arange = torch.arange(4, dtype=torch.int32, device=DEVICE)
    packed = tileflash.flash_attn_with_kvcache(one, pool_k, pool_v, cache_seqlens=lens, block_table=table,
                                               cu_seqlens_q=arange, max_seqlen_q=1)
    padded = tileflash.flash_attn_with_kvcache(one[:, None], pool_k, pool_v, cache_seqlens=lens, block_table=table)
    assert torch.equal(packed, padded[:, 0])
    with pytest.raises(ValueError, match="max_seqlen_q: required"):
        tileflash.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=table, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="cu_seqlens_k_new: expected a contiguous \\[4\\]"):
        tileflash.flash_attn_with_kvcache(q, pool_k, pool_v, k[0], v[0], cache_seqlens=lens, block_table=table,
                                          cu_seqlens_q=cu, max_seqlen_q=19, cu_seqlens_k_new=cu[:3])


@pytest.mark.parametrize("packed_q", [True, False])
def test_kvcache_packed_appends_fa3(packed_q):
    """FA3's cu_seqlens_k_new: sequences append 4, 0 and 7 packed new tokens (with rotary), against the per-sequence
    reference; queries packed and ragged (5, 0, 19: the prefill tiles) or one per sequence (decode tiles, split)."""
    dtype = torch.float16
    g = torch.Generator().manual_seed(20)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    lens_q = [5, 0, 19] if packed_q else [1, 1, 1]
    cu_q = torch.tensor([0, *lens_q], device=DEVICE).cumsum(0).to(torch.int32)
    cu_new = torch.tensor([0, 4, 4, 11], dtype=torch.int32, device=DEVICE)
    q, k, v = mk(sum(lens_q), 4, 64), mk(11, 2, 64), mk(11, 2, 64)
    pool_k, pool_v = mk(12, 16, 2, 64), mk(12, 16, 2, 64)
    table = torch.randperm(12, generator=g).view(3, 4).to(DEVICE, torch.int32)
    lens = torch.tensor([10, 4, 30], dtype=torch.int32, device=DEVICE)
    cos, sin = _rotary_tables(64, 32, dtype)
    kw = dict(cache_seqlens=lens, block_table=table, causal=True, rotary_cos=cos, rotary_sin=sin)
    kc, vc = pool_k.clone(), pool_v.clone()
    qa = dict(cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q)) if packed_q else {}
    out = tileflash.flash_attn_with_kvcache(q if packed_q else q[:, None], kc, vc, k, v, cu_seqlens_k_new=cu_new,
                                            num_splits=2, **qa, **kw)
    out = out.view(q.shape)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    for i, n in enumerate(lens_q):
        rows, new = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_new[i]), int(cu_new[i + 1]))
        one = dict(cache_seqlens=lens[i:i + 1], block_table=table[i:i + 1], causal=True, rotary_cos=cos,
                   rotary_sin=sin)
        kn, vn = (k[None, new], v[None, new]) if new.stop > new.start else (None, None)
        qi = q[None, rows]
        if kn is None:  # no new keys to rotate (the reference's rule): q is still rotated, at cache_seqlens + i
            from tileflash.reference import rotary_ref
            one = {n_: a for n_, a in one.items() if not n_.startswith("rotary")}
            qi = rotary_ref(qi[0], cos, sin, int(lens[i]) + torch.arange(n), True)[None]
        ref, _, new_k, new_v = kvcache_ref(qi, ref_k, ref_v, kn, vn, **one)
        if n:
            ref_lowp, *_ = kvcache_ref(qi, ref_k, ref_v, kn, vn, upcast=False, **one)
            check_2x(out[rows], ref[0], ref_lowp[0])
        ref_k.copy_(new_k), ref_v.copy_(new_v)
    assert torch.allclose(kc.float(), ref_k.float(), atol=1e-2, rtol=1e-2) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("page_size", [512, 300])  # flash-attn 2.x's multiples of 256, and any size past 256
def test_kvcache_pages_above_256_tokens(page_size):
    """A 2-token append from position 510 (crosses a 300-token page, stays in a 512 one) and a 3-token sequence,
    split-KV over two pages per sequence."""
    q, k, v, _, _ = _extras_case(torch.float16, b=2, rows=2, seed=14)
    g = torch.Generator().manual_seed(15)
    pool_k, pool_v = (torch.randn(5, page_size, 2, 64, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([510, 3], dtype=torch.int32, device=DEVICE)
    check_kvcache_call(q, k, v, pool_k, pool_v, cache_seqlens=lens, block_table=table, causal=True, num_splits=2)


# ---- head dims that are not multiples of 8: padded in registers, not in memory ----------------------------------

@pytest.mark.parametrize("d", [59, 20])
def test_head_dims_not_multiples_of_8_forward_and_backward(d):
    from helpers import check_grads
    q, k, v = attention_inputs(2, 37, 45, 4, 2, d, torch.bfloat16, seed=16)
    run = lambda q, k, v: tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True)  # noqa: E731
    ref = lambda q, k, v, upcast: attention_ref(q, k, v, causal=True, upcast=upcast)  # noqa: E731
    out, lse = run(q, k, v)
    check_2x(out, ref(q, k, v, True)[0], ref(q, k, v, False)[0])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    g = torch.Generator().manual_seed(17)
    dout = torch.randn(out.shape, generator=g).to(DEVICE, out.dtype)
    check_grads(run, ref, leaves, dout, torch.zeros_like(lse))


def test_head_dim_59_through_varlen_and_the_cache():
    from tileflash.reference import attention_varlen_ref
    from helpers import packed_inputs
    q, k, v, cu_q, cu_k = packed_inputs([7, 0, 19], [30, 5, 19], 4, 2, 59, torch.float16, seed=18)
    out = tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 30, causal=True)
    check_2x(out, attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)[0],
             attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)[0])
    qd, kn, vn, kc, vc = _extras_case(torch.float16, b=2, rows=2, d=59, seed=19)
    cos, sin = _rotary_tables(48, 58, torch.float16)
    lens = torch.tensor([20, 41], dtype=torch.int32, device=DEVICE)
    check_kvcache_call(qd, kn, vn, kc, vc, cache_seqlens=lens, causal=True, num_splits=2, rotary_cos=cos,
                       rotary_sin=sin, rotary_interleaved=False)


def test_fa3_keywords_of_the_prefill_entry_points():
    """FA3's return_attn_probs gives (out, lse); its scheduling arguments leave the result bit for bit; arguments
    tileflash does not implement are refused by name before any launch."""
    q, k, v = attention_inputs(2, 37, 37, 4, 2, 64, torch.float16)
    out, lse = tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    got = tileflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, num_splits=0, pack_gqa=True,
                                    sm_margin=4, attention_chunk=0, qv=None)
    assert torch.equal(got[0], out) and torch.equal(got[1], lse)
    cu = torch.tensor([0, 37, 74], dtype=torch.int32, device=DEVICE)
    packed = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    vout, vlse = tileflash.flash_attn_varlen_func(*packed, cu, cu, 37, 37, causal=True, return_attn_probs=True,
                                                  pack_gqa=False, sm_margin=0, seqused_q=None)
    assert torch.equal(vout, out.reshape(-1, *out.shape[2:]))
    for call, match, exc in [
        (lambda: tileflash.flash_attn_varlen_func(*packed, cu, cu, 37, 37, seqused_k=cu[1:] - cu[:-1],
                                                  attention_chunk=16), "attention_chunk", NotImplementedError),
        (lambda: tileflash.flash_attn_func(q, k, v, qv=q, attention_chunk=8), "attention_chunk with qv",
         NotImplementedError),
        (lambda: tileflash.flash_attn_func(q, k, v, sm_margin=-1), "sm_margin", ValueError),
        (lambda: tileflash.flash_attn_func(q, k, v, pack_gqa=1), "pack_gqa", ValueError),
        (lambda: tileflash.flash_attn_varlen_func(*packed, cu, cu, 37, 37, seqused_q=cu[1:], attention_chunk=8),
         "attention_chunk", NotImplementedError),
    ]:
        with pytest.raises(exc, match=match):
            call()


def test_fa3_keywords_of_flash_attn_with_kvcache():
    q, kc, vc = _cache(seed=3)
    lens = torch.tensor([30, 17], dtype=torch.int32, device=DEVICE)
    want = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    got = tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, scheduler_metadata=None,
                                            pack_gqa=False, sm_margin=8, attention_chunk=0, rotary_seqlens=None)
    assert torch.equal(want, got)
    # FA3 reads rotary_seqlens only with the rotary tables (its own tests always pass them): ignored without
    assert torch.equal(want, tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                                               rotary_seqlens=lens + 3))
    with pytest.raises(ValueError, match="attention_chunk"):
        tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, attention_chunk=-8)


@pytest.mark.parametrize("q_fp8", [False, True], ids=["q16", "q8"])
@pytest.mark.parametrize("page_size", [None, 8], ids=["contiguous", "paged8"])
def test_fa3_fp8_cache_with_per_sequence_descales(q_fp8, page_size):
    """FA3's FP8 call (SGLang's with an FP8 KV cache): e4m3 caches with k_descale / v_descale [B, Hkv] that differ
    per sequence (and q_descale with an e4m3 q) against the reference on the dequantized values; a per-layer scale
    expanded to [B, Hkv] (stride 0) gives the [Hkv] call's bits."""
    from helpers import make_cache
    from tileflash.reference import fp8_quantize_ref

    b, hq, hkv, d, cap = 3, 8, 2, 64, 48
    g = torch.Generator().manual_seed(7)
    k_hi, v_hi, table = make_cache(b, cap, hkv, d, torch.float32, page_size, g)
    kd = (torch.rand(b, hkv, generator=g) * 0.02 + 0.005).to(DEVICE)
    vd = (torch.rand(b, hkv, generator=g) * 0.02 + 0.005).to(DEVICE)
    rows = (lambda t, i: t[i]) if page_size is None else (lambda t, i: t[table[i].long()])
    k_cache, v_cache = (torch.empty_like(t, dtype=torch.float8_e4m3fn) for t in (k_hi, v_hi))
    for i in range(b):  # each sequence's rows (pages) quantized with its own scales
        idx = i if page_size is None else table[i].long()
        k_cache[idx], v_cache[idx] = fp8_quantize_ref(rows(k_hi, i), kd[i]), fp8_quantize_ref(rows(v_hi, i), vd[i])
    lens = torch.tensor([47, 9, 30], dtype=torch.int32, device=DEVICE)
    q = torch.randn(b, 1, hq, d, generator=g).to(DEVICE, torch.bfloat16)
    kw = dict(cache_seqlens=lens, block_table=table)
    ref, ref_lse, _, _ = kvcache_ref(q, k_cache, v_cache, k_scale=kd, v_scale=vd, **kw)
    ref_lowp, *_ = kvcache_ref(q, k_cache, v_cache, k_scale=kd, v_scale=vd, upcast=False, **kw)
    if q_fp8:  # q = q_descale * q8: the reference's q is that product
        qd = (torch.rand(b, hkv, generator=g) + 0.5).to(DEVICE)
        q8 = (q.float() / qd.repeat_interleave(hq // hkv, 1)[:, None, :, None]).to(torch.float8_e4m3fn)
        q = (q8.float() * qd.repeat_interleave(hq // hkv, 1)[:, None, :, None]).to(torch.bfloat16)
        ref, ref_lse, _, _ = kvcache_ref(q, k_cache, v_cache, k_scale=kd, v_scale=vd, **kw)
        ref_lowp, *_ = kvcache_ref(q, k_cache, v_cache, k_scale=kd, v_scale=vd, upcast=False, **kw)
        out, lse = tileflash.flash_attn_with_kvcache(q8, k_cache, v_cache, q_descale=qd, k_descale=kd,
                                                     v_descale=vd, return_softmax_lse=True, **kw)
    else:
        out, lse = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=kd, v_descale=vd,
                                                     return_softmax_lse=True, **kw)
    assert out.dtype == torch.bfloat16
    check_2x(out, ref, ref_lowp)
    torch.testing.assert_close(lse, ref_lse.to(lse.device), atol=2e-2, rtol=0)
    if not q_fp8:
        per_head = kd[0].contiguous()
        expanded = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=per_head.expand(b, hkv),
                                                     v_descale=per_head.expand(b, hkv), **kw)
        assert torch.equal(expanded, tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_scale=per_head,
                                                                      v_scale=per_head, **kw))


@pytest.mark.parametrize("k_scale", [None, 0.5], ids=["fa3_no_descale", "per_head_scale"])
def test_fp8_new_keys_appended_as_stored(k_scale):
    """FA3's FP8 kvcache call appends e4m3 new keys and values to an e4m3 cache (its tests pass them with no
    descale): their bytes land in the cache as they are, and the attention is over those values. With tileflash's
    per-head scales the e4m3 new tokens are read at that scale too (K = k_scale * k8), as the cache is."""
    g = torch.Generator().manual_seed(12)
    b, sq, hq, hkv, d, cap = 2, 3, 4, 2, 64, 32
    kc, vc = (torch.randn(b, cap, hkv, d, generator=g).to(torch.float8_e4m3fn).to(DEVICE) for _ in range(2))
    k8, v8 = (torch.randn(b, sq, hkv, d, generator=g).to(torch.float8_e4m3fn).to(DEVICE) for _ in range(2))
    q8 = torch.randn(b, sq, hq, d, generator=g).to(torch.float8_e4m3fn).to(DEVICE)
    lens = torch.tensor([20, 7], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, causal=True)
    kc_got, vc_got = kc.clone(), vc.clone()
    if k_scale is None:
        out = tileflash.flash_attn_with_kvcache(q8, kc_got, vc_got, k8, v8, **kw)
        scales = dict(k_scale=torch.ones(1, device=DEVICE), v_scale=torch.ones(1, device=DEVICE))
    else:
        scales = dict(k_scale=torch.full((hkv,), k_scale, device=DEVICE), v_scale=torch.full((hkv,), 2.0,
                                                                                            device=DEVICE))
        out = tileflash.flash_attn_with_kvcache(q8.to(torch.bfloat16), kc_got, vc_got, k8, v8, **kw, **scales)
    for i, n in enumerate(lens.tolist()):
        assert torch.equal(kc_got[i, n:n + sq].view(torch.uint8), k8[i].view(torch.uint8))
        assert torch.equal(vc_got[i, n:n + sq].view(torch.uint8), v8[i].view(torch.uint8))
    # the same call over the cache that holds them (the new keys counted in the lengths)
    want = tileflash.flash_attn_with_kvcache(q8.to(torch.bfloat16), kc_got.clone(), vc_got.clone(),
                                             cache_seqlens=lens + sq, causal=True, **scales)
    assert torch.equal(out, want)


def test_fa3_fp8_call_with_e4m3_rotary_tables():
    """FA3's FP8 kvcache tests cast the rotary tables to the e4m3 q's dtype too: taken (widened exactly), the same
    result as the float32 tables of those values."""
    g = torch.Generator().manual_seed(13)
    b, sq, hq, hkv, d, cap = 2, 2, 4, 2, 64, 32
    kc, vc = (torch.randn(b, cap, hkv, d, generator=g).to(torch.float8_e4m3fn).to(DEVICE) for _ in range(2))
    k8, v8 = (torch.randn(b, sq, hkv, d, generator=g).to(torch.float8_e4m3fn).to(DEVICE) for _ in range(2))
    q8 = torch.randn(b, sq, hq, d, generator=g).to(torch.float8_e4m3fn).to(DEVICE)
    cos, sin = (t.to(torch.float8_e4m3fn) for t in _rotary_tables(cap, 32, torch.float32))
    lens = torch.tensor([20, 7], dtype=torch.int32, device=DEVICE)
    caches = [[kc.clone(), vc.clone()] for _ in range(2)]
    got = tileflash.flash_attn_with_kvcache(q8, *caches[0], k8, v8, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                            causal=True, rotary_seqlens=lens)
    want = tileflash.flash_attn_with_kvcache(q8, *caches[1], k8, v8, rotary_cos=cos.float(), rotary_sin=sin.float(),
                                             cache_seqlens=lens, causal=True)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(*caches))


def test_fa3_fp8_errors():
    q, kc, vc = _cache(seed=4)
    lens = torch.tensor([30, 17], dtype=torch.int32, device=DEVICE)
    k8, v8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    qb = q.to(torch.bfloat16)
    d2 = torch.ones(2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="float8_e4m3fn caches"):
        tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, k_descale=d2, v_descale=d2)
    with pytest.raises(ValueError, match="one way"):
        tileflash.flash_attn_with_kvcache(qb, k8, v8, cache_seqlens=lens, k_descale=d2, v_descale=d2,
                                          k_scale=d2[0], v_scale=d2[0])
    with pytest.raises(ValueError, match=r"\[batch, Hkv\]"):
        tileflash.flash_attn_with_kvcache(qb, k8, v8, cache_seqlens=lens, k_descale=torch.ones(3, 2, device=DEVICE),
                                          v_descale=torch.ones(3, 2, device=DEVICE))
    new = torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(NotImplementedError, match="appends"):
        tileflash.flash_attn_with_kvcache(qb, k8, v8, new, new, cache_seqlens=lens, k_descale=d2, v_descale=d2)


def test_fa3_fp8_descales_with_ragged_packed_queries():
    """SGLang's extend over an FP8 paged cache: packed queries of 5, 0 and 19 tokens (the prefill tiles), causal,
    each sequence with its own k_descale / v_descale row, against the per-sequence reference."""
    from helpers import make_cache
    from tileflash.reference import fp8_quantize_ref

    g = torch.Generator().manual_seed(17)
    b, hq, hkv, d, page = 3, 4, 2, 64, 16
    k_hi, v_hi, table = make_cache(b, 48, hkv, d, torch.float32, page, g)
    kd = (torch.rand(b, hkv, generator=g) * 0.02 + 0.005).to(DEVICE)
    vd = (torch.rand(b, hkv, generator=g) * 0.02 + 0.005).to(DEVICE)
    k8, v8 = torch.empty_like(k_hi, dtype=torch.float8_e4m3fn), torch.empty_like(v_hi, dtype=torch.float8_e4m3fn)
    for i in range(b):
        pages = table[i].long()
        k8[pages], v8[pages] = fp8_quantize_ref(k_hi[pages], kd[i]), fp8_quantize_ref(v_hi[pages], vd[i])
    cu = torch.tensor([0, 5, 5, 24], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([40, 4, 29], dtype=torch.int32, device=DEVICE)  # keys including each sequence's queries
    q = torch.randn(24, hq, d, generator=g).to(DEVICE, torch.bfloat16)
    out = tileflash.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, causal=True,
                                            cu_seqlens_q=cu, max_seqlen_q=19, k_descale=kd, v_descale=vd)
    for i in (0, 2):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        kw = dict(cache_seqlens=lens[i:i + 1], block_table=table[i:i + 1], causal=True, k_scale=kd[i], v_scale=vd[i])
        ref, *_ = kvcache_ref(q[None, rows], k8, v8, **kw)
        ref_lowp, *_ = kvcache_ref(q[None, rows], k8, v8, upcast=False, **kw)
        check_2x(out[rows], ref[0], ref_lowp[0])


def test_e4m3_queries_with_tileflash_cache_scales():
    """An e4m3 q (FA3's FP8 call) over an FP8 cache with tileflash's per-head k_scale / v_scale: the call of its
    exact bfloat16 values, bit for bit."""
    q, kc, vc = _cache(seed=5)
    lens = torch.tensor([30, 17], dtype=torch.int32, device=DEVICE)
    k8, v8 = (kc.float() * 20).to(torch.float8_e4m3fn), (vc.float() * 20).to(torch.float8_e4m3fn)
    scales = dict(k_scale=torch.full((2,), 0.05, device=DEVICE), v_scale=torch.tensor([0.05, 0.04], device=DEVICE))
    q8 = q.to(torch.float8_e4m3fn)
    want = tileflash.flash_attn_with_kvcache(q8.to(torch.bfloat16), k8, v8, cache_seqlens=lens, **scales)
    assert torch.equal(tileflash.flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=lens, **scales), want)


# (batch, Sq, Hq, Hkv, D, capacity, chunk, causal, window, page size, splits, new tokens) — why each is here:
CHUNK_CASES = [
    (3, 1, 8, 2, 64, 96, 16, True, (-1, -1), 0, 0, 0),  # decode: the last chunk only, pack-GQA tiles
    (2, 5, 4, 1, 64, 80, 7, True, (-1, -1), 8, 3, 0),  # rows across chunk edges, pages, three splits
    (2, 4, 4, 2, 32, 64, 12, False, (10, 3), 0, 1, 2),  # a window with it, not causal (chunks bound the right too)
    (2, 20, 4, 2, 64, 96, 16, True, (-1, -1), 16, 0, 3),  # extend (prefill tiles) over pages with an append
]


@pytest.mark.parametrize("case", CHUNK_CASES, ids=[f"case{i}" for i in range(len(CHUNK_CASES))])
def test_fa3_attention_chunk_over_a_cache(case):
    """FA3's attention_chunk on flash_attn_with_kvcache (Llama 4's chunked attention; FA3's kvcache tests draw one
    for every causal or local case): each query sees only its chunk's keys, against the reference's mask."""
    b, sq, hq, hkv, d, cap, chunk, causal, window, page, splits, s_new = case
    g = torch.Generator().manual_seed(sq + chunk)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, torch.bfloat16)  # noqa: E731
    q = mk(b, sq, hq, d)
    table = None
    if page:
        pages = b * cap // page
        kc, vc = mk(pages + 2, page, hkv, d), mk(pages + 2, page, hkv, d)
        table = torch.randperm(pages + 2, generator=g)[:pages].view(b, -1).to(DEVICE, torch.int32)
    else:
        kc, vc = mk(b, cap, hkv, d), mk(b, cap, hkv, d)
    lens = torch.randint(sq, cap - s_new, (b,), generator=g).to(DEVICE, torch.int32)
    k, v = (mk(b, s_new, hkv, d) if s_new else None for _ in range(2))
    kw = dict(cache_seqlens=lens, block_table=table, causal=causal, window_size=window, attention_chunk=chunk)
    out = check_kvcache_call(q, k, v, kc, vc, num_splits=splits, **kw)
    plan = tileflash.decode_plan(q, kc.clone(), vc.clone(), lens, block_table=table, causal=causal,
                                 window_size=window, attention_chunk=chunk, num_splits=splits)
    if not s_new:
        assert torch.equal(plan.run(q, kc, vc), out)


def test_fa3_cache_batch_idx_over_pages():
    """FA3 takes cache_batch_idx with a page table: sequence b reads the pages of table row cache_batch_idx[b] (its
    own kvcache tests give a table of 2B rows), the same as the gathered table; appends land in those pages."""
    q, _, _ = _cache(seed=4)
    g = torch.Generator().manual_seed(5)
    pool = [torch.randn(12, 8, 2, 64, generator=g).to(DEVICE, torch.float16) for _ in range(2)]
    table = torch.randperm(12, generator=g)[:12].view(4, 3).to(DEVICE, torch.int32)  # 4 rows for 2 sequences
    idx = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([19, 6], dtype=torch.int32, device=DEVICE)
    k, v = (torch.randn(2, 4, 2, 64, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    caches = [[c.clone() for c in pool] for _ in range(2)]
    got = tileflash.flash_attn_with_kvcache(q, *caches[0], k, v, cache_seqlens=lens, page_table=table,
                                            cache_batch_idx=idx, causal=True)
    want = tileflash.flash_attn_with_kvcache(q, *caches[1], k, v, cache_seqlens=lens, page_table=table[idx.long()],
                                             causal=True)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(*caches))
    with pytest.raises(ValueError, match=r"cache_batch_idx: expected values in \[0, 4\)"):
        tileflash.flash_attn_with_kvcache(q, *pool, cache_seqlens=lens, page_table=table, cache_batch_idx=idx + 1,
                                          validate=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_fa3_rotary_seqlens(causal, interleaved):
    """FA3's rotary_seqlens: q and the new k rotate from their own positions (here 5 and 40 tokens away from the
    cache lengths), the append still lands at cache_seqlens; against the reference of the pre-rotated q and k."""
    from tileflash.reference import rotary_ref

    g = torch.Generator().manual_seed(9)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, torch.float16)  # noqa: E731
    b, sq, hq, hkv, d, cap = 2, 3, 4, 2, 64, 64
    q, kc, vc, k, v = mk(b, sq, hq, d), mk(b, cap, hkv, d), mk(b, cap, hkv, d), mk(b, sq, hkv, d), mk(b, sq, hkv, d)
    lens = torch.tensor([20, 7], dtype=torch.int32, device=DEVICE)
    ro = torch.tensor([25, 47], dtype=torch.int32, device=DEVICE)
    angle = torch.arange(96)[:, None] * (1e-2 * torch.arange(1, 17))[None, :]  # rotary_dim 32 < d
    cos, sin = angle.cos().to(DEVICE, torch.float16), angle.sin().to(DEVICE, torch.float16)
    kc_got, vc_got = kc.clone(), vc.clone()
    out = tileflash.flash_attn_with_kvcache(q, kc_got, vc_got, k, v, rotary_cos=cos, rotary_sin=sin,
                                            cache_seqlens=lens, causal=causal, rotary_interleaved=interleaved,
                                            rotary_seqlens=ro)
    q_rot, k_rot = torch.empty_like(q), torch.empty_like(k)
    for i in range(b):
        q_pos = int(ro[i]) + (torch.arange(sq) if causal else torch.zeros(sq, dtype=torch.long))
        q_rot[i] = rotary_ref(q[i], cos, sin, q_pos, interleaved)
        k_rot[i] = rotary_ref(k[i], cos, sin, int(ro[i]) + torch.arange(sq), interleaved)
    ref, _, kc_ref, vc_ref = kvcache_ref(q_rot, kc, vc, k_rot, v, cache_seqlens=lens, causal=causal)
    ref_lowp, *_ = kvcache_ref(q_rot, kc, vc, k_rot, v, cache_seqlens=lens, causal=causal, upcast=False)
    check_2x(out, ref, ref_lowp)
    assert torch.equal(kc_got, kc_ref) and torch.equal(vc_got, vc_ref)
    # cache_seqlens itself as rotary_seqlens: the default positions, also where rotary_seqlens is not taken (packed
    # queries), as FA3's tests pass it
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, causal=causal, rotary_interleaved=interleaved)
    want = tileflash.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
    assert torch.equal(want, tileflash.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, rotary_seqlens=lens,
                                                               **kw))
    cu = torch.arange(0, b * sq + 1, sq, dtype=torch.int32, device=DEVICE)
    packed = tileflash.flash_attn_with_kvcache(q.flatten(0, 1), kc.clone(), vc.clone(), k.flatten(0, 1),
                                               v.flatten(0, 1), cu_seqlens_q=cu, cu_seqlens_k_new=cu, max_seqlen_q=sq,
                                               rotary_seqlens=lens, **kw)
    assert torch.equal(packed.view_as(want), want)
    with pytest.raises(ValueError, match="rotary_seqlens"):
        tileflash.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=lens, rotary_seqlens=ro - 30, validate=True)


def test_chunk_pieces_table():
    from tileflash.ops.repack import chunk_pieces

    assert chunk_pieces(10, 10, 4) == [(4, 4), (4, 4), (2, 2)]
    assert chunk_pieces(3, 10, 4) == [(0, 4), (1, 4), (2, 2)]  # the keys of a chunk without queries first
    assert chunk_pieces(6, 3, 2) == [(1, 0), (2, 0), (2, 2), (1, 1)]  # queries before every key see none
    assert chunk_pieces(5, 8, 16) == [(5, 8)]  # one chunk: the plain call


@pytest.mark.parametrize("sq,sk,chunk,causal,window", [
    (37, 37, 8, True, (-1, -1)),  # Llama 4's layout: causal within chunks
    (20, 45, 16, True, (-1, -1)),  # fewer queries than keys (bottom-right), a chunk without queries
    (30, 19, 8, False, (-1, -1)),  # more queries than keys, block-diagonal
    (33, 33, 16, True, (5, -1)),  # a sliding window inside the chunks
], ids=["causal", "prefix", "sq>sk", "window"])
def test_attention_chunk_forward_and_backward(sq, sk, chunk, causal, window):
    """FA3's attention_chunk on flash_attn_func against the reference's chunk mask: out, lse and the gradients
    (GQA, per-sequence ALiBi slopes, a sink)."""
    from helpers import check_grads, check_out_lse

    q, k, v = attention_inputs(2, sq, sk, 4, 2, 64, torch.float16, seed=3)
    slopes = torch.rand(2, 4, device=DEVICE) * 0.1
    sink = torch.randn(4, device=DEVICE)
    kw = dict(causal=causal, window_size=window, alibi_slopes=slopes, learnable_sink=sink)
    run = lambda q, k, v: tileflash.flash_attn_func(q, k, v, attention_chunk=chunk, return_lse=True, **kw)  # noqa
    ref = lambda q, k, v, upcast=True: attention_ref(q, k, v, attention_chunk=chunk, upcast=upcast, **kw)  # noqa
    check_out_lse(run(q, k, v), lambda upcast: ref(q, k, v, upcast))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    g = torch.Generator().manual_seed(4)
    dout = torch.randn(2, sq, 4, 64, generator=g).to(DEVICE, torch.float16)
    dlse = torch.randn(2, 4, sq, generator=g).to(DEVICE)
    check_grads(run, ref, leaves, dout, dlse)
    with pytest.raises(ValueError, match="attention_chunk"):
        tileflash.flash_attn_func(q, k, v, attention_chunk=-4)


def _check_packed_run(run, ref, q, k, v, seed: int):
    """run(q, k, v) -> (out, lse) of packed sequences against ref(q, k, v, upcast): out by the 2x rule, lse, and the
    gradients of q, k, v."""
    from helpers import check_grads, check_lse

    out, lse = run(q, k, v)
    check_2x(out, ref(q, k, v)[0], ref(q, k, v, False)[0])
    check_lse(lse, ref(q, k, v)[1])
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(q.shape, generator=g).to(DEVICE, torch.float16)
    dlse = torch.randn(lse.shape, generator=g).to(DEVICE)
    check_grads(run, ref, [t.clone().requires_grad_() for t in (q, k, v)], dout, dlse)


def test_attention_chunk_varlen():
    """attention_chunk on packed sequences (pieces from device lengths, no sync): empty, shorter-than-a-chunk and
    prefix-shaped sequences, causal, against the per-sequence reference; with gradients."""
    from helpers import packed_inputs
    from tileflash.reference import attention_varlen_ref

    lens_q, lens_k = [13, 0, 5, 30], [13, 7, 21, 30]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 64, torch.float16, seed=6)
    kw = dict(causal=True, attention_chunk=8)
    run = lambda q, k, v: tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),  # noqa
                                                           return_lse=True, **kw)
    ref = lambda q, k, v, upcast=True: attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=upcast, **kw)  # noqa
    _check_packed_run(run, ref, q, k, v, seed=2)
    with pytest.raises(NotImplementedError, match="attention_chunk with seqused_k"):
        tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, seqused_k=cu_k[1:] - cu_k[:-1],
                                         attention_chunk=8)


def test_kvcache_without_cache_seqlens_reads_the_whole_cache_and_empty_batches():
    """flash-attn 2.x: without cache_seqlens (and no new keys) every sequence is the whole cache; an empty batch
    returns an empty output (decode tiles and split planning included)."""
    q, kc, vc = _cache(seed=6)
    whole = tileflash.flash_attn_with_kvcache(q, kc, vc, causal=True)
    assert torch.equal(whole, tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=kc.shape[1], causal=True))
    with pytest.raises(ValueError, match="cache_seqlens: required with new keys"):
        tileflash.flash_attn_with_kvcache(q, kc, vc, kc[:, :1], vc[:, :1])
    for sq in (1, 3):
        empty_q = torch.zeros(0, sq, 4, 64, dtype=q.dtype, device=DEVICE)
        empty_kv = torch.zeros(0, 8, 2, 64, dtype=q.dtype, device=DEVICE)
        out = tileflash.flash_attn_with_kvcache(empty_q, empty_kv, empty_kv.clone(),
                                                cache_seqlens=torch.zeros(0, dtype=torch.int32, device=DEVICE))
        assert out.shape == empty_q.shape


def test_packed_queries_in_a_buffer_of_batch_times_max_rows_with_ragged_counts():
    """q with batch * max_seqlen_q rows but ragged cu_seqlens_q (a speculative-decoding buffer): the rows past
    cu_seqlens_q[-1] belong to no sequence, so the result is that of q trimmed to cu_seqlens_q[-1] rows (checked on
    the CPU for free, with validate=True on the GPU)."""
    g = torch.Generator().manual_seed(12)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, torch.float16)  # noqa: E731
    kc, vc, q6 = mk(2, 32, 1, 16), mk(2, 32, 1, 16), mk(6, 2, 16)
    lens = torch.tensor([10, 20], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, cu_seqlens_q=cu, max_seqlen_q=3, causal=True, return_softmax_lse=True,
              validate=True)
    out6, lse6 = tileflash.flash_attn_with_kvcache(q6, kc, vc, **kw)
    out3, lse3 = tileflash.flash_attn_with_kvcache(q6[:3], kc, vc, **kw)
    assert torch.equal(out6[:3], out3) and torch.equal(lse6[:, :3], lse3)


def test_fa3_seqused_q():
    """FA3's seqused_q: each sequence's first seqused_q[b] rows are its queries (bottom-right aligned to its keys);
    the other rows give out 0 and lse -inf; gradients flow to the used rows only."""
    from helpers import packed_inputs

    lens_q, lens_k, used = [13, 0, 5, 30], [13, 7, 21, 30], [7, 0, 5, 12]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 64, torch.float16, seed=7)
    seqused_q = torch.tensor(used, dtype=torch.int32, device=DEVICE)

    def ref(q, k, v, upcast=True):
        out = torch.zeros_like(q, dtype=q.dtype if not upcast else torch.float32)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
        for b, n in enumerate(used):
            q0, k0, k1 = int(cu_q[b]), int(cu_k[b]), int(cu_k[b + 1])
            if n:
                o, l = attention_ref(q[None, q0:q0 + n], k[None, k0:k1], v[None, k0:k1], causal=True, upcast=upcast)
                out[q0:q0 + n], lse[:, q0:q0 + n] = o[0], l[0]
        return out.to(q.dtype), lse

    run = lambda q, k, v: tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, causal=True,  # noqa: E731
                                                           return_lse=True, seqused_q=seqused_q)
    _check_packed_run(run, ref, q, k, v, seed=3)


def test_flash_attn_2x_positional_dropout_is_not_a_zero_scale():
    """flash-attn 2.x's flash_attn_func(q, k, v, 0.0): its fourth argument is dropout_p, here FA3's softmax_scale;
    0 would average the values uniformly without a word, so it is refused with a pointer to the keyword."""
    q, k, v = attention_inputs(1, 17, 17, 2, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="dropout_p=0.0 by name"):
        tileflash.flash_attn_func(q, k, v, 0.0, causal=True)
    tileflash.flash_attn_func(q, k, v, dropout_p=0.0, causal=True)
