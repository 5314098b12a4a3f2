"""V's head dim other than q's (FA3's headdim_v; DeepSeek-V3's prefill: q, k 192 and v 128): flash_attn_func and
flash_attn_varlen_func forward and backward against the reference with the 2x rule, out in V's head dim, and the
errors of what does not take it. Also FA3's qv on those functions (MLA's latent queries: scores q k^T + qv v^T,
forward only), against the reference of the concatenated [q, qv] and [k, v]."""
import pytest
import torch

import tileflash
from helpers import DEVICE, ON_GPU, check_grads, check_out_lse
from tileflash.reference import attention_ref, attention_varlen_ref, gather_cache

# (batch, Sq, Sk, Hq, Hkv, D, Dv, causal, window, softcap) — why each is here:
CASES = [
    (1, 37, 45, 4, 2, 48, 32, True, (-1, -1), 0.0),  # Dv < D (pads 64 / 32), GQA, causal over partial tiles
    (2, 19, 29, 2, 1, 24, 40, False, (6, 3), 2.0),  # Dv > D, MQA, two-sided window and softcap
    (1, 21, 21, 2, 2, 192, 128, True, (-1, -1), 0.0),  # DeepSeek-V3's prefill dims
]
if ON_GPU:  # full tiles: the unmasked interiors, TMA loads (powers of two) and the pointer path (192)
    CASES += [(2, 1000, 1000, 16, 16, 192, 128, True, (-1, -1), 0.0),
              (1, 700, 1100, 8, 2, 64, 256, False, (-1, -1), 0.0),
              (1, 513, 513, 4, 4, 128, 64, True, (-1, -1), 0.0)]


def _leaves(*shapes, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(DEVICE, dtype).requires_grad_() for s in shapes]


def _upstream(*shapes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(DEVICE) for s in shapes]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_flash_attn_func(case, deterministic):
    b, sq, sk, hq, hkv, d, dv, causal, window, softcap = case
    q, k, v = _leaves((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv), seed=sq + dv)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = tileflash.flash_attn_func(q.detach(), k.detach(), v.detach(), return_lse=True, **kw)
    assert out.shape == (b, sq, hq, dv)
    check_out_lse((out, lse), lambda upcast: attention_ref(q.detach(), k.detach(), v.detach(), upcast=upcast, **kw))
    dout, dlse = _upstream((b, sq, hq, dv), (b, hq, sq))
    check_grads(lambda q, k, v: tileflash.flash_attn_func(q, k, v, return_lse=True, deterministic=deterministic,
                                                          **kw),
                lambda q, k, v, upcast: attention_ref(q, k, v, upcast=upcast, **kw), (q, k, v), dout, dlse)


def test_v_past_256_is_forward_only():
    """FA3 runs d64 with a 512-wide v forward (its tests skip the backward past 256): so does tileflash, and a
    backward through the output raises."""
    q, k, v = _leaves((2, 19, 4, 64), (2, 33, 2, 64), (2, 33, 2, 512), seed=12)
    out, lse = tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_out_lse((out.detach(), lse.detach()),
                  lambda upcast: attention_ref(q.detach(), k.detach(), v.detach(), causal=True, upcast=upcast))
    with pytest.raises(RuntimeError, match="head dim past 256 is forward only"):
        out.float().sum().backward()


