"""flash_attn_with_kvcache over FP8 (e4m3) and NVFP4 caches against the reference on their dequantized values (a file
of its own so each GPU test file compiles its variants inside one call)."""
import pytest
import torch

import tileflash
import tileflash._utils as tf_utils
from helpers import (DEVICE, check_2x, check_lse, check_quantized_decode, draw_queries_and_new_kv, force_trans,
                     make_cache)
from tileflash.reference import kvcache_ref


# (seqlens, Sq, Snew, Hq, Hkv, D, page_size, capacity, num_splits, per_head_scale) — FP8 (e4m3) caches:
FP8_CASES = [
    ([0, 29, 50], 1, 1, 8, 2, 64, 16, 64, 0, False),  # per-tensor scales, paged, empty cache, append
    ([13, 40], 3, 3, 4, 4, 128, None, 48, 4, True),  # per-KV-head scales, contiguous, append crossing 4 splits
    ([21], 2, 0, 8, 1, 32, 5, 30, 1, True),  # MQA, page 5, no append
    ([37, 5, 48], 1, 0, 8, 2, 64, None, 48, 3, False),  # contiguous, no append: last blocks read inside the sequence
]


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", FP8_CASES, ids=[f"fp8case{i}" for i in range(len(FP8_CASES))])
def test_kvcache_fp8(case, dtype, trans, override):
    force_trans(override, trans)
    from tileflash.reference import fp8_quantize_ref

    seqlens, sq, s_new, hq, hkv, d, page_size, capacity, num_splits, per_head = case
    b = len(seqlens)
    g = torch.Generator().manual_seed(21)
    k_hi, v_hi, table = make_cache(b, capacity, hkv, d, torch.float32, page_size, g)
    n_scales = hkv if per_head else 1
    k_scale = (torch.rand(n_scales, generator=g) * 0.02 + 0.005).to(DEVICE)
    v_scale = (torch.rand(n_scales, generator=g) * 0.02 + 0.005).to(DEVICE)
    k_cache, v_cache = fp8_quantize_ref(k_hi, k_scale), fp8_quantize_ref(v_hi, v_scale)
    ref_k, ref_v = check_quantized_decode(g, seqlens, sq, s_new, hq, hkv, d, dtype, table, k_cache, v_cache,
                                           num_splits, dict(k_scale=k_scale, v_scale=v_scale))
    # Appended tokens are quantized exactly like the reference (x / scale, saturated, round to nearest even).
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


@pytest.mark.parametrize("case", FP8_CASES[:2], ids=["paged16", "contiguous-4-splits"])
def test_fp8_append_in_launch_is_bitwise_the_append_kernel(case, monkeypatch):
    """An FP8 cache's new tokens quantized by the attention programs (plan/decode.append_in_kernel) give the cache,
    out and lse of the kv_append launch bit for bit."""
    from tileflash.launch import direct
    from tileflash.plan import decode as plan_decode
    from tileflash.reference import fp8_quantize_ref

    seqlens, sq, s_new, hq, hkv, d, page_size, capacity, num_splits, per_head = case
    g = torch.Generator().manual_seed(5)
    k_hi, v_hi, table = make_cache(len(seqlens), capacity, hkv, d, torch.float32, page_size, g)
    scales = dict(k_scale=(torch.rand(hkv if per_head else 1, generator=g) * 0.02 + 0.005).to(DEVICE),
                  v_scale=(torch.rand(hkv if per_head else 1, generator=g) * 0.02 + 0.005).to(DEVICE))
    q, k, v = draw_queries_and_new_kv(g, len(seqlens), sq, s_new, hq, hkv, d, torch.bfloat16)
    kw = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE), block_table=table,
              num_splits=num_splits, return_lse=True, **scales)
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(plan_decode, "append_in_kernel", lambda *args: False)
            direct.clear_all()  # eager calls plan anew
        k_cache, v_cache = fp8_quantize_ref(k_hi, scales["k_scale"]), fp8_quantize_ref(v_hi, scales["v_scale"])
        plan = tileflash.decode_plan(q, k_cache, v_cache, kw["cache_seqlens"], k=k, v=v, block_table=table,
                                     num_splits=num_splits, return_lse=True, **scales)
        assert plan.schedule.fused_append == fused
        runs.append((*tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw), k_cache, v_cache))
    direct.clear_all()  # no plan made under the patch outlives it
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    for a, b in zip(*runs):
        assert torch.equal(bits(a), bits(b))


