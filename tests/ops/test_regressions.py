"""Named regression tests: each failure found while fuzzing the public ops (tests/ops/test_fuzz.py and the probing
around it), with its minimal failing example written out. Each was fixed in the library; the test keeps it fixed.

The inputs of the index-tensor cases are chosen so that the buggy path stays inside every buffer: a wrong read
there gives wrong numbers (or leaves poisoned NaN rows), never a crash of the test process.
"""
import pytest
import torch

import tileflash
from helpers import DEVICE, check_2x, check_lse
from tileflash.reference import attention_ref, attention_varlen_ref, kvcache_ref


def _strided_int32(values, fillers):
    """A 1-D int32 tensor holding `values` with stride 2: the element after values[i] is fillers[i]."""
    storage = torch.tensor([x for pair in zip(values, fillers) for x in pair], dtype=torch.int32, device=DEVICE)
    t = storage[::2]
    assert t.tolist() == list(values) and t.stride() == (2,)
    return t


def _raises_naming(exc: Exception, name: str) -> bool:
    return isinstance(exc, (ValueError, TypeError)) and name in str(exc)


# --- Index tensors with a non-unit stride -------------------------------------------------------------------------
# docs/api.md: "the last dim of every tensor must be contiguous" and bad inputs "raise ValueError/TypeError naming the
# argument, before any launch". The 1-D int32 index tensors (cache_seqlens, cu_seqlens_q/k, seqused_k) are checked
# for dtype, rank and device only (_utils.check_int32), and the kernels read them as `ptr + b`, i.e. as if their
# stride were 1: attn_fwd_kernel (cu_seqlens_q_ptr + b, cu_seqlens_k_ptr + b, seqlens_k_ptr + b) and
# kv_append_kernel (cache_seqlens_ptr + b). A stride-2 view silently reads the filler elements instead. With other
# fillers the varlen case reads garbage offsets and corrupted the heap in a probe ("free(): invalid next size"), and
# kv_append (which does not clamp) can write past the cache. Either a ValueError naming the argument or the correct
# result passes these tests.

def test_kvcache_strided_cache_seqlens():
    # Contiguous cache, B=2, Hq=Hkv=2, D=16, one decode token, one appended token. cache_seqlens [5, 20] stored as
    # [5, 0, 20, 0][::2]: the kernels read [5, 0], so sequence 1 attends over 1 token instead of 21 and its new
    # token is appended at position 0 instead of 20 (both in bounds).
    g = torch.Generator().manual_seed(0)
    b, cap, hkv, d = 2, 32, 2, 16
    q = torch.randn(b, 1, hkv, d, generator=g).to(DEVICE, torch.float16)
    k_cache = torch.randn(b, cap, hkv, d, generator=g).to(DEVICE, torch.float16)
    v_cache = torch.randn(b, cap, hkv, d, generator=g).to(DEVICE, torch.float16)
    k = torch.randn(b, 1, hkv, d, generator=g).to(DEVICE, torch.float16)
    v = torch.randn(b, 1, hkv, d, generator=g).to(DEVICE, torch.float16)
    seqlens = _strided_int32([5, 20], fillers=[0, 0])
    ref, ref_lse, ref_k, ref_v = kvcache_ref(q, k_cache, v_cache, k, v, seqlens)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, k, v, seqlens, upcast=False)
    try:
        out, lse = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                     num_splits=1, return_lse=True)
    except Exception as e:  # rejecting the layout is a fix too
        assert _raises_naming(e, "cache_seqlens"), e
        return
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "appended cache contents differ"


def test_varlen_strided_cu_seqlens():
    # Two sequences of 10 and 20 tokens, Hq=Hkv=2, D=16, non-causal. cu_seqlens [0, 10, 30] stored as
    # [0, 0, 10, 10, 30, 30][::2]: the kernel reads offsets [0, 0, 10], i.e. lengths 0 and 10, so tokens 10..29
    # are never written (they keep the NaN poison; without poisoning they are uninitialised memory).
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, 2, 16, generator=g).to(DEVICE, torch.float16) for _ in range(3))
    cu = _strided_int32([0, 10, 30], fillers=[0, 10, 30])
    ref, ref_lse = attention_varlen_ref(q, k, v, cu, cu)
    ref_lowp, _ = attention_varlen_ref(q, k, v, cu, cu, upcast=False)
    try:
        out, lse = tileflash.flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, return_lse=True)
    except Exception as e:
        assert _raises_naming(e, "cu_seqlens"), e
        return
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


