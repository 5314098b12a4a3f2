"""flash_attn_func against the pure-PyTorch reference (fp32 upcast and low precision, 2x rule)."""
import pytest
import torch

import tileflash
import tileflash._utils as tf_utils
from helpers import DEVICE, ON_GPU, attention_inputs, check_2x, check_lse
from tileflash.reference import attention_ref

DTYPES = [torch.float16, torch.bfloat16]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, softcap) — why each is here:
CASES = [
    (1, 1, 1, 1, 1, 64, False, (-1, -1), 0.0),  # smallest problem: one query, one key
    (2, 17, 17, 4, 4, 64, True, (-1, -1), 0.0),  # causal square, partial M and N tiles
    (1, 97, 113, 8, 2, 40, False, (-1, -1), 0.0),  # GQA 4, Sq != Sk, head dim padded 40 -> 64
    (1, 113, 97, 8, 1, 80, True, (-1, -1), 0.0),  # MQA, Sq > Sk causal: the top rows see no key (out 0, lse -inf)
    (2, 33, 65, 4, 4, 128, False, (16, 0), 0.0),  # sliding window (left bound + causal right edge)
    (1, 45, 45, 2, 2, 256, True, (-1, -1), 5.0),  # largest head dim, softcap
    (1, 64, 128, 8, 1, 64, False, (20, 10), 0.0),  # GQA 8, two-sided window: masked blocks on both sides
    (1, 19, 23, 2, 1, 8, False, (-1, -1), 2.0),  # smallest head dim (padded to 16), softcap without causal
]
if ON_GPU:  # larger grid on the GPU: many full tiles, so the unmasked fast path dominates
    CASES += [
        (2, 1024, 1024, 8, 2, 128, True, (-1, -1), 0.0),
        (1, 777, 2049, 4, 4, 64, False, (-1, -1), 0.0),
        (1, 1000, 1000, 4, 1, 256, True, (128, 0), 0.0),
        (3, 513, 513, 2, 2, 96, False, (-1, -1), 30.0),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_flash_attn_func(case, dtype):
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q, k, v = attention_inputs(b, sq, sk, hq, hkv, d, dtype)
    out, lse = tileflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                         return_lse=True)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    ref_lowp, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


def test_fully_masked_rows_are_zero_with_minus_inf_lse():
    # Sq > Sk with causal: query i sees key j iff j <= i + Sk - Sq, so the first Sq - Sk rows see nothing.
    q, k, v = attention_inputs(1, 20, 7, 2, 2, 32, torch.float16, seed=3)
    out, lse = tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :13] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :13]))
    assert torch.isfinite(lse[:, :, 13:]).all()


def test_strided_inputs_from_packed_qkv():
    # q, k, v as views of one [B, S, 3, H, D] tensor: non-contiguous batch/seq/head strides, contiguous head dim.
    qkv = torch.randn(2, 33, 3, 4, 64).to(DEVICE, torch.float16)
    q, k, v = qkv.unbind(2)
    out = tileflash.flash_attn_func(q, k, v, causal=True, softmax_scale=0.2)
    ref, _ = attention_ref(q, k, v, causal=True, softmax_scale=0.2)
    ref_lowp, _ = attention_ref(q, k, v, causal=True, softmax_scale=0.2, upcast=False)
    check_2x(out, ref, ref_lowp)


@pytest.mark.parametrize("scale", [-0.3, 0.3])
def test_any_softmax_scale_sign(scale):
    """A positive scale is applied inside exp2's argument (one FMA); negative scales take the scale-first path
    (exp2(s * scale - max) needs scale > 0 for the max to commute): both match the reference, masks included. (0 is
    refused by flash_attn_func: test_dropin.py, flash-attn 2.x's positional dropout_p.)"""
    q, k, v = attention_inputs(2, 37, 53, 4, 2, 64, torch.float16, seed=9)
    out, lse = tileflash.flash_attn_func(q, k, v, causal=True, window_size=(20, -1), softmax_scale=scale,
                                         return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, window_size=(20, -1), softmax_scale=scale)
    ref_lowp, _ = attention_ref(q, k, v, causal=True, window_size=(20, -1), softmax_scale=scale, upcast=False)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


@pytest.mark.skipif(ON_GPU, reason="interpreter-only: shows the bf16 interpreter hazard is caught")
def test_bf16_check_can_fail(monkeypatch):
    """Without the interpreter's fp32 widening, bf16 tiles are computed on raw bits; the 2x check must catch it."""
    monkeypatch.setattr(tf_utils, "INTERPRETER_UPCAST", False)
    q, k, v = attention_inputs(1, 17, 17, 2, 2, 64, torch.bfloat16, seed=1)
    ref, _ = attention_ref(q, k, v)
    ref_lowp, _ = attention_ref(q, k, v, upcast=False)
    try:
        out = tileflash.flash_attn_func(q, k, v)
    except Exception:
        return  # the interpreter may also refuse raw-bit bf16 dots outright; either way it cannot pass silently
    with pytest.raises(AssertionError):
        check_2x(out, ref, ref_lowp)


@pytest.mark.parametrize("varlen", [False, True])
def test_tma_descriptor_path(override, varlen):
    """K/V through tensor descriptors (the Hopper TMA path): rows past a sequence's end belong to the next one and
    must be masked out, including from P @ V."""
    from tileflash.plan import FwdConfig
    from tileflash.reference import attention_varlen_ref

    cfg = FwdConfig(32, 16, 4, 1, tma=True) if not ON_GPU else FwdConfig(128, 64, 8, 2, tma=True)
    override(fwd=cfg)
    if varlen:
        lens = [23, 0, 41]
        cu = torch.tensor([0, 23, 23, 64], dtype=torch.int32, device=DEVICE)
        q, k, v = (x[0] for x in attention_inputs(1, 64, 64, 4, 2, 64, torch.float16, seed=5))
        out = tileflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        ref, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True)
        ref_lowp, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True, upcast=False)
    else:
        q, k, v = attention_inputs(2, 37, 45, 4, 2, 64, torch.bfloat16, seed=6)
        k[1, :3] = float("nan")  # the next batch's rows must not leak into batch 0's last block: keys (their
        v[1, :3] = float("nan")  # scores are masked, the tile is not) and values (zeroed there)
        out = tileflash.flash_attn_func(q, k, v[:, :], causal=True)
        ref, _ = attention_ref(q, k, v, causal=True)
        ref_lowp, _ = attention_ref(q, k, v, causal=True, upcast=False)
        out, ref, ref_lowp = out[:1], ref[:1], ref_lowp[:1]
    check_2x(out, ref, ref_lowp)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4], CASES[6], CASES[7]],
                         ids=["causal", "gqa-long", "window-left", "window-two-sided", "softcap"])
def test_sp_overlap_loop(case, dtype, override):
    """The S/P-overlapped loop (a tile config switch for prefill) against the reference: every mask phase."""
    import dataclasses

    override(fwd=lambda cfg: dataclasses.replace(cfg, sp_overlap=True))
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q, k, v = attention_inputs(b, sq, sk, hq, hkv, d, dtype, seed=5)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = tileflash.flash_attn_func(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    check_2x(out, ref, attention_ref(q, k, v, upcast=False, **kw)[0])
    check_lse(lse, ref_lse)
