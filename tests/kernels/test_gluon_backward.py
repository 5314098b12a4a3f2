"""The warp-specialised sm_90 dK/dV kernel (kernels/gluon/attn_bwd.py) against autograd through the reference, and
which calls take it.

Gluon kernels have no CPU interpreter: on the CPU only the dispatch is checked (the kernel's sm_90 compilation is
in tests/kernels/test_compile_targets.py); the numerical cases run on an sm_90 GPU."""
import dataclasses

import pytest
import torch

import tileflash
from helpers import DEVICE, ON_SM90, attention_inputs, check_grads, packed_inputs
from tileflash.launch import backward
from tileflash.launch.backward import launch_attn_bwd_ws
from tileflash.plan import ws_backward_config
from tileflash.reference import attention_ref, attention_varlen_ref

needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="the warp-specialised backward runs on sm_90 only")

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal) — why each is here:
CASES = [
    (1, 1, 1, 1, 1, 128, True),  # one query, one key: one CTA, one masked step
    (2, 17, 17, 4, 4, 128, True),  # a partial query block: rows past Sq load as zeros, their dQ is not added
    (2, 1000, 1100, 16, 4, 128, False),  # GQA 4 (dK/dV summed over the group), Sk not a multiple of 128
    (2, 1000, 1100, 16, 4, 128, True),  # causal Sq < Sk: the diagonal shifted by Sk - Sq
    (1, 300, 97, 8, 1, 128, True),  # MQA, causal Sq > Sk: rows that see no key get zero gradients
    (3, 1024, 2000, 6, 3, 64, False),  # d64 non-causal, staggered starts
    (1, 2500, 2500, 2, 2, 64, True),  # d64 causal, many masked and unmasked steps
    (2, 1100, 1500, 4, 1, 64, True),  # d64 (128-row steps): MQA, a partial row block, causal Sq < Sk
    (1, 1300, 1030, 2, 1, 64, True),  # d64 causal Sq > Sk: whole 128-row blocks that see no key
    (1, 4096, 4096, 2, 1, 128, True),  # many steps: the Q/dO ring and the dS buffers wrap many times
    (1, 700, 40, 4, 2, 128, True),  # keys all in one (tail) tile, most query blocks see all of them
]


def _leaves(b, sq, sk, hq, hkv, d, dtype):
    return [t.requires_grad_() for t in attention_inputs(b, sq, sk, hq, hkv, d, dtype)]


def _takes_ws(q, k, v, causal, window=(-1, -1), softcap=0.0, varlen=False, seqused_k=False, eager=True):
    right = 0 if causal else window[1]
    return ws_backward_config(q, k, v, torch.empty_like(q), varlen=varlen, window_left=window[0],
                              window_right=right, softcap=softcap, max_seqlen_k=k.shape[1],
                              max_seqlen_q=q.shape[1], seqused_k=seqused_k, eager=eager) is not None


@needs_sm90
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_ws_backward(case, dtype, deterministic):
    b, sq, sk, hq, hkv, d, causal = case
    q, k, v = _leaves(b, sq, sk, hq, hkv, d, dtype)
    assert _takes_ws(q, k, v, causal)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(b, sq, hq, d, generator=g).to(DEVICE)
    dlse = torch.randn(b, hq, sq, generator=g).to(DEVICE)  # gradient through the returned lse too
    check_grads(lambda q, k, v: tileflash.flash_attn_func(q, k, v, causal=causal, return_lse=True,
                                                          deterministic=deterministic),
                lambda q, k, v, upcast: attention_ref(q, k, v, causal=causal, upcast=upcast), (q, k, v), dout, dlse)


# Packed sequences (query lengths, key lengths, heads_q, heads_kv, head_dim, causal) — why each is here:
VARLEN_CASES = [
    ([300, 0, 1025, 77], [400, 12, 1025, 2000], 8, 2, 128, True),  # an empty query sequence, Sq != Sk both ways
    ([1100, 60, 1300], [1030, 200, 1300], 4, 4, 64, False),  # d64 (past 256 keys), partial blocks everywhere
    ([1500, 9], [1200, 0], 4, 1, 64, True),  # MQA, causal Sq > Sk, a sequence with no key
]


@needs_sm90
@pytest.mark.parametrize("one_fence", [False, True], ids=["two_fences", "one_fence"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: "-".join(map(str, c[2:])))
def test_ws_backward_varlen(case, one_fence, monkeypatch, override):
    """Rows and keys past a sequence's end belong to the next one: no gradient may leak across."""
    lens_q, lens_k, hq, hkv, d, causal = case
    override(bwd_ws=lambda cfg: cfg and dataclasses.replace(cfg, one_fence=one_fence))
    launches = []
    monkeypatch.setattr(backward, "launch_attn_bwd_ws",
                        lambda *a, **kw: launches.append(1) or launch_attn_bwd_ws(*a, **kw))
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hkv, d, torch.bfloat16, seed=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(sum(lens_q), hq, d, generator=g).to(DEVICE)
    dlse = torch.randn(hq, sum(lens_q), generator=g).to(DEVICE)
    check_grads(lambda q, k, v: tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                                 causal=causal, return_lse=True),
                lambda q, k, v, upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal=causal,
                                                             upcast=upcast), (q, k, v), dout, dlse)
    assert launches, "this case no longer takes the warp-specialised backward"