def test_sink_and_alibi():
    """The forward's sink and ALiBi slopes with Dv != D, through the backward (the sink gets its gradient)."""
    b, sq, sk, hq, hkv, d, dv = 1, 17, 23, 4, 2, 32, 64
    q, k, v = _leaves((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv), seed=5)
    sink = torch.randn(hq, generator=torch.Generator().manual_seed(6)).to(DEVICE).requires_grad_()
    slopes = torch.rand(hq, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    out, lse = tileflash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, alibi_slopes=slopes,
                                         return_lse=True)
    ref = lambda upcast: attention_ref(q, k, v, causal=True, learnable_sink=sink, alibi_slopes=slopes,  # noqa: E731
                                       upcast=upcast)
    check_out_lse((out.detach(), lse.detach()), lambda upcast: [t.detach() for t in ref(upcast)])
    dout, = _upstream((b, sq, hq, dv))
    got = torch.autograd.grad((out.float() * dout).sum(), sink)[0]
    want = torch.autograd.grad((ref(True)[0] * dout).sum(), sink)[0]
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
def test_varlen(deterministic):
    lens_q, lens_k, hq, hkv, d, dv = [7, 0, 21, 5], [9, 4, 21, 0], 4, 2, 48, 32
    q, k, v = _leaves((sum(lens_q), hq, d), (sum(lens_k), hkv, d), (sum(lens_k), hkv, dv), seed=3)
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(DEVICE, torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    dout, dlse = _upstream((sum(lens_q), hq, dv), (hq, sum(lens_q)))
    check_grads(lambda q, k, v: tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 21, 21, causal=True,
                                                                  return_lse=True, deterministic=deterministic),
                lambda q, k, v, upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=upcast),
                (q, k, v), dout, dlse)


def test_varlen_over_paged_keys():
    """Page pools whose V pages hold Dv values per head (forward only, as every paged call)."""
    lens_q, lens_k, hq, hkv, d, dv, page = [5, 12], [20, 12], 4, 1, 64, 32, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(DEVICE, torch.bfloat16)
    k_pool = torch.randn(9, page, hkv, d, generator=g).to(DEVICE, torch.bfloat16)
    v_pool = torch.randn(9, page, hkv, dv, generator=g).to(DEVICE, torch.bfloat16)
    table = torch.randperm(9, generator=g)[:8].view(2, 4).to(DEVICE, torch.int32)
    cu_q = torch.tensor([0, 5, 17], dtype=torch.int32, device=DEVICE)
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    got = tileflash.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 12, 0, seqused_k=used, causal=True,
                                           block_table=table, return_lse=True)
    kk, vv = (torch.cat([gather_cache(c, table, n, i) for i, n in enumerate(lens_k)]) for c in (k_pool, v_pool))
    cu_k = torch.tensor([0, 20, 32], dtype=torch.int32, device=DEVICE)
    check_out_lse(got, lambda upcast: attention_varlen_ref(q, kk, vv, cu_q, cu_k, causal=True, upcast=upcast))


def test_errors():
    q, k, v = (t.detach() for t in _leaves((1, 8, 2, 32), (1, 8, 1, 32), (1, 9, 1, 64)))
    with pytest.raises(ValueError, match="k, v: expected equal shapes but for the head dim"):
        tileflash.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=r"v: head dim expected 1..512 \(past 256: forward only\), got 640"):
        tileflash.flash_attn_func(q, k, torch.zeros(1, 8, 1, 640, dtype=q.dtype, device=DEVICE))
    q8, k8, v8 = (torch.zeros(1, 8, 1, dim, device=DEVICE).to(torch.float8_e4m3fn) for dim in (32, 32, 64))
    with pytest.raises(ValueError, match="FP8 attention takes V's head dim equal to q's"):
        tileflash.flash_attn_func(q8, k8, v8)


def _mla_inputs(b, sq, sk, hq, d, dv, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, torch.bfloat16)  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, 1, d), mk(b, sk, 1, dv), mk(b, sq, hq, dv)


def _mla_ref(q, k, v, qv, **kw):
    """Scores q k^T + qv v^T = [q, qv] [k, v]^T; the default scale 1 / sqrt(D + Dv) is the concatenation's."""
    return lambda upcast: attention_ref(torch.cat([q, qv], -1), torch.cat([k, v], -1), v, upcast=upcast, **kw)


