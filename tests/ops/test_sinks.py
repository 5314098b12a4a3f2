"""FA4's learnable_sink (one value-less logit per query head in every row's softmax; the lse includes it) through
the forward paths, split-KV decode (the sink once, in the combine), the backward (d sink from the preprocess
kernel), decode_plan and the input checks, against the pure-PyTorch references (2x rule). Sinks are drawn per case
around the rows' own lse (about 2-4), so they take a visible share of every row."""
import dataclasses

import pytest
import torch

import tileflash
from helpers import (DEVICE, ON_SM90, attention_inputs, check_2x, check_kvcache_call, check_out_lse, decode_inputs,
                     grads, packed_inputs)
from tileflash.plan import decode as plan_decode, prefill as plan_prefill
from tileflash.reference import attention_ref, attention_varlen_ref


def _sink(hq, seed=0):
    """fp32 [hq] logits in [1, 5]."""
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 4.0 * torch.rand(hq, generator=g)).to(DEVICE)


# (batch, Sq, Sk, Hq, Hkv, D, causal, window, softcap, dtype) — interpreter tiles: 32 query rows, 16 keys.
FWD_CASES = [
    (2, 19, 27, 4, 2, 32, False, (-1, -1), 0.0, torch.float16),  # GQA 2, no mask: RAW_SCORES' scaled m_i
    (1, 33, 17, 4, 1, 64, True, (-1, -1), 0.0, torch.float16),  # MQA, causal Sq > Sk: rows with no key
    (2, 40, 52, 2, 2, 40, True, (20, 0), 0.0, torch.bfloat16),  # window: masked edges around unmasked blocks
    (1, 23, 23, 4, 2, 64, False, (5, 7), 3.0, torch.float16),  # softcap applies to the scores, not the sink
]


@pytest.mark.parametrize("case", FWD_CASES, ids=["gqa", "causal_sq_gt_sk", "window_bf16", "softcap"])
def test_flash_attn_func_sink(case):
    b, sq, sk, hq, hkv, d, causal, window, softcap, dtype = case
    q, k, v = attention_inputs(b, sq, sk, hq, hkv, d, dtype, seed=sq + sk)
    kw = dict(causal=causal, window_size=window, softcap=softcap, learnable_sink=_sink(hq, seed=sq))
    check_out_lse(tileflash.flash_attn_func(q, k, v, return_lse=True, **kw),
                   lambda upcast: attention_ref(q, k, v, upcast=upcast, **kw))


def test_rows_without_keys_give_zero_and_the_sink():
    """Causal Sq > Sk: the first Sq - Sk query rows see no key, so out = 0 and lse = sink_h (up to the rounding
    of the kernel's log2-unit round trip)."""
    q, k, v = attention_inputs(1, 21, 5, 2, 2, 32, torch.float16, seed=3)
    sink = _sink(2, seed=3)
    out, lse = tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True, learnable_sink=sink)
    unseen = 21 - 5
    assert torch.equal(out[:, :unseen], torch.zeros_like(out[:, :unseen]))
    torch.testing.assert_close(lse[0, :, :unseen], sink[:, None].expand(2, unseen), rtol=1e-6, atol=0.0)


def test_sink_changes_the_result():
    """The sink reaches out and lse (a kernel that ignored it passes only a weak test)."""
    q, k, v = attention_inputs(1, 17, 29, 2, 2, 32, torch.float16, seed=1)
    plain, plain_lse = tileflash.flash_attn_func(q, k, v, return_lse=True)
    sunk, sunk_lse = tileflash.flash_attn_func(q, k, v, return_lse=True, learnable_sink=_sink(2, seed=1))
    assert (plain.float() - sunk.float()).abs().max() > 0.05
    assert (sunk_lse - plain_lse).min() > 0.01


