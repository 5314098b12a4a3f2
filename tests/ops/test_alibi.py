"""flash-attn's alibi_slopes (a bias -slope * |i + Sk - Sq - j| on the scaled, softcapped score) through every
forward path, the backward, decode and the input checks, against the pure-PyTorch references (2x rule). Slopes
are drawn per case and include 0 (a head without bias) and steep ones (0.5: distant keys all but vanish)."""
import dataclasses

import pytest
import torch

import tileflash
from helpers import (DEVICE, attention_inputs, check_grads, check_kvcache_call, check_out_lse, decode_inputs,
                     packed_inputs)
from tileflash.reference import attention_ref, attention_varlen_ref


def _slopes(*shape, seed=0):
    """fp32 slopes in [0, 0.5] with a 0 (no bias) first: per head [Hq] or per sequence and head [B, Hq]."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(*shape, generator=g) * 0.5
    s.view(-1)[0] = 0.0
    return s.to(DEVICE)


# (batch, Sq, Sk, Hq, Hkv, D, causal, window, softcap, per-batch slopes, dtype) — why each is here (interpreter
# tiles: 32 query rows, 16 keys):
FWD_CASES = [
    (2, 19, 27, 4, 2, 32, False, (-1, -1), 0.0, False, torch.float16),  # GQA 2, Sq < Sk: an unmasked first block
    (1, 33, 17, 4, 1, 64, True, (-1, -1), 0.0, True, torch.float16),  # MQA, causal Sq > Sk: rows with no key
    (2, 40, 52, 2, 2, 40, True, (20, 0), 0.0, True, torch.bfloat16),  # window: masked edges around unmasked blocks
    (1, 23, 23, 4, 2, 64, False, (5, 7), 3.0, False, torch.float16),  # softcap first, then the bias
]


@pytest.mark.parametrize("case", FWD_CASES, ids=[f"case{i}" for i in range(len(FWD_CASES))])
def test_flash_attn_func_alibi(case):
    b, sq, sk, hq, hkv, d, causal, window, softcap, per_batch, dtype = case
    q, k, v = attention_inputs(b, sq, sk, hq, hkv, d, dtype, seed=sq + sk)
    slopes = _slopes(*((b, hq) if per_batch else (hq,)), seed=sq)
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    check_out_lse(tileflash.flash_attn_func(q, k, v, return_lse=True, **kw),
                   lambda upcast: attention_ref(q, k, v, upcast=upcast, **kw))


def test_alibi_changes_the_result():
    """The bias reaches the output (a kernel that ignored the slopes would pass only if the test were weak)."""
    q, k, v = attention_inputs(1, 17, 29, 2, 2, 32, torch.float16, seed=1)
    slopes = torch.tensor([0.25, 0.5], device=DEVICE)
    plain = tileflash.flash_attn_func(q, k, v)
    biased = tileflash.flash_attn_func(q, k, v, alibi_slopes=slopes)
    assert (plain.float() - biased.float()).abs().max() > 0.1


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("case", [
    (2, 19, 27, 4, 2, 64, True, (-1, -1), 0.0, True, torch.float16),  # causal GQA 2, [B, Hq] slopes
    (1, 40, 33, 2, 1, 32, False, (9, 4), 2.0, False, torch.bfloat16),  # window + softcap, MQA, [Hq] slopes
], ids=["causal", "window_softcap"])
def test_backward_alibi(case, deterministic):
    """dK/dV (with its atomic dQ share) and the separate dQ pass recompute P with the bias."""
    b, sq, sk, hq, hkv, d, causal, window, softcap, per_batch, dtype = case
    g = torch.Generator().manual_seed(sq)
    q, k, v = (torch.randn(*s, generator=g).to(DEVICE, dtype).requires_grad_()
               for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    dout = torch.randn(b, sq, hq, d, generator=g).to(DEVICE)
    dlse = torch.randn(b, hq, sq, generator=g).to(DEVICE)
    slopes = _slopes(*((b, hq) if per_batch else (hq,)), seed=sk)
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    check_grads(lambda q, k, v: tileflash.flash_attn_func(q, k, v, return_lse=True, deterministic=deterministic,
                                                          **kw),
                lambda q, k, v, upcast: attention_ref(q, k, v, upcast=upcast, **kw), (q, k, v), dout, dlse)


def test_varlen_alibi_forward_and_backward():
    """Positions and lengths are each sequence's (an empty one included); slopes [num_seqs, Hq]."""
    lens_q, lens_k = [7, 0, 21, 5], [9, 4, 21, 12]
    hq, hkv, d = 4, 2, 32
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hkv, d, torch.float16, seed=2)
    slopes = _slopes(len(lens_q), hq, seed=2)
    kw = dict(causal=True, alibi_slopes=slopes)
    check_out_lse(tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 21, 21, return_lse=True, **kw),
                   lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=upcast, **kw))
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(q.shape, generator=g).to(DEVICE)
    dlse = torch.randn(hq, q.shape[0], generator=g).to(DEVICE)
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    check_grads(lambda q, k, v: tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 21, 21, return_lse=True, **kw),
                lambda q, k, v, upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=upcast, **kw), leaves, dout,
                dlse)


@pytest.mark.parametrize("page, num_splits, per_batch, sp_overlap, trans", [
    (None, 1, False, False, False),  # contiguous, one program per sequence and KV head
    (None, 3, True, False, True),  # split-KV: each split biases its own keys; transposed scores s^T [N, M]
    (8, 2, True, True, True),  # paged (pages shorter than a step: gathered rows), S/P-overlapped loop
])
def test_kvcache_alibi(page, num_splits, per_batch, sp_overlap, trans, override):
    """Sk is each sequence's length after the append (cache_seqlens + Snew). trans: the decode tiles' transposed
    products (the GPU's choice for quantized caches), forced whatever the heuristic picks."""
    override(decode=lambda cfg: dataclasses.replace(cfg, trans=trans))
    b, ctx, hkv = 2, 48, 2
    q, kc, vc, table, kn, vn = decode_inputs(b, ctx, hkv, page, seed=num_splits)
    lens = torch.tensor([5, 37], dtype=torch.int32, device=DEVICE)
    slopes = _slopes(*((b, 4) if per_batch else (4,)), seed=num_splits)
    check_kvcache_call(q, kn, vn, kc, vc, lse_atol=1e-3, cache_seqlens=lens, block_table=table, causal=True,
                       alibi_slopes=slopes, num_splits=num_splits, sp_overlap=sp_overlap)


def test_compile_with_alibi_matches_eager():
    """The custom ops carry the slopes (schemas, fake implementations, the registered backward)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 11, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_() for _ in range(3))
    kc, vc = (torch.randn(1, 16, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    lens = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    slopes = _slopes(2, seed=5)

    def block(q, k, v):
        out = tileflash.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
        dec = tileflash.flash_attn_with_kvcache(q[:, :1].detach(), kc, vc, cache_seqlens=lens, alibi_slopes=slopes)
        return out.float().square().sum(), dec

    eager_loss, eager_dec = block(q, k, v)
    loss, dec = torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(loss, eager_loss) and torch.equal(dec, eager_dec)
    for a, b in zip(torch.autograd.grad(eager_loss, (q, k, v)), torch.autograd.grad(loss, (q, k, v))):
        assert torch.equal(a, b)