def _fp8_decode_case(q_fill, k_scale_value=0.01, seed=41):
    """A small fp8-cache decode (2 sequences, 2 tokens x 8 query heads over 2 KV heads): q from q_fill(q) of a
    standard normal bf16 q; returns (out, lse, ref, ref_lse, ref_lowp)."""
    from tileflash.reference import fp8_quantize_ref

    g = torch.Generator().manual_seed(seed)
    k_hi, v_hi, _ = make_cache(2, 40, 2, 64, torch.float32, None, g)
    v_scale = torch.full((1,), 0.01, device=DEVICE)
    k_scale = torch.full((1,), k_scale_value, device=DEVICE)
    k_cache, v_cache = fp8_quantize_ref(k_hi, v_scale), fp8_quantize_ref(v_hi, v_scale)
    q = q_fill(torch.randn(2, 2, 8, 64, generator=g)).to(DEVICE, torch.bfloat16)
    kw = dict(cache_seqlens=torch.tensor([40, 17], dtype=torch.int32, device=DEVICE), k_scale=k_scale,
              v_scale=v_scale)
    ref, ref_lse, _, _ = kvcache_ref(q, k_cache, v_cache, None, None, **kw)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, None, None, upcast=False, **kw)
    out, lse = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, return_lse=True, **kw)
    return out, lse, ref, ref_lse, ref_lowp


@pytest.mark.parametrize("q_magnitude", [1e5, 1e-6], ids=["huge", "tiny"])
def test_fp8_cache_with_queries_outside_fp16_range(q_magnitude, monkeypatch):
    """FP8 caches compute in fp16 tiles: q is scaled by a power of two into fp16's range first, so bf16 queries
    far above fp16's max (65504) or near its subnormals still give the reference's answer. On the CPU the tiles
    are widened to fp32 unless INTERPRETER_UPCAST is off, so it is off here (fp16 needs no widening)."""
    monkeypatch.setattr(tf_utils, "INTERPRETER_UPCAST", False)
    out, lse, ref, ref_lse, ref_lowp = _fp8_decode_case(lambda q: q * q_magnitude)
    check_2x(out, ref, ref_lowp)
    # lse grows with q (~1e5 here): compare it relative to its size, fp32 has ~1e-7 of it
    torch.testing.assert_close(lse, ref_lse.to(lse.device), rtol=2e-5, atol=1e-3)


def test_fp8_cache_inf_query_stays_in_its_row(monkeypatch):
    """An inf in one query head must not change the q scaling of the other heads packed in the same tile."""
    monkeypatch.setattr(tf_utils, "INTERPRETER_UPCAST", False)

    def with_inf(q):
        q[0, 0, 0, 5] = float("inf")
        return q

    out, _, ref, _, ref_lowp = _fp8_decode_case(with_inf)
    keep = torch.ones(out.shape[:3], dtype=torch.bool, device=out.device)
    keep[0, 0, 0] = False  # the row holding the inf (NaN there, as in the reference)
    check_2x(out[keep], ref.to(out.device)[keep], ref_lowp.to(out.device)[keep])


@pytest.mark.parametrize("k_scale_value", [0.0, -0.02], ids=["zero", "negative"])
def test_fp8_cache_zero_and_negative_k_scale(k_scale_value):
    """The logit scale of a quantized cache includes k_scale, a device value: any sign must work."""
    out, lse, ref, ref_lse, ref_lowp = _fp8_decode_case(lambda q: q, k_scale_value)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