def _check_grads_with_sink(run, ref_run, inputs, sink, dout, dlse):
    """dq, dk, dv (2x rule) and d sink against torch.autograd on the fp32 reference (within 2x the low-precision
    reference's error, plus 1e-3 relative to the largest |d sink|)."""
    sink_leaf = sink.clone().requires_grad_()
    got = grads(lambda *a: run(*a[:3], learnable_sink=a[3]), (*inputs, sink_leaf), dout, dlse)
    ups = [x.detach().float().requires_grad_() for x in inputs] + [sink.clone().requires_grad_()]
    ref32 = grads(lambda *a: ref_run(*a[:3], upcast=True, learnable_sink=a[3]), ups, dout, dlse)
    lows = [x.detach().clone().requires_grad_() for x in inputs] + [sink.clone().requires_grad_()]
    ref_lowp = grads(lambda *a: ref_run(*a[:3], upcast=False, learnable_sink=a[3]), lows, dout, dlse)
    for name, g, r32, rlow in zip(("dq", "dk", "dv"), got, ref32, ref_lowp):
        check_2x(g, r32, rlow, name)
    dsink, dsink32, dsink_lowp = got[3], ref32[3], ref_lowp[3]
    assert dsink.dtype == torch.float32 and dsink.shape == sink.shape
    err = (dsink - dsink32).abs().max().item()
    bound = 2 * (dsink_lowp - dsink32).abs().max().item() + 1e-3 * (1 + dsink32.abs().max().item())
    assert err <= bound, f"dsink: max error {err:.3e} > {bound:.3e}"
    assert dsink32.abs().max() > 0.1  # the case moves the sink: the check is not vacuous


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("case", [
    (2, 19, 27, 4, 2, 64, True, (-1, -1), 0.0, torch.float16),  # causal GQA 2
    (1, 40, 33, 2, 1, 32, False, (9, 4), 2.0, torch.bfloat16),  # window + softcap, MQA (rows without keys)
], ids=["causal", "window_softcap"])
def test_backward_sink(case, deterministic):
    """dQ/dK/dV recompute P from the lse (which holds the sink); d sink = -sum_rows exp(sink - lse) * delta."""
    b, sq, sk, hq, hkv, d, causal, window, softcap, dtype = case
    g = torch.Generator().manual_seed(sq)
    q, k, v = (torch.randn(*s, generator=g).to(DEVICE, dtype).requires_grad_()
               for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    dout = torch.randn(b, sq, hq, d, generator=g).to(DEVICE)
    dlse = torch.randn(b, hq, sq, generator=g).to(DEVICE)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    _check_grads_with_sink(
        lambda q, k, v, **s: tileflash.flash_attn_func(q, k, v, return_lse=True, deterministic=deterministic,
                                                       **kw, **s),
        lambda q, k, v, **s: attention_ref(q, k, v, **kw, **s), (q, k, v), _sink(hq, seed=sk), dout, dlse)


def test_varlen_sink_forward_and_backward():
    """Each sequence's rows take the sink (an empty sequence, and one whose keys are all masked for its first rows:
    causal with more queries than keys)."""
    lens_q, lens_k = [7, 0, 21, 9], [9, 4, 21, 5]
    hq, hkv, d = 4, 2, 32
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hkv, d, torch.float16, seed=2)
    sink = _sink(hq, seed=2)
    kw = dict(causal=True)
    check_out_lse(tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 21, 21, return_lse=True,
                                                    learnable_sink=sink, **kw),
                   lambda upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=upcast, learnable_sink=sink, **kw))
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(q.shape, generator=g).to(DEVICE)
    dlse = torch.randn(hq, q.shape[0], generator=g).to(DEVICE)
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    _check_grads_with_sink(
        lambda q, k, v, **s: tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 21, 21, return_lse=True, **kw, **s),
        lambda q, k, v, **s: attention_varlen_ref(q, k, v, cu_q, cu_k, **kw, **s), leaves, sink, dout, dlse)


@pytest.mark.parametrize("page, num_splits, trans", [
    (None, 1, False),  # contiguous, one program per sequence and KV head: the sink in the kernel's epilogue
    (None, 3, True),  # split-KV: partials without the sink, the combine adds it once; transposed products
    (8, 3, False),  # paged split-KV
    (8, 1, True),  # paged, no split
])
def test_kvcache_sink(page, num_splits, trans, override):
    """A sink counted once per split would shrink out and raise lse: the split cases catch it."""
    override(decode=lambda cfg: dataclasses.replace(cfg, trans=trans))
    b, ctx, hkv = 2, 48, 2
    q, kc, vc, table, kn, vn = decode_inputs(b, ctx, hkv, page, seed=num_splits)
    lens = torch.tensor([5, 37], dtype=torch.int32, device=DEVICE)
    check_kvcache_call(q, kn, vn, kc, vc, lse_atol=1e-3, cache_seqlens=lens, block_table=table, causal=True,
                       learnable_sink=_sink(4, seed=num_splits), num_splits=num_splits)


