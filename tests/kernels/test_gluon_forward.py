"""The warp-specialised sm_90 forward (kernels/gluon/attn_fwd.py) against the reference, and which calls take it.

Gluon kernels have no CPU interpreter: on the CPU only the dispatch is checked (the kernel's sm_90 compilation is
in tests/kernels/test_compile_targets.py); the numerical cases run on an sm_90 GPU."""
import pytest
import torch

import tileflash
from helpers import (DEVICE, ON_SM90, attention_inputs, check_2x, check_fp8, check_lse, dequantize,
                     packed_inputs)
from tileflash import config
from tileflash.plan import WsFwdConfig
from tileflash.plan import Mask, sm90_target, ws_forward_config
from tileflash.launch.forward import launch_attn_fwd_ws
from tileflash.ops import prefill
from tileflash.reference import attention_ref, attention_varlen_ref

needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="the warp-specialised forward runs on sm_90 only")

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal) — why each is here:
CASES = [
    (1, 1, 1, 1, 1, 128, True),  # one query, one key: one CTA, one masked block
    (2, 17, 17, 4, 4, 128, True),  # a partial tile: rows past Sq arrive as zeros and are never stored
    (2, 1000, 1100, 16, 4, 128, False),  # GQA 4, Sk not a multiple of 128: the last block is masked
    (2, 1000, 1100, 16, 4, 128, True),  # causal Sq < Sk: the diagonal shifted by Sk - Sq
    (1, 300, 97, 8, 1, 128, True),  # MQA, causal Sq > Sk: the first rows see no key (out 0, lse -inf)
    (3, 1024, 2000, 6, 3, 64, False),  # d64 non-causal
    (1, 2500, 2500, 8, 2, 64, True),  # d64 causal, 20 tiles a head (160 > 132 SMs): persistent, 10 units a head of a
    # heavy and a light tile
    (1, 2500, 2500, 2, 2, 64, True),  # 40 tiles: one CTA each (plan.prefill.one_wave_rule)
    (2, 600, 700, 16, 2, 64, True),  # d64 causal with short rows, 160 tiles: persistent CTAs (they took the Triton
    # tile)
    (1, 4096, 4096, 2, 1, 128, True),  # many full blocks: the ring wraps over all three stages many times
    (2, 700, 900, 4, 2, 256, True),  # d256, <= 1024 keys: two K stages
    (1, 1500, 1300, 2, 1, 256, False),  # d256 with three K and two V stages, Sq > Sk
]


def _takes_ws(q, k, v, causal, scale=1.0, window=(-1, -1), softcap=0.0):
    out = torch.empty_like(q)
    mask = Mask.make(causal, window, softcap)
    return ws_forward_config(q, k, v, out, scale, mask) is not None


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_ws_forward(case, dtype):
    b, sq, sk, hq, hkv, d, causal = case
    _check_ws_call(*attention_inputs(b, sq, sk, hq, hkv, d, dtype), causal)


def _check_ws_call(q, k, v, causal):
    """flash_attn_func through the warp-specialised forward against the reference (2x rule; out in V's head dim)."""
    assert _takes_ws(q, k, v, causal)
    out, lse = tileflash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    ref_lowp, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, block_n, k_stages, v_stages, persistent, q_bufs", [
    (128, 128, 3, 3, False, 1), (128, 128, 2, 2, False, 1), (64, 128, 3, 3, False, 1), (64, 128, 4, 3, False, 1),
    (256, 64, 2, 2, False, 1), (256, 64, 3, 2, False, 1),  # d256: 3 K and 2 V stages fill 224 KB of shared memory
    (128, 128, 3, 3, True, 1), (64, 128, 3, 3, True, 1), (256, 64, 3, 2, True, 1),
    (128, 128, 2, 3, True, 2), (128, 128, 3, 2, True, 2), (64, 128, 3, 3, True, 2),  # Q a tile ahead
])
def test_ws_forward_tile_configs(d, block_n, k_stages, v_stages, persistent, q_bufs, causal):
    """Every tile the sweeps measure (`python -m tileflash sweep prefill-ws`), launched directly into NaN-poisoned
    outputs: the K and V rings of different depths wrap at different blocks (Sk spans 11-21 blocks), Sq < Sk shifts
    the diagonal, and 9 tiles per head make 5 units of which the last is one tile alone: 160 units walked by 132
    persistent CTAs (with two Q buffers, both buffers' barrier phases wrap)."""
    q, k, v = attention_inputs(2, 1100, 1300, 16, 4, d, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 16, 1100), float("nan"), device=DEVICE)
    scale = d ** -0.5
    launch_attn_fwd_ws(q, k, v, out, lse, causal=causal, softmax_scale=scale,
                       config=WsFwdConfig(block_n, k_stages, v_stages, persistent, q_bufs))
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale)
    ref_lowp, _ = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=False)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