# One launch (the kernel's ONE_LAUNCH, forced here for every case): (batch, Sq, Sk, Hq, Hkv, d, causal) — why:
ONE_LAUNCH_CASES = [
    (1, 1, 1, 1, 1, 128, True),  # one query, one key
    (2, 17, 17, 4, 4, 128, True),  # a partial query block: rows past Sq are neither summed nor cast
    (1, 128, 128, 32, 32, 128, True),  # `bench host`'s shape: one CTA per group casts its own rows
    (1, 512, 512, 8, 8, 128, True),  # four CTAs per group: the last to arrive casts all 512 rows
    (2, 300, 97, 8, 2, 128, True),  # GQA 4, causal Sq > Sk: rows that see no key get dQ = 0
    (2, 1000, 1100, 4, 4, 128, False),  # rows past one chunk of statistics per warpgroup, Sk not a multiple of 128
    (1, 500, 700, 4, 2, 64, False),  # d64
    (1, 128, 128, 8, 8, 64, True),  # d64 short rows: one launch where three would be the Triton kernels'
]


def _lse_detached(fn):
    """fn's (out, lse) with lse out of the graph: a backward without dlse (ONE_LAUNCH does not take dlse)."""
    def run(*args):
        out, lse = fn(*args)
        return out, lse.detach()
    return run


def _assert_zeros_left_zeroed():
    torch.cuda.synchronize()
    for buf in backward.direct.COUNTERS.buffers.values():
        assert not buf.any(), "the one-launch backward left its dQ sums or counters nonzero"


def _counted_kernels(monkeypatch):
    names = []
    real = backward.direct.launch
    monkeypatch.setattr(backward.direct, "launch", lambda kernel, *a, **kw: names.append(kernel.fn.__name__)
                        or real(kernel, *a, **kw))
    return names