def _bad_sinks():
    """(sink, exception, message) for q with 4 heads."""
    return [
        (torch.ones(4, dtype=torch.float16, device=DEVICE), TypeError, "learnable_sink: expected dtype"),
        ([0.5] * 4, TypeError, "learnable_sink: expected a torch.Tensor"),
        (torch.ones(4, device="meta"), ValueError, "learnable_sink: expected device"),
        (torch.ones(3, device=DEVICE), ValueError, r"learnable_sink: expected shape \[4\]"),
        (torch.ones(2, 4, device=DEVICE), ValueError, r"learnable_sink: expected shape \[4\]"),
        (torch.ones(8, device=DEVICE)[::2], ValueError, "learnable_sink: expected a contiguous tensor"),
    ]


def _bad_slopes():
    """(slopes, exception, message) for q of 2 sequences x 4 heads."""
    return [
        (torch.ones(4, dtype=torch.float16, device=DEVICE), TypeError, "alibi_slopes: expected dtype"),
        ([0.5] * 4, TypeError, "alibi_slopes: expected a torch.Tensor"),
        (torch.ones(4, device="meta"), ValueError, "alibi_slopes: expected device"),
        (torch.ones(3, device=DEVICE), ValueError, r"alibi_slopes: expected shape \[4\] or \[2, 4\]"),
        (torch.ones(3, 4, device=DEVICE), ValueError, r"alibi_slopes: expected shape \[4\] or \[2, 4\]"),
        (torch.ones(2, 4, 1, device=DEVICE), ValueError, "alibi_slopes: expected shape"),
        (torch.ones(2, 8, device=DEVICE)[:, ::2], ValueError, "alibi_slopes: last dimension must be contiguous"),
    ]


@pytest.mark.parametrize("entry", ["func", "varlen", "kvcache", "decode_plan", "qkvpacked"])
@pytest.mark.parametrize("name, bad_values", [("learnable_sink", _bad_sinks), ("alibi_slopes", _bad_slopes)])
def test_per_head_tensor_input_errors(name, bad_values, entry):
    """Raised before any launch by every entry point; for varlen the batch is the number of sequences."""
    q, k, v = attention_inputs(2, 5, 5, 4, 4, 32, torch.float16)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    calls = {
        "func": lambda kw: tileflash.flash_attn_func(q, k, v, **kw),
        "varlen": lambda kw: tileflash.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu,
                                                              cu, 5, 5, **kw),
        "kvcache": lambda kw: tileflash.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=lens, **kw),
        "decode_plan": lambda kw: tileflash.decode_plan(q[:, :1], k, v, lens, **kw),
        "qkvpacked": lambda kw: tileflash.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), **kw),
    }
    for value, exc, message in bad_values():
        with pytest.raises(exc, match=message):
            calls[entry]({name: value})