def test_varlen_strided_seqused_k():
    # Two sequences of 8 queries / 24 keys, seqused_k [24, 3] stored as [24, 0, 3, 0][::2]: the kernel reads
    # [24, 0], so sequence 1 sees no key (out 0, lse -inf) instead of its first 3.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(16, 2, 16, generator=g).to(DEVICE, torch.float16)
    k, v = (torch.randn(48, 2, 16, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    cu_q = torch.tensor([0, 8, 16], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 24, 48], dtype=torch.int32, device=DEVICE)
    used = _strided_int32([24, 3], fillers=[0, 0])
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, used)
    ref_lowp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, used, upcast=False)
    try:
        out, lse = tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 24, seqused_k=used, return_lse=True)
    except Exception as e:
        assert _raises_naming(e, "seqused_k"), e
        return
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


# --- merge_attn_states with head dim 0 ----------------------------------------------------------------------------
def test_merge_head_dim_zero_still_merges_lse():
    # out [1, 3, 2, 0], lse [1, 2, 3]. docs/api.md: merge supports "any" head dim. _merge_impl returns early when
    # out.numel() == 0, before the kernel writes lse, so lse is whatever new_output left there (NaN when poisoned,
    # uninitialised memory otherwise) instead of logaddexp(lse_a, lse_b). Branch: the empty-output early return.
    g = torch.Generator().manual_seed(0)
    oa = torch.empty(1, 3, 2, 0, dtype=torch.float16, device=DEVICE)
    la, lb = (torch.randn(1, 2, 3, generator=g).to(DEVICE) for _ in range(2))
    out, lse = tileflash.merge_attn_states(oa, la, oa.clone(), lb)
    assert out.shape == oa.shape
    check_lse(lse, torch.logaddexp(la, lb), atol=1e-5)


# --- Empty K/V on the TMA path ------------------------------------------------------------------------------------
# test_fuzz on the H200 (2026-11-30, session 4): flash_attn_func with Sk = 0 at a power-of-two head dim, where the
# tile config reads K/V through TMA descriptors (d128 non-causal), built a descriptor with a zero dim and triton's
# TensorDescriptor asserted ("shape must be positive") instead of returning out = 0, lse = -inf. The interpreter's
# tiles did not use TMA then, so the CPU suite could not see it; they now load K/V the GPU's way (heuristics), and
# the descriptor builder is checked directly here too.