# DeepSeek-V3's prefill dims, q and k 192 wide (read as 128 + 64 columns), v 128: (batch, seqlen_q, seqlen_k,
# heads_q, heads_kv, causal) — why each is here:
DEEPSEEK_CASES = [
    (2, 1000, 1100, 16, 16, True),  # <= 2048 keys: persistent CTAs, the diagonal shifted by Sk - Sq
    (1, 700, 3000, 4, 4, False),  # one CTA per tile, Sk not a multiple of 128: the last block is masked
    (2, 17, 17, 4, 1, True),  # MQA, a partial tile: rows past Sq are never stored
    (1, 300, 97, 8, 2, True),  # causal Sq > Sk: the first rows see no key (out 0, lse -inf)
]


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", DEEPSEEK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_ws_forward_q_192_v_128(case, dtype):
    b, sq, sk, hq, hkv, causal = case
    q, k, _ = attention_inputs(b, sq, sk, hq, hkv, 192, dtype)
    _check_ws_call(q, k, attention_inputs(b, 1, sk, 1, hkv, 128, dtype, seed=1)[2], causal)


@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_n, k_stages, v_stages, persistent", [
    (128, 2, 2, False), (128, 2, 2, True), (64, 3, 3, False), (64, 4, 4, True)])
def test_ws_forward_q_192_v_128_tile_configs(block_n, k_stages, v_stages, persistent, causal):
    """The DeepSeek tiles the sweep measures, launched directly into NaN-poisoned outputs (11-21 key blocks: the
    rings wrap; 160 units over 132 persistent CTAs)."""
    q, k, _ = attention_inputs(2, 1100, 1300, 16, 4, 192, torch.bfloat16)
    v = attention_inputs(2, 1, 1300, 1, 4, 128, torch.bfloat16, seed=1)[2]
    out = torch.full((2, 1100, 16, 128), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    lse = torch.full((2, 16, 1100), float("nan"), device=DEVICE)
    scale = 192 ** -0.5
    launch_attn_fwd_ws(q, k, v, out, lse, causal=causal, softmax_scale=scale,
                       config=WsFwdConfig(block_n, k_stages, v_stages, persistent))
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale)
    ref_lowp, _ = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=False)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


@needs_sm90
def test_ws_forward_q_192_v_128_varlen(monkeypatch):
    """Packed sequences (vLLM's MLA prefill calls flash_attn_varlen_func with these dims): an empty one, Sq != Sk."""
    launches = []
    monkeypatch.setattr(prefill, "launch_attn_fwd_ws", lambda *a, **kw: launches.append(1) or launch_attn_fwd_ws(
        *a, **kw))
    q, k, _, cu_q, cu_k = packed_inputs([300, 0, 1025, 77], [400, 12, 1025, 2000], 8, 8, 192, torch.bfloat16)
    v = packed_inputs([1], [400, 12, 1025, 2000], 1, 8, 128, torch.bfloat16, seed=1)[2]
    out, lse = tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1025, 2000, causal=True, return_lse=True)
    assert launches, "this case no longer takes the warp-specialised forward"
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True)
    ref_lowp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True, upcast=False)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


# FP8 attention (e4m3 q, k, V^T with FA3's descales; sequences of >= 576 keys on average, V^T's wide gap), its tile
# forced where the planner keeps the Triton kernel (d128 below 8k keys, d64): (batch, seqlen_q, seqlen_k, heads_q,
# heads_kv, head_dim, causal) — why each is here:
FP8_CASES = [
    (2, 1000, 1100, 16, 4, 128, True),  # GQA 4, the diagonal shifted by Sk - Sq
    (1, 700, 8300, 4, 4, 128, False),  # the planner's own pick (>= 8k keys); the last block reads the gap
    (3, 500, 1000, 8, 2, 64, False),  # d64; batches' V^T columns start 16-aligned (1000 -> 1008) plus the gap
    (1, 300, 600, 8, 1, 128, True),  # MQA; causal Sq < Sk
]
FORCED = WsFwdConfig(128, 4, 4)