@pytest.mark.parametrize("extra", ["sink", "alibi"])
def test_which_kernels_take_per_head_tensors(extra, monkeypatch):
    """On sm_90 the calls below take the warp-specialised forward/backward and the register-operand NVFP4 decode.
    ALiBi slopes (a bias those kernels lack) send them to the Triton kernels; a sink only the register-operand
    decode refuses (the Gluon forward folds it in, its dK/dV sees it through the lse). Shapes only: nothing
    launches."""
    from tileflash.plan import ws_backward_config

    monkeypatch.setattr(plan_prefill, "sm90_target", lambda: True)
    monkeypatch.setattr(plan_decode, "sm90_target", lambda: True)
    q, k, v = (torch.zeros(1, 1024, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    mask = plan_prefill.Mask.make(True, (-1, -1), 0.0)
    for on in (False, True):
        refused = on and extra == "alibi"
        assert (plan_prefill.ws_forward_config(q, k, v, q, 0.1, mask, alibi=on and extra == "alibi") is None) == refused
        assert (ws_backward_config(q, k, v, q, varlen=False, window_left=-1, window_right=0, softcap=0.0,
                                   alibi=on and extra == "alibi") is None) == refused
    # decode_plan hands the tensor to the register-operand dispatch as an extra (which that dispatch refuses).
    seen_extras = []
    picked = plan_decode.quant_mma_config
    monkeypatch.setattr(plan_decode, "quant_mma_config",
                        lambda *a: seen_extras.append(a[-1]) or picked(*a))
    kc = torch.zeros(1, 64, 2, 32, dtype=torch.float16, device=DEVICE)
    qd = torch.zeros(1, 1, 4, 32, dtype=torch.float16, device=DEVICE)
    lens = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    name = "learnable_sink" if extra == "sink" else "alibi_slopes"
    for t in (None, _sink(4)):
        tileflash.decode_plan(qd, kc, kc, lens, **{name: t})
    assert seen_extras == [False, True]


@pytest.mark.skipif(not ON_SM90, reason="the warp-specialised Gluon kernels run on sm_90 only")
@pytest.mark.parametrize("causal", [False, True])
def test_sink_through_the_gluon_kernels(causal):
    """A shape the warp-specialised forward and dK/dV kernels take: the sink folded into the forward's epilogue,
    d sink from the preprocess, against the fp32 reference."""
    b, s, hq, hkv, d = 2, 1100, 4, 2, 128
    q, k, v = attention_inputs(b, s, s, hq, hkv, d, torch.bfloat16, seed=11)
    mask = plan_prefill.Mask.make(causal, (-1, -1), 0.0)
    assert plan_prefill.ws_forward_config(q, k, v, q, d ** -0.5, mask) is not None
    g = torch.Generator().manual_seed(11)
    dout = torch.randn(b, s, hq, d, generator=g).to(DEVICE)
    dlse = torch.randn(b, hq, s, generator=g).to(DEVICE)
    _check_grads_with_sink(
        lambda q, k, v, **kw: tileflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, **kw),
        lambda q, k, v, **kw: attention_ref(q, k, v, causal=causal, **kw),
        tuple(t.requires_grad_() for t in (q, k, v)), _sink(hq, seed=11) + 4.0, dout, dlse)


def test_compile_with_sink_matches_eager():
    """The custom ops carry the sink (schemas, fake implementations, the registered backward's d sink)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 11, 2, 32, generator=g).to(DEVICE, torch.float16).requires_grad_() for _ in range(3))
    kc, vc = (torch.randn(1, 16, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    lens = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    sink = _sink(2, seed=5).requires_grad_()

    def block(q, k, v, sink):
        out = tileflash.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
        dec = tileflash.flash_attn_with_kvcache(q[:, :1].detach(), kc, vc, cache_seqlens=lens,
                                                learnable_sink=sink.detach())
        return out.float().square().sum(), dec

    eager_loss, eager_dec = block(q, k, v, sink)
    loss, dec = torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v, sink)
    assert torch.equal(loss, eager_loss) and torch.equal(dec, eager_dec)
    eager_grads, grads_ = torch.autograd.grad(eager_loss, (q, k, v, sink)), torch.autograd.grad(loss, (q, k, v, sink))
    for a, b in zip(eager_grads[:3], grads_[:3]):
        assert torch.equal(a, b)
    # d sink adds rows up with fp32 atomics, whose order a GPU does not fix: equal up to rounding.
    torch.testing.assert_close(eager_grads[3], grads_[3], rtol=1e-5, atol=1e-6)


def test_varlen_rows_outside_every_sequence_stay_out_of_the_sink_gradient():
    """Packed rows past cu_seqlens_q[-1] are never written by the forward (NaN here: outputs are poisoned), so the
    sink gradient must not sum them: it equals the gradient without those rows."""
    lens = [6, 11]
    q, k, v, cu_q, cu_k = packed_inputs(lens, lens, 4, 2, 32, torch.float16, seed=7)
    pad = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.float16)
    g = torch.Generator().manual_seed(9)
    dout = torch.randn(q.shape, generator=g).to(DEVICE)

    def d_sink(q_rows):
        sink = _sink(4, seed=7).requires_grad_()
        out = tileflash.flash_attn_varlen_func(q_rows, k, v, cu_q, cu_k, 11, 11, causal=True, learnable_sink=sink)
        (grad,) = torch.autograd.grad((out[:q.shape[0]].float() * dout).sum(), sink)
        return grad

    want, got = d_sink(q), d_sink(torch.cat([q, pad]))
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("extra", ["learnable_sink", "alibi_slopes"])  # the per-head tensors a decode plan binds
def test_decode_plan_run_equals_flash_attn_with_kvcache_with_per_head_tensors(extra):
    q, kc, vc, table, kn, vn = decode_inputs(2, 48, 2, 16, seed=4)
    lens = torch.tensor([20, 3], dtype=torch.int32, device=DEVICE)
    kw = {extra: _sink(4, seed=4) if extra == "learnable_sink" else _sink(4, seed=4) / 10}
    kc2, vc2 = kc.clone(), vc.clone()
    plan = tileflash.decode_plan(q, kc, vc, lens, block_table=table, k=kn, v=vn, causal=True, num_splits=2,
                                 return_lse=True, **kw)
    got = plan.run(q, kc, vc, kn, vn)
    want = tileflash.flash_attn_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=lens, block_table=table, causal=True,
                                             num_splits=2, return_lse=True, **kw)
    for a, w in zip(got, want):
        assert torch.equal(a, w)
