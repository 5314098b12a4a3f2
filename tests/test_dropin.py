"""flash-attn drop-in behaviour: its defaults (flash_attn_with_kvcache is not causal unless asked), its argument
forms (dropout_p as a keyword, cache_seqlens as an int, window_size as a tensor), its packed entry points, and
errors a flash-attn caller catches (RuntimeError for a cache too small)."""
import pytest
import torch

import tileflash
from helpers import DEVICE, attention_inputs, check_2x
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
        tileflash.flash_attn_func(q, k, v, dropout_p=0.1)


def test_cache_too_small_is_a_runtime_error_too():
    q, kc, vc = _cache(ctx=8, seed=2)
    new = torch.zeros(2, 9, 2, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(RuntimeError, match="capacity"):
        tileflash.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=0)
    with pytest.raises(ValueError, match="capacity"):
        tileflash.flash_attn_with_kvcache(q, kc, vc, new[:, :2], new[:, :2], cache_seqlens=7)


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