def test_fp8_append_saturates():
    k_cache = torch.zeros(1, 4, 1, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    big = torch.full((1, 1, 1, 16), 1000.0, device=DEVICE, dtype=torch.float16)
    big[..., 1] = -1000.0
    one = torch.ones(1, device=DEVICE)
    tileflash.flash_attn_with_kvcache(torch.randn(1, 1, 1, 16, device=DEVICE, dtype=torch.float16), k_cache,
                                      v_cache, big, big, cache_seqlens=torch.zeros(1, dtype=torch.int32, device=DEVICE),
                                      k_scale=one, v_scale=one)
    assert k_cache[0, 0, 0, 0].float().item() == 448.0 and k_cache[0, 0, 0, 1].float().item() == -448.0


def test_fp8_append_rounds_every_fp16_value_like_torch():
    """All 65536 fp16 bit patterns through the FP8 append (scale 1) equal torch's saturating RNE cast bit for bit,
    including ties, subnormals, the sign of zero and NaN."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = x.reshape(1, 256, 16, 16).to(DEVICE)
    k_cache = torch.zeros(1, 256, 16, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    one = torch.ones(1, device=DEVICE)
    q = torch.zeros(1, 1, 16, 16, dtype=torch.float16, device=DEVICE)
    tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, x, x, cache_seqlens=torch.zeros(1, dtype=torch.int32,
                                      device=DEVICE), k_scale=one, v_scale=one)
    ref = x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # clamp keeps NaN; e4m3fn has no inf
    nan = torch.isnan(x)
    assert torch.equal(k_cache.view(torch.uint8)[~nan], ref.view(torch.uint8)[~nan])
    assert torch.isnan(k_cache.float()[nan]).all()


# (seqlens, Sq, Snew, Hq, Hkv, D, page_size, capacity, num_splits) — NVFP4 caches (uint8 e2m1 pairs, e4m3 block
# scales, fp32 global scales):
NVFP4_CASES = [
    ([0, 29, 50], 1, 1, 8, 2, 64, 16, 64, 0),  # paged, empty cache, append into the 16-element blocks
    ([13, 40], 3, 3, 4, 4, 32, None, 48, 4),  # contiguous, append crossing 4 splits
    ([21], 2, 0, 8, 1, 32, 5, 30, 1),  # MQA, page 5, smallest head dim (two scales per head vector), no append
]


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", NVFP4_CASES, ids=[f"nvfp4case{i}" for i in range(len(NVFP4_CASES))])
def test_kvcache_nvfp4(case, dtype, trans, override):
    force_trans(override, trans)
    from tileflash.lowp.formats import nvfp4_quantize_ref

    seqlens, sq, s_new, hq, hkv, d, page_size, capacity, num_splits = case
    b = len(seqlens)
    g = torch.Generator().manual_seed(31)
    k_hi, v_hi, table = make_cache(b, capacity, hkv, d, torch.float32, page_size, g)
    (k_cache, k_scale, k_g), (v_cache, v_scale, v_g) = nvfp4_quantize_ref(k_hi), nvfp4_quantize_ref(v_hi)
    scales = dict(k_scale=k_scale, v_scale=v_scale, k_global_scale=k_g.reshape(1), v_global_scale=v_g.reshape(1))
    (ref_k, ref_ks), (ref_v, ref_vs) = check_quantized_decode(g, seqlens, sq, s_new, hq, hkv, d, dtype, table,
                                                               k_cache, v_cache, num_splits, scales)
    # Appended tokens are quantized exactly like nvfp4_quantize (data nibbles and e4m3 block scales).
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(k_scale.view(torch.uint8), ref_ks.view(torch.uint8))
    assert torch.equal(v_scale.view(torch.uint8), ref_vs.view(torch.uint8))


def test_nvfp4_refuses_head_dim_16():
    """Head dim 16 NVFP4 caches decoded wrongly on the H200 (exact in the interpreter): refused, not guessed."""
    cache = torch.zeros(1, 8, 1, 8, dtype=torch.uint8, device=DEVICE)
    scales = torch.zeros(1, 8, 1, 1, device=DEVICE).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="power-of-two head dim >= 32, got 16"):
        tileflash.flash_attn_with_kvcache(torch.randn(1, 1, 2, 16, device=DEVICE, dtype=torch.float16), cache,
                                          cache.clone(), cache_seqlens=torch.ones(1, dtype=torch.int32, device=DEVICE),
                                          k_scale=scales, v_scale=scales.clone(), k_global_scale=one,
                                          v_global_scale=one)