@pytest.mark.parametrize("dv, causal", [(256, True), (512, False)])
def test_qv(dv, causal):
    q, k, v, qv = _mla_inputs(2, 19, 33, 4, 64, dv, seed=dv)
    got = tileflash.flash_attn_func(q, k, v, causal=causal, qv=qv, return_lse=True)
    assert got[0].shape == (2, 19, 4, dv)
    check_out_lse(got, _mla_ref(q, k, v, qv, causal=causal))
    # FA3's interface module, softcap and a window as for any call
    kw = dict(causal=causal, window_size=(9, 0) if causal else (-1, -1), softcap=4.0)
    from tileflash.integrations import fa3
    out, lse = fa3.flash_attn_func(q, k, v, qv=qv, return_attn_probs=True, **kw)
    check_out_lse((out, lse), _mla_ref(q, k, v, qv, **kw))


def test_qv_varlen_and_paged():
    lens_q, lens_k, hq, d, dv = [7, 0, 12], [20, 4, 12], 4, 64, 256
    q, k, v, qv = (t[0] for t in _mla_inputs(1, sum(lens_q), sum(lens_k), hq, d, dv, seed=8))
    k, v = k[:sum(lens_k)], v[:sum(lens_k)]
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(DEVICE, torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    ref = lambda kk, vv: lambda upcast: attention_varlen_ref(  # noqa: E731
        torch.cat([q, qv], -1), torch.cat([kk, vv], -1), vv, cu_q, cu_k, causal=True, upcast=upcast)
    got = tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 20, causal=True, qv=qv, return_lse=True)
    check_out_lse(got, ref(k, v))
    # the same keys in pages of 4 tokens, in random order
    page, g = 4, torch.Generator().manual_seed(9)
    table = torch.randperm(15, generator=g).view(3, 5).to(DEVICE, torch.int32)
    pools = [torch.zeros(15, page, 1, dim, dtype=torch.bfloat16, device=DEVICE) for dim in (d, dv)]
    for b, (start, n) in enumerate(zip(cu_k.tolist(), lens_k)):
        for t in range(n):
            for pool, src in zip(pools, (k, v)):
                pool[table[b, t // page], t % page] = src[start + t]
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    got = tileflash.flash_attn_varlen_func(q, *pools, cu_q, None, 12, 0, seqused_k=used, block_table=table,
                                           causal=True, qv=qv, return_lse=True)
    check_out_lse(got, ref(k, v))


def test_qv_is_forward_only():
    """FA3's backward gives qv no gradient (nor the scores' qv v^T part to q, k, v): here the forward takes inputs
    that require grad and a backward through it raises."""
    q, k, v, qv = _mla_inputs(1, 9, 9, 2, 64, 256, seed=10)
    want = tileflash.flash_attn_func(q, k, v, qv=qv)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, qv)]
    out = tileflash.flash_attn_func(*leaves[:3], qv=leaves[3])
    assert torch.equal(out, want) and out.requires_grad
    with pytest.raises(RuntimeError, match="qv .* forward only"):
        out.float().sum().backward()


def test_qv_errors():
    q, k, v, qv = _mla_inputs(1, 8, 8, 2, 64, 256, seed=11)
    with pytest.raises(ValueError, match=r"qv: expected shape \(1, 8, 2, 256\)"):
        tileflash.flash_attn_func(q, k, v, qv=qv[..., :128])
    with pytest.raises(ValueError, match="must be 1..512, got 640"):
        tileflash.flash_attn_func(q, k, torch.zeros(1, 8, 1, 640, dtype=q.dtype, device=DEVICE),
                                  qv=torch.zeros(1, 8, 2, 640, dtype=q.dtype, device=DEVICE))
    with pytest.raises(ValueError, match="dropout_p: attention dropout does not combine with qv"):
        tileflash.flash_attn_func(q, k, v, qv=qv, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="attention_chunk with qv"):
        tileflash.flash_attn_func(q, k, v, qv=qv, attention_chunk=4)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    with pytest.raises(ValueError, match="FP8 attention takes no qv"):
        tileflash.flash_attn_func(q8, k8, v8, qv=qv)