@pytest.mark.parametrize("d, causal", [(128, False), (128, True), (64, False), (256, False)])
def test_empty_keys_at_power_of_two_head_dims(d, causal):
    q = torch.randn(1, 3, 2, d, device=DEVICE, dtype=torch.float16)
    k = torch.empty(1, 0, 2, d, device=DEVICE, dtype=torch.float16)
    out, lse = tileflash.flash_attn_func(q, k, k.clone(), causal=causal, return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_empty_keys_backward():
    # The fuzz case's backward twin: gradients through an attention over no keys are zero for q, empty for k, v.
    q = torch.randn(1, 3, 2, 128, device=DEVICE, dtype=torch.float16, requires_grad=True)
    k, v = (torch.empty(1, 0, 2, 128, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in range(2))
    tileflash.flash_attn_func(q, k, v).float().sum().backward()
    assert torch.all(q.grad == 0) and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_no_tma_descriptor_over_zero_rows():
    from tileflash.launch.tensors import row_descriptors

    k = torch.empty(1, 0, 2, 128, dtype=torch.float16)
    assert row_descriptors((k, k.clone()), 0, 128) is None


# --- cu_seqlens past the packed rows -------------------------------------------------------------------------------
# Probe (session 4): q of 12 packed rows with cu_seqlens_q = [0, 5, 20] wrote sequence 1's rows 12..19 past the end
# of out (the process then died in free(): "invalid next size"). cu_seqlens are device values (no check without a
# sync), so the kernels clamp them to the packed row counts: no read or write leaves the tensors, forward or backward.

def test_cu_seqlens_past_the_packed_rows_stay_in_bounds():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(12, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_()
    k = torch.randn(10, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_()
    v = torch.randn(10, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_()
    cu_q = torch.tensor([0, 5, 20], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 6, 16], dtype=torch.int32, device=DEVICE)
    out = tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 15, 10, causal=True)
    out.float().sum().backward()
    # Sequence 0 lies inside both tensors: its rows are exact; the clamped sequence 1 only has to stay finite.
    ref, _ = attention_varlen_ref(q.detach(), k.detach(), v.detach(), cu_q[:2], cu_k[:2], causal=True)
    check_2x(out[:5].detach(), ref[:5], attention_varlen_ref(q.detach(), k.detach(), v.detach(), cu_q[:2], cu_k[:2],
                                                             causal=True, upcast=False)[0][:5])
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


# --- Windows wider than any sequence ---------------------------------------------------------------------------------
# Probe (session 4): window_size=(-1, 2**31 - 1) masked every key (out 0, lse -inf): the kernels add the window to
# int32 positions and it wrapped. A window of 2**30 or more covers any sequence and is now unbounded; non-int
# windows (1.7) are refused instead of truncated.

@pytest.mark.parametrize("window", [(-1, 2 ** 31 - 1), (2 ** 31 - 1, -1), (2 ** 64, 2 ** 40)])
def test_huge_windows_are_unbounded(window):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 2, 32, generator=g).to(DEVICE, torch.float16)
    k, v = (torch.randn(1, 6, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    for causal in (False, True):
        out = tileflash.flash_attn_func(q, k, v, causal=causal, window_size=window)
        assert torch.equal(out, tileflash.flash_attn_func(q, k, v, causal=causal))


def test_non_int_windows_are_refused():
    q = torch.randn(1, 4, 2, 32, device=DEVICE, dtype=torch.float16)
    with pytest.raises(TypeError, match="window_size"):
        tileflash.flash_attn_func(q, q, q, window_size=(1.7, 2))


# --- Probe findings on scalar arguments (session 4) -----------------------------------------------------------------
# softcap 1e7 gave logits off by 0.4 (tanh's 1 - 2/(exp(2y) + 1) cancels for small y) and softcap=inf returned NaN;
# softmax_scale="a", softcap=None and num_splits=None raised Python's own errors that do not name the argument;
# num_splits had no upper bound; decode with zero query heads divided by zero in the split heuristic; paged varlen
# accepted a seqused_k of the wrong length, max_seqlen_q=-1 and (on the CPU) page indices outside the pool.

@pytest.mark.parametrize("softcap", [1e4, 1e7, 1e20])
def test_huge_softcaps_match_the_reference(softcap):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 7, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(3))
    out = tileflash.flash_attn_func(q, k, v, softcap=softcap)
    check_2x(out, attention_ref(q, k, v, softcap=softcap)[0], attention_ref(q, k, v, softcap=softcap, upcast=False)[0])


@pytest.mark.parametrize("kw, name", [(dict(softcap=float("inf")), "softcap"), (dict(softcap=None), "softcap"),
                                      (dict(softmax_scale="a"), "softmax_scale"),
                                      (dict(softmax_scale=float("nan")), "softmax_scale")])
def test_bad_scalars_name_the_argument(kw, name):
    q = torch.randn(1, 4, 2, 32, device=DEVICE, dtype=torch.float16)
    with pytest.raises((TypeError, ValueError), match=name):
        tileflash.flash_attn_func(q, q, q, **kw)


@pytest.mark.parametrize("num_splits", [None, 1.5, -1, 257])
def test_bad_num_splits_name_the_argument(num_splits):
    q = torch.randn(1, 1, 2, 32, device=DEVICE, dtype=torch.float16)
    cache = torch.randn(1, 8, 2, 32, device=DEVICE, dtype=torch.float16)
    lens = torch.full((1,), 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises((TypeError, ValueError), match="num_splits"):
        tileflash.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, num_splits=num_splits)


def test_decode_with_zero_query_heads_still_appends():
    q = torch.randn(2, 1, 0, 32, device=DEVICE, dtype=torch.float16)
    k_cache = torch.zeros(2, 8, 2, 32, device=DEVICE, dtype=torch.float16)
    v_cache = k_cache.clone()
    new = torch.randn(2, 1, 2, 32, device=DEVICE, dtype=torch.float16)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    out = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=lens)
    assert out.shape == q.shape
    assert torch.equal(k_cache[0, 3], new[0, 0]) and torch.equal(v_cache[1, 5], new[1, 0])


def _paged_varlen_inputs():
    q = torch.randn(9, 2, 32, device=DEVICE, dtype=torch.float16)
    pool = torch.randn(6, 4, 2, 32, device=DEVICE, dtype=torch.float16)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([10, 12], dtype=torch.int32, device=DEVICE)
    return q, pool, cu_q, table, used


def test_paged_varlen_checks_seqused_k_and_max_seqlen_q():
    q, pool, cu_q, table, used = _paged_varlen_inputs()
    with pytest.raises(ValueError, match="seqused_k"):
        tileflash.flash_attn_varlen_func(q, pool, pool, cu_q, None, 5, 0, seqused_k=used[:1], block_table=table)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        tileflash.flash_attn_varlen_func(q, pool, pool, cu_q, None, -1, 0, seqused_k=used, block_table=table)


@pytest.mark.skipif(DEVICE != "cpu", reason="page indices are checked where it costs no device sync (CPU tensors)")
@pytest.mark.parametrize("bad", [-1, 1000])
def test_paged_varlen_checks_page_indices_on_the_cpu(bad):
    q, pool, cu_q, table, used = _paged_varlen_inputs()
    table[1, 2] = bad
    with pytest.raises(ValueError, match="block_table"):
        tileflash.flash_attn_varlen_func(q, pool, pool, cu_q, None, 5, 0, seqused_k=used, block_table=table)


def test_fp8_quantize_keeps_a_scalar_a_scalar():
    data, scale = tileflash.fp8_quantize(torch.tensor(500.0, device=DEVICE))
    assert data.shape == () and scale.shape == (1,) and tileflash.fp8_dequantize(data, scale).shape == ()
    assert float(tileflash.fp8_dequantize(data, scale)) == 500.0  # amax / 448 scale: 500 -> 448 -> 500


# --- bf16 outputs in the interpreter, and the backward's delta ----------------------------------------------------
# A long fuzz run (TILEFLASH_FUZZ_SEED=12345) found dq 6x over the 2x bound on bf16, Sq=1, Sk=15, d=128 with values
# of scale 3: softmax is near one-hot there, so dS = P (dP - delta) cancels, and delta = rowsum(dO * O) reads the
# forward's bf16 output. The interpreter's fp32 -> bf16 cast truncated that output (one ulp off where the GPU rounds
# to nearest), and the cancellation turned it into dq errors of 1e-1. Stores now round to nearest (kernels/_cast.py).
def test_interpreter_bf16_outputs_round_to_nearest():
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(1, n, 1, 128, generator=g) * 3).to(DEVICE, torch.bfloat16) for n in (1, 15, 15))
    out = tileflash.flash_attn_func(q, k, v)
    ref = attention_ref(*(x.float() for x in (q, k, v)))[0]
    # near one-hot: the exact output sits next to bf16 values of v, so rounding to nearest matches it bit for bit
    assert torch.equal(out, ref.to(torch.bfloat16))


def test_near_one_hot_backward_within_the_2x_rule():
    from helpers import check_grads

    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(1, n, 1, 128, generator=g) * 3).to(DEVICE, torch.bfloat16).requires_grad_()
               for n in (1, 15, 15))
    dout = torch.randn(1, 1, 1, 128, generator=g).to(DEVICE)
    check_grads(lambda q, k, v: tileflash.flash_attn_func(q, k, v, return_lse=True),
                lambda q, k, v, upcast: attention_ref(q, k, v, upcast=upcast), (q, k, v), dout,
                torch.zeros(1, 1, 1, device=DEVICE))