@needs_sm90
@pytest.mark.parametrize("case", ONE_LAUNCH_CASES, ids=lambda c: "-".join(map(str, c)))
def test_ws_backward_one_launch(case, monkeypatch, override):
    """The backward as one launch (delta, lse2 and the dQ cast in the dK/dV kernel) against the reference, twice
    (a recording, then a replay), leaving the zeros it borrows (direct.COUNTERS) zeroed."""
    b, sq, sk, hq, hkv, d, causal = case
    override(bwd_ws=lambda cfg: cfg and dataclasses.replace(cfg, one_launch=True))
    names = _counted_kernels(monkeypatch)
    q, k, v = _leaves(b, sq, sk, hq, hkv, d, torch.bfloat16)
    assert _takes_ws(q, k, v, causal)
    dout = torch.randn(b, sq, hq, d, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    no_dlse = torch.zeros(b, hq, sq, device=DEVICE)
    for _ in range(2):
        check_grads(_lse_detached(lambda q, k, v: tileflash.flash_attn_func(q, k, v, causal=causal,
                                                                            return_lse=True)),
                    lambda q, k, v, upcast: attention_ref(q, k, v, causal=causal, upcast=upcast), (q, k, v), dout,
                    no_dlse)
        assert not any(n in ("attn_bwd_preprocess_kernel", "sum_cast_kernel") for n in names), names
        assert names.count("attn_bwd_ws_kernel") == 1, names  # recorded once, replayed after
    _assert_zeros_left_zeroed()


@needs_sm90
def test_ws_backward_one_launch_varlen(monkeypatch, override):
    """Packed sequences: the last CTA of each (sequence, KV head) casts that sequence's rows only."""
    override(bwd_ws=lambda cfg: cfg and dataclasses.replace(cfg, one_launch=True))
    names = _counted_kernels(monkeypatch)
    lens_q, lens_k = [300, 0, 129, 77], [400, 12, 129, 300]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 8, 2, 128, torch.bfloat16, seed=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn(sum(lens_q), 8, 128, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    check_grads(_lse_detached(lambda q, k, v: tileflash.flash_attn_varlen_func(
                    q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True)),
                lambda q, k, v, upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True, upcast=upcast),
                (q, k, v), dout, torch.zeros(8, sum(lens_q), device=DEVICE))
    assert "attn_bwd_ws_kernel" in names and not {"attn_bwd_preprocess_kernel", "sum_cast_kernel"} & set(names)
    _assert_zeros_left_zeroed()


@needs_sm90
@pytest.mark.parametrize("d", [128, 64])
def test_ws_backward_one_launch_not_captured(d, monkeypatch):
    """A CUDA-graph capture of a backward the plan runs as one launch takes the plan of a call that is not eager
    (direct.COUNTERS lends no zeros to a capture): three launches, the Triton kernels' at d64's short rows; the
    graph's gradients match the eager call's."""
    q, k, v = _leaves(1, 200, 200, 4, 4, d, torch.bfloat16)
    dout = torch.randn(1, 200, 4, d, device=DEVICE, dtype=torch.bfloat16)
    assert ws_backward_config(q, k, v, dout, varlen=False, window_left=-1, window_right=0, softcap=0.0).one_launch
    eager = torch.autograd.grad(tileflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    names = _counted_kernels(monkeypatch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), monkeypatch.context() as m:  # warm-up: the capture's plan, compiled and recorded
        m.setattr(backward.direct.COUNTERS, "get", lambda *a: None)
        torch.autograd.grad(tileflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.autograd.grad(tileflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, captured):
        torch.testing.assert_close(c, e, atol=2e-2, rtol=2e-2)
    assert "sum_cast_kernel" in names or "attn_bwd_dq_kernel" in names, names  # the three launches were captured
    assert ("attn_bwd_ws_kernel" in names) == (d == 128), names


@needs_sm90
def test_one_launch_declined_plans_as_not_eager(monkeypatch):
    """An eager call the one launch cannot serve (here deterministic: dQ in its own pass) plans as a call that is
    not eager: at d64's short rows the Triton kernels, not the Gluon kernel's three launches."""
    q, k, v = _leaves(1, 128, 128, 4, 4, 64, torch.bfloat16)
    names = _counted_kernels(monkeypatch)
    out = tileflash.flash_attn_func(q, k, v, causal=True, deterministic=True)
    out.backward(torch.ones_like(out))
    assert "attn_bwd_ws_kernel" not in names and "attn_bwd_dq_kernel" in names, names


@needs_sm90
def test_ws_backward_strided_views():
    """q, k, v as views of one packed [B, S, 3, H, D] tensor (strided, TMA-aligned)."""
    qkv = torch.randn(2, 333, 3, 4, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    assert _takes_ws(q, k, v, causal=True)
    dout = torch.randn(2, 333, 4, 128, device=DEVICE)
    check_grads(lambda q, k, v: tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True),
                lambda q, k, v, upcast: attention_ref(q, k, v, causal=True, upcast=upcast), (q, k, v), dout,
                torch.zeros(2, 4, 333, device=DEVICE))


@needs_sm90
def test_ws_backward_declines_what_it_does_not_do():
    q, k, v = attention_inputs(1, 256, 256, 2, 2, 128, torch.bfloat16)
    assert not _takes_ws(q, k, v, causal=False, window=(64, 0))
    assert not _takes_ws(q, k, v, causal=False, softcap=5.0)
    assert _takes_ws(q, k, v, causal=True, varlen=True)  # varlen takes it (without seqused_k)
    assert not _takes_ws(q, k, v, causal=True, varlen=True, seqused_k=True)
    for d in (96, 256):
        qd, kd, vd = attention_inputs(1, 256, 256, 2, 2, d, torch.bfloat16)
        assert not _takes_ws(qd, kd, vd, causal=False)
    q64, k64, v64 = attention_inputs(1, 512, 512, 2, 2, 64, torch.bfloat16)  # d64, short rows: Triton kernels
    assert not _takes_ws(q64, k64, v64, causal=True, eager=False)  # causal up to 512 keys
    assert _takes_ws(q64, k64, v64, causal=False, eager=False)  # full rows past 256
    assert not _takes_ws(*attention_inputs(1, 256, 256, 2, 2, 64, torch.bfloat16), causal=False, eager=False)
    assert _takes_ws(q64, k64, v64, causal=True)  # ... unless the call is eager: then one launch of this kernel
    assert not _takes_ws(*attention_inputs(1, 300, 300, 4, 2, 64, torch.bfloat16), causal=True)  # 600 rows
    flat = torch.randn(1 * 256 * 2 * 128 + 1, device=DEVICE, dtype=torch.bfloat16)
    misaligned = flat[1:].view(1, 256, 2, 128)  # base not 16-byte aligned: no TMA descriptor
    assert not _takes_ws(misaligned, k, v, causal=False)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU suite's dispatch")
def test_no_ws_backward_without_an_sm90_target():
    """Under the interpreter (the CPU suite) every call takes the Triton kernels."""
    q, k, v = attention_inputs(1, 256, 256, 2, 2, 128, torch.bfloat16)
    assert not _takes_ws(q, k, v, causal=True)