def _fp8_call(q, k, v, causal, **kw):
    q8, k8, v8, qd, kd, vd = tileflash.fp8_quantize_qkv(q, k, v)
    out, lse = tileflash.flash_attn_func(q8, k8, v8, causal=causal, return_lse=True, q_descale=qd, k_descale=kd,
                                         v_descale=vd, **kw)
    return out, lse, (dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd))


@needs_sm90
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: "-".join(map(str, c)))
def test_ws_forward_fp8(case, out_dtype, monkeypatch):
    b, sq, sk, hq, hkv, d, causal = case
    launches = []
    monkeypatch.setattr(prefill, "launch_attn_fwd_ws", lambda *a, **kw: launches.append(1) or launch_attn_fwd_ws(
        *a, **kw))
    q, k, v = attention_inputs(b, sq, sk, hq, hkv, d, torch.bfloat16)
    with config.override(fwd_ws=lambda cfg: cfg or FORCED):
        out, lse, deq = _fp8_call(q, k, v, causal, out_dtype=out_dtype)
    assert launches, "this case no longer takes the warp-specialised forward"
    check_fp8(out, lse, lambda up, inter: attention_ref(*deq, causal=causal, upcast=up, intermediate_dtype=inter),
              out_dtype)


@needs_sm90
@pytest.mark.parametrize("tile", [WsFwdConfig(128, 3, 3), WsFwdConfig(128, 2, 2, True), WsFwdConfig(64, 4, 4),
                                  WsFwdConfig(128, 4, 4, True)], ids=str)
def test_ws_forward_fp8_tile_configs(tile):
    """The FP8 tiles a sweep would time, with a sink (folded in with P's 2^8 shift) and 11-21 key blocks."""
    q, k, v = attention_inputs(2, 1100, 1300, 16, 4, 128, torch.bfloat16, seed=5)
    sink = torch.randn(16, device=DEVICE)
    with config.override(fwd_ws=lambda cfg: tile):
        out, lse, deq = _fp8_call(q, k, v, True, learnable_sink=sink)
    check_fp8(out, lse, lambda up, inter: attention_ref(*deq, causal=True, learnable_sink=sink, upcast=up,
                                                        intermediate_dtype=inter))


@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tile", [WsFwdConfig(32, 4, 4), WsFwdConfig(32, 6, 6), WsFwdConfig(64, 4, 4)], ids=str)
def test_ws_forward_fp8_d256(tile, causal):
    """d256 FP8: the block product P V in two 128-column parts, each added into its half of the fp32 accumulator
    (attn_fwd._add_part). GQA 4, Sq != Sk, 29-57 key blocks, a sink, fp16 out."""
    q, k, v = attention_inputs(2, 650, 1800, 8, 2, 256, torch.bfloat16, seed=3)
    sink = torch.randn(8, device=DEVICE)
    with config.override(fwd_ws=lambda cfg: tile):
        out, lse, deq = _fp8_call(q, k, v, causal, learnable_sink=sink, out_dtype=torch.float16)
    check_fp8(out, lse, lambda up, inter: attention_ref(*deq, causal=causal, learnable_sink=sink, upcast=up,
                                                        intermediate_dtype=inter), torch.float16)


