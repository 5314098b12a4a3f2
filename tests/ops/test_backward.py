"""Gradients of flash_attn_func / flash_attn_varlen_func against autograd through the pure-PyTorch reference:
fp32 upcast and low precision, 2x rule, for dq, dk, dv (and through lse)."""
import pytest
import torch

import tileflash
from helpers import DEVICE, ON_GPU, check_grads
from tileflash.reference import attention_ref, attention_varlen_ref

# (batch, Sq, Sk, Hq, Hkv, D, causal, window, softcap) — why each is here:
CASES = [
    (2, 19, 27, 4, 2, 32, False, (-1, -1), 0.0),  # GQA 2, Sq < Sk, partial tiles on both sides
    (1, 33, 17, 4, 1, 64, True, (-1, -1), 0.0),  # MQA, Sq > Sk causal: rows with no key get zero gradients
    (1, 40, 40, 2, 2, 40, True, (8, 0), 0.0),  # sliding window; head dim 40 padded to 64
    (2, 23, 23, 8, 2, 80, False, (5, 7), 3.0),  # two-sided window with softcap, GQA 4
    (1, 17, 29, 2, 2, 128, True, (-1, -1), 0.0),  # d128
    (1, 9, 13, 2, 1, 256, False, (-1, -1), 0.0),  # d256, MQA
    (1, 70, 86, 2, 1, 32, False, (33, 18), 0.0),  # windows wider than a tile: masked edges around unmasked blocks
]
if ON_GPU:
    CASES += [(2, 1024, 1024, 8, 2, 64, True, (-1, -1), 0.0), (1, 777, 1500, 4, 4, 128, False, (-1, -1), 0.0),
              (1, 600, 600, 2, 1, 256, True, (100, 0), 10.0)]


def _leaves(*shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(DEVICE, dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_flash_attn_func_backward(case, dtype, deterministic):
    """Both backward designs: dQ added up with atomics by the dK/dV program (default), and its own pass."""
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q, k, v = _leaves((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), dtype=dtype, seed=sq + sk)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(b, sq, hq, d, generator=g).to(DEVICE)
    dlse = torch.randn(b, hq, sq, generator=g).to(DEVICE)  # gradient through the returned lse too
    check_grads(lambda q, k, v: tileflash.flash_attn_func(q, k, v, return_lse=True, deterministic=deterministic,
                                                          **kw),
                 lambda q, k, v, upcast: attention_ref(q, k, v, upcast=upcast, **kw), (q, k, v), dout, dlse)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_backward_with_empty_sequences_and_seqused(dtype, deterministic):
    lens_q, lens_k, seqused = [7, 0, 21, 5], [9, 4, 21, 0], [6, 4, 21, 0]
    hq, hkv, d = 4, 2, 64
    q, k, v = _leaves((sum(lens_q), hq, d), (sum(lens_k), hkv, d), (sum(lens_k), hkv, d), dtype=dtype, seed=3)
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(DEVICE, torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    used = torch.tensor(seqused, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(sum(lens_q), hq, d, generator=g).to(DEVICE)
    dlse = torch.randn(hq, sum(lens_q), generator=g).to(DEVICE)
    kw = dict(causal=True)
    check_grads(lambda q, k, v: tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 21, 21, seqused_k=used,
                                                                  return_lse=True, deterministic=deterministic,
                                                                  **kw),
                 lambda q, k, v, upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, used, upcast=upcast, **kw),
                 (q, k, v), dout, dlse)


def test_keys_past_seqused_and_unseen_rows_get_zero_gradients():
    q, k, v = _leaves((10, 2, 32), (12, 2, 32), (12, 2, 32), dtype=torch.float16, seed=4)
    cu_q = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 12], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    out = tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 10, 12, seqused_k=used, causal=True)
    dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert torch.all(dk[5:] == 0) and torch.all(dv[5:] == 0)
    assert torch.all(dq[:5] == 0)  # bottom-right causal with 5 keys: query i < 5 sees key j <= i - 5: none
    assert not torch.isnan(dq).any()


def test_deterministic_gradients_are_bitwise_repeatable():
    q, k, v = _leaves((2, 37, 4, 64), (2, 45, 2, 64), (2, 45, 2, 64), dtype=torch.bfloat16, seed=5)
    dout = torch.randn(2, 37, 4, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    runs = [torch.autograd.grad(tileflash.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v),
                                dout) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_no_grad_call_records_nothing():
    q, k, v = _leaves((1, 5, 2, 16), (1, 5, 2, 16), (1, 5, 2, 16), dtype=torch.float16, seed=6)
    with torch.no_grad():
        out = tileflash.flash_attn_func(q, k, v)
    assert out.grad_fn is None and not out.requires_grad


def test_atomic_and_deterministic_backward_agree():
    """The two dQ designs sum the same products in different orders (and may use different tiles): equal up to
    rounding."""
    q, k, v = _leaves((2, 53, 4, 64), (2, 61, 2, 64), (2, 61, 2, 64), dtype=torch.float16, seed=6)
    dout = torch.randn(2, 53, 4, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.float16)
    fast, det = (torch.autograd.grad(tileflash.flash_attn_func(q, k, v, causal=True, deterministic=flag), (q, k, v),
                                     dout) for flag in (False, True))
    for a, b in zip(fast, det):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_dkdv_interior_load_paths_agree(override, tma):
    """The dK/dV interior reads Q/dO by pointers or through TMA descriptors (BwdConfig.tma; the interpreter's
    config takes descriptors, the GPU's may not): both against the reference, batched (rows b * Sq + token) and
    varlen (rows from cu_seqlens), with GQA and a partial last query block."""
    from tileflash.plan import BwdConfig

    override(bwd=BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, rotate=True, tma=tma))
    q, k, v = _leaves((2, 37, 4, 64), (2, 45, 2, 64), (2, 45, 2, 64), dtype=torch.float16, seed=7)
    dout = torch.randn(2, 37, 4, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    check_grads(lambda q, k, v: tileflash.flash_attn_func(q, k, v, return_lse=True), lambda q, k, v, upcast:
                attention_ref(q, k, v, upcast=upcast), (q, k, v), dout, torch.zeros(2, 4, 37, device=DEVICE))
    lens = [21, 0, 40]
    cu = torch.tensor([0] + lens).cumsum(0).to(DEVICE, torch.int32)
    q, k, v = _leaves((61, 4, 64), (61, 2, 64), (61, 2, 64), dtype=torch.bfloat16, seed=8)
    dout = torch.randn(61, 4, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    check_grads(lambda q, k, v: tileflash.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, return_lse=True),
                lambda q, k, v, upcast: attention_varlen_ref(q, k, v, cu, cu, None, upcast=upcast), (q, k, v),
                dout, torch.zeros(4, 61, device=DEVICE))
