"""Numerical edge cases and their documented behaviour (docs/api.md "Numerical behaviour")."""
import pytest
import torch

import tileflash
from helpers import DEVICE, check_2x
from tileflash.reference import attention_ref, kvcache_ref

F16 = torch.float16


def _qkv(b, sq, sk, hq, hkv, d, dtype=F16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * scale).to(DEVICE, dtype) for s in
            ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_large_scores_stay_finite_and_correct(dtype):
    # |q.k| * scale reaches ~1e4: exp2 of huge differences, a softmax that is one-hot per row.
    q, k, v = _qkv(1, 33, 47, 2, 2, 64, dtype, seed=1, scale=30.0 if dtype == F16 else 100.0)
    out, lse = tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    ref_lowp, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_2x(out, ref, ref_lowp)
    assert (lse - ref_lse).abs().max().item() <= 1e-3 * ref_lse.abs().max().item()


def test_softcap_with_huge_scores():
    q, k, v = _qkv(1, 20, 20, 2, 1, 32, seed=2, scale=40.0)
    out = tileflash.flash_attn_func(q, k, v, softcap=30.0)
    ref, _ = attention_ref(q, k, v, softcap=30.0)
    ref_lowp, _ = attention_ref(q, k, v, softcap=30.0, upcast=False)
    check_2x(out, ref, ref_lowp)


def test_all_equal_scores_average_values():
    q, _, v = _qkv(1, 5, 37, 2, 2, 32, seed=3)
    k = torch.ones(1, 37, 2, 32, device=DEVICE, dtype=F16)
    out = tileflash.flash_attn_func(q, k, v)
    expected = v.float().mean(dim=1, keepdim=True).expand(-1, 5, -1, -1).repeat_interleave(1, dim=2)
    assert (out.float() - expected).abs().max().item() <= 2e-3


def test_nan_in_a_query_row_stays_in_that_row():
    q, k, v = _qkv(2, 9, 9, 2, 2, 32, seed=4)
    q[0, 3, 1, 5] = float("nan")
    out = tileflash.flash_attn_func(q, k, v, causal=True)
    nan = torch.isnan(out).any(dim=-1)
    expected = torch.zeros_like(nan)
    expected[0, 3, 1] = True
    assert torch.equal(nan, expected)


def test_nan_in_a_key_reaches_exactly_the_rows_that_see_it():
    # Key 6 of sequence 0, head 0 is NaN: with causal masking queries 0..5 never see it and stay finite; queries
    # 6..8 read it and are NaN; the other head and the other sequence are untouched.
    q, k, v = _qkv(2, 9, 9, 2, 2, 32, seed=5)
    k[0, 6, 0, 0] = float("nan")
    out = tileflash.flash_attn_func(q, k, v, causal=True)
    nan = torch.isnan(out).any(dim=-1)
    expected = torch.zeros_like(nan)
    expected[0, 6:, 0] = True
    assert torch.equal(nan, expected)
    ref, _ = attention_ref(q[1:], k[1:], v[1:], causal=True)
    assert (out[1:].float() - ref.float()).abs().max().item() <= 2e-3


def test_nan_in_a_value_does_not_cross_sequences_or_heads():
    # A NaN value reaches the rows that attend to its key; it may also reach rows of the same query tile that mask
    # that key (0 * NaN inside the P @ V product), but never another head or sequence.
    q, k, v = _qkv(2, 9, 9, 2, 2, 32, seed=6)
    v[0, 8, 1, 0] = float("nan")
    out = tileflash.flash_attn_func(q, k, v, causal=True)
    assert torch.isnan(out[0, 8, 1]).any()
    assert torch.isfinite(out[0, :, 0]).all() and torch.isfinite(out[1]).all()


def test_minus_inf_key_is_never_attended():
    # A key of -inf scores -inf for positive q components: such a key gets zero weight, never NaN.
    q, k, v = _qkv(1, 4, 6, 1, 1, 16, seed=7)
    q = q.abs()
    k[0, 2] = float("-inf")
    out = tileflash.flash_attn_func(q, k, v)
    keep = [0, 1, 3, 4, 5]
    ref, _ = attention_ref(q, k[:, keep], v[:, keep])
    assert torch.isfinite(out).all()
    assert (out.float() - ref.float()).abs().max().item() <= 2e-3


def test_decode_independent_of_page_size_and_order():
    """The same logical cache, contiguous and paged (page 1, page 16 in two different orders), gives the same
    output within rounding."""
    g = torch.Generator().manual_seed(8)
    b, cap, hkv, d = 2, 64, 2, 32
    k = torch.randn(b, cap, hkv, d, generator=g).to(DEVICE, F16)
    v = torch.randn(b, cap, hkv, d, generator=g).to(DEVICE, F16)
    q = torch.randn(b, 1, 8, d, generator=g).to(DEVICE, F16)
    lens = torch.tensor([64, 23], dtype=torch.int32, device=DEVICE)
    outs = [tileflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)]
    for page, seed in ((1, 0), (16, 0), (16, 1)):
        n = b * cap // page
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        kp = torch.empty(n, page, hkv, d, dtype=F16, device=DEVICE)
        vp = torch.empty_like(kp)
        kp[perm.to(DEVICE)] = k.reshape(n, page, hkv, d)
        vp[perm.to(DEVICE)] = v.reshape(n, page, hkv, d)
        table = perm.reshape(b, cap // page).to(DEVICE, torch.int32)
        outs.append(tileflash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table))
    ref, _, _, _ = kvcache_ref(q, k, v, cache_seqlens=lens)
    for out in outs:
        assert (out.float() - ref.float()).abs().max().item() <= 2e-3
        assert (out.float() - outs[0].float()).abs().max().item() <= 1e-3