@needs_sm90
def test_ws_forward_fp8_varlen_and_what_it_declines(monkeypatch):
    """Packed sequences of >= 576 keys on average through the Gluon forward (an empty one, Sq != Sk; forced);
    shorter ones (V^T's narrow gap) decline even forced; d128 below 8k keys, windows and d64 stay on the Triton
    kernel, d256 takes the Gluon forward."""
    launches = []
    monkeypatch.setattr(prefill, "launch_attn_fwd_ws", lambda *a, **kw: launches.append(1) or launch_attn_fwd_ws(
        *a, **kw))
    q, k, v, cu_q, cu_k = packed_inputs([300, 0, 1025, 77], [700, 600, 1025, 2000], 8, 2, 128, torch.bfloat16)
    q8, k8, v8, qd, kd, vd = tileflash.fp8_quantize_qkv(q, k, v, cu_q, cu_k)
    with config.override(fwd_ws=lambda cfg: cfg or FORCED):
        out, lse = tileflash.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, 1025, 2000, causal=True,
                                                    return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd)
        q, k, v = attention_inputs(8, 300, 300, 4, 4, 128, torch.bfloat16)  # 300 keys a sequence: the narrow gap
        _fp8_call(q, k, v, True)
    assert launches
    deq = dequantize(q8, qd, cu_q), dequantize(k8, kd, cu_k), dequantize(v8, vd, cu_k)
    check_fp8(out, lse, lambda up, inter: attention_varlen_ref(*deq, cu_q, cu_k, causal=True, upcast=up,
                                                               intermediate_dtype=inter))
    assert len(launches) == 1  # the varlen call's, not the narrow gap's
    launches.clear()
    _fp8_call(*attention_inputs(1, 700, 700, 4, 4, 128, torch.bfloat16), False)  # below 8k keys
    _fp8_call(*attention_inputs(1, 700, 9000, 4, 4, 128, torch.bfloat16), False, window_size=(64, 0))
    _fp8_call(*attention_inputs(1, 700, 9000, 2, 2, 64, torch.bfloat16), False)
    assert not launches
    _fp8_call(*attention_inputs(1, 700, 1200, 2, 2, 256, torch.bfloat16), False)
    assert launches


@needs_sm90
def test_ws_forward_strided_views_and_gradients():
    """q, k, v as views of one packed [B, S, 3, H, D] tensor (strided, TMA-aligned), through autograd."""
    qkv = torch.randn(2, 333, 3, 4, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    assert _takes_ws(q, k, v, causal=True)
    out = tileflash.flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    ref_lowp, _ = attention_ref(q, k, v, causal=True, upcast=False)
    check_2x(out, ref, ref_lowp)
    out.sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


# Packed sequences (query lengths, key lengths, heads_q, heads_kv, head_dim, causal) — why each is here:
VARLEN_CASES = [
    ([300, 0, 1025, 77], [400, 12, 1025, 2000], 8, 2, 128, True),  # an empty query sequence, Sq != Sk both ways
    ([129, 1, 640], [129, 1, 640], 4, 4, 64, False),  # a tile with one row past its sequence's end
    ([200, 70, 5], [65, 300, 0], 4, 1, 256, True),  # MQA, d256 (64-key blocks), Sq > Sk, a sequence with no key
]


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: "-".join(map(str, c[2:])))
def test_ws_forward_varlen(case, dtype, monkeypatch):
    """Rows and keys past a sequence's end belong to the next one: none may leak into or overwrite it."""
    lens_q, lens_k, hq, hkv, d, causal = case
    launches = []
    monkeypatch.setattr(prefill, "launch_attn_fwd_ws", lambda *a, **kw: launches.append(1) or launch_attn_fwd_ws(
        *a, **kw))
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hkv, d, dtype, seed=3)
    out, lse = tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                return_lse=True)
    assert launches, "this case no longer takes the warp-specialised forward"
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal=causal)
    ref_lowp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal=causal, upcast=False)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


@needs_sm90
def test_ws_forward_declines_what_it_does_not_do():
    q, k, v = attention_inputs(1, 256, 256, 2, 2, 128, torch.bfloat16)
    assert not _takes_ws(q, k, v, causal=False, window=(64, 0))
    assert not _takes_ws(q, k, v, causal=False, softcap=5.0)
    assert not _takes_ws(q, k, v, causal=False, scale=-1.0)
    q96, k96, v96 = attention_inputs(1, 256, 256, 2, 2, 96, torch.bfloat16)
    assert not _takes_ws(q96, k96, v96, causal=False)
    q192, k192, v192 = attention_inputs(1, 256, 256, 2, 2, 192, torch.bfloat16)
    assert not _takes_ws(q192, k192, v192, causal=False)  # v 192 wide: not a shape it was measured on
    flat = torch.randn(1 * 256 * 2 * 128 + 1, device=DEVICE, dtype=torch.bfloat16)
    misaligned = flat[1:].view(1, 256, 2, 128)  # base not 16-byte aligned: no TMA descriptor
    assert not _takes_ws(misaligned, k, v, causal=False)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU suite's dispatch")
def test_no_ws_forward_without_an_sm90_target():
    """Under the interpreter (the CPU suite) every call takes the Triton kernel."""
    assert not sm90_target()
    q, k, v = attention_inputs(1, 256, 256, 2, 2, 128, torch.bfloat16)
    assert not _takes_ws(q, k, v, causal=True)
