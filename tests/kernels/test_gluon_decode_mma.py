"""The register-operand decode over NVFP4 caches (kernels/gluon/decode_mma.py): GPU (sm_90) only, since
Gluon has no CPU interpreter (the CPU suite compiles it: tests/sm90_compile_check.py). Each case asserts that the
call took that kernel, then checks out and lse against kvcache_ref with the 2x rule (outputs poisoned)."""
import pytest
import torch

import tileflash
from helpers import DEVICE, ON_SM90, check_quantized_decode, make_cache
from tileflash.lowp.formats import nvfp4_quantize_ref
from tileflash.plan import QuantDecodeConfig
from tileflash.ops import kvcache as decode_ops
from tileflash.reference import fp8_quantize_ref

pytestmark = pytest.mark.skipif(not ON_SM90, reason="the Gluon decode runs on sm_90 GPUs only")

# (format, seqlens, Sq, Snew, Hq, Hkv, D, page_size, capacity, num_splits, window_size, softcap):
CASES = [
    ("nvfp4", [3000, 1, 0], 1, 1, 32, 8, 128, None, 3072, 0, (-1, -1), 0.0),  # the benchmark's heads; 1 and 0
    ("nvfp4", [5000, 77], 1, 1, 32, 8, 128, 16, 5120, 0, (-1, -1), 0.0),  # page 16 (vLLM's), heuristic splits
    ("nvfp4", [300, 17], 2, 2, 8, 2, 64, 1, 320, 3, (-1, -1), 0.0),  # page 1, d64, speculative 2 tokens, 3 splits
    ("nvfp4", [1000, 1], 4, 4, 16, 4, 128, 256, 1280, 0, (-1, -1), 0.0),  # page 256, 16 rows (4 tokens x GQA 4)
    ("nvfp4", [2999], 2, 2, 8, 1, 128, 64, 3072, 0, (200, 0), 10.0),  # MQA 16 rows, window + softcap, page 64
    ("nvfp4", [8000], 1, 0, 32, 8, 128, None, 8192, 0, (-1, -1), 0.0),  # long context, no append
    ("nvfp4", [700, 129, 0], 3, 3, 16, 4, 64, 64, 768, 0, (-1, -1), 0.0),  # d64, 12 rows, append across pages
    ("nvfp4", [517], 1, 1, 8, 8, 64, None, 600, 5, (-1, -1), 0.0),  # MHA (1 row), 5 splits
    ("nvfp4", [3000, 2500], 1, 1, 32, 8, 128, 16, 3072, 0, (500, -1), 30.0),  # left window only, softcap, page 16
    ("nvfp4", [1500], 5, 0, 12, 4, 128, None, 1536, 1, (-1, -1), 0.0),  # 15 rows, causal among 5 tokens, no split
]


# The heuristic's two tiles: 32 or 16 tokens per warp step.
CONFIGS = {"bn32": QuantDecodeConfig(32, 4, 2), "bn16": QuantDecodeConfig(16, 4, 3)}


def _counting_launch(monkeypatch, override, force=CONFIGS["bn32"]):
    """Count the register-operand launches; force: take that kernel with this config at any cache size (the
    heuristic keeps small NVFP4 caches on the Triton kernel, which measured faster there)."""
    if force is not None:
        override(quant_decode=force)
    calls = []
    launch = decode_ops.launch_decode_quant
    monkeypatch.setattr(decode_ops, "launch_decode_quant", lambda *a, **k: calls.append(1) or launch(*a, **k))
    return calls


@pytest.mark.parametrize("config, dtype", [("bn32", torch.bfloat16), ("bn32", torch.float16),
                                           ("bn16", torch.bfloat16)], ids=["bn32-bf16", "bn32-fp16", "bn16-bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-case{i}" for i, c in enumerate(CASES)])
def test_quant_mma_decode(case, config, dtype, monkeypatch, override):
    fmt, seqlens, sq, s_new, hq, hkv, d, page_size, capacity, num_splits, window, softcap = case
    calls = _counting_launch(monkeypatch, override, CONFIGS[config])
    g = torch.Generator().manual_seed(7)
    b = len(seqlens)
    k_hi, v_hi, table = make_cache(b, capacity, hkv, d, torch.float32, page_size, g)
    (k_cache, k_bs, k_g), (v_cache, v_bs, v_g) = nvfp4_quantize_ref(k_hi), nvfp4_quantize_ref(v_hi)
    scales = dict(k_scale=k_bs, v_scale=v_bs, k_global_scale=k_g.reshape(1), v_global_scale=v_g.reshape(1))
    kw = dict(window_size=window, softcap=softcap) if window != (-1, -1) or softcap else {}
    check_quantized_decode(g, seqlens, sq, s_new, hq, hkv, d, dtype, table, k_cache, v_cache, num_splits,
                            scales, **kw)
    assert calls, "the call did not take the register-operand decode"


def test_quant_mma_declines_what_it_does_not_serve(monkeypatch, override):
    """Even when forced: non-power-of-two pages, more than 16 rows, head dim 256, the S/P-overlapped loop and FP8
    caches (it has no FP8 path) take the Triton kernel."""
    calls = _counting_launch(monkeypatch, override)
    g = torch.Generator().manual_seed(3)
    for sq, hq, d, page, sp, fmt in ((1, 8, 64, 5, False, "nvfp4"), (5, 16, 64, None, False, "nvfp4"),
                                     (1, 8, 256, None, False, "nvfp4"), (1, 8, 64, None, True, "nvfp4"),
                                     (1, 8, 64, None, False, "fp8")):
        k_hi, v_hi, table = make_cache(1, 40, 2, d, torch.float32, page, g)
        one = torch.ones(1, device=DEVICE)
        q = torch.randn(1, sq, hq, d, generator=g).to(DEVICE, torch.bfloat16)
        lens = torch.full((1,), 30, dtype=torch.int32, device=DEVICE)
        if fmt == "fp8":
            caches = dict(k_cache=fp8_quantize_ref(k_hi, one), v_cache=fp8_quantize_ref(v_hi, one), k_scale=one,
                          v_scale=one)
        else:
            (kc, ks, kg), (vc, vs, vg) = nvfp4_quantize_ref(k_hi), nvfp4_quantize_ref(v_hi)
            caches = dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, k_global_scale=kg.reshape(1),
                          v_global_scale=vg.reshape(1))
        tileflash.flash_attn_with_kvcache(q, cache_seqlens=lens, block_table=table, sp_overlap=sp, **caches)
    assert not calls


def test_quant_mma_default_dispatch(monkeypatch, override):
    """Without forcing: an NVFP4 cache takes the register-operand kernel, an FP8 one the Triton kernel."""
    calls = _counting_launch(monkeypatch, override, force=None)
    b, ctx, hkv, d = 1, 32768, 8, 128
    q = torch.randn(b, 1, 32, d, device=DEVICE, dtype=torch.bfloat16)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
    kv = torch.randn(b, ctx, hkv, d, device=DEVICE)
    (kc, ks, kg), (vc, vs, vg) = tileflash.nvfp4_quantize(kv), tileflash.nvfp4_quantize(kv)
    tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, k_scale=ks, v_scale=vs,
                                      k_global_scale=kg.reshape(1), v_global_scale=vg.reshape(1))
    assert len(calls) == 1
    k8, s8 = tileflash.fp8_quantize(kv)
    tileflash.flash_attn_with_kvcache(q, k8, k8.clone(), cache_seqlens=lens, k_scale=s8, v_scale=s8)
    assert len(calls) == 1
