"""Attention dropout (flash-attn 2.x's dropout_p) against the pure-PyTorch reference, which regenerates the same
pattern with its own Philox (reference.philox4x32, checked against Random123's known answers): forward, both backward
designs, varlen, the packed entry points, torch.compile, and the errors. A call draws its seed from torch's
generator (_utils.dropout_seed), so `torch.manual_seed(s)` before the call and before drawing it here gives the
reference the call's seed."""
import pytest
import torch
import triton
import triton.language as tl

import tileflash
from helpers import DEVICE, ON_GPU, attention_inputs, check_2x, check_grads, check_lse, packed_inputs
from tileflash import _utils
from tileflash.kernels.triton.dropout import dropout_keep as kernel_keep
from tileflash.reference import attention_ref, attention_varlen_ref, dropout_keep, philox4x32


def _seeded(fn, seed):
    """fn() called with torch's generators seeded by `seed` (so its dropout seed is _drawn(seed))."""
    torch.manual_seed(seed)
    return fn()


def _drawn(seed) -> int:
    torch.manual_seed(seed)
    return int(_utils.dropout_seed(torch.device(DEVICE)))


@pytest.mark.parametrize("counter, key, words", [
    ((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, 0xFFFFFFFFFFFFFFFF, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0x299F31D0A4093822,
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
], ids=["zeros", "ones", "pi"])
def test_reference_philox_known_answers(counter, key, words):
    """Random123's known-answer vectors of Philox4x32-10: the reference's generator is the published one."""
    out = philox4x32(key, *(torch.tensor([c], dtype=torch.int64) for c in counter))
    assert tuple(int(w) for w in out) == words


@triton.jit
def _keep_kernel(rng_ptr, out_ptr, bh, threshold, SK: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, M)
    start_n = tl.program_id(0) * N
    keep = kernel_keep(rng_ptr, rows, bh, start_n, threshold, N)
    tl.store(out_ptr + rows[:, None] * SK + start_n + tl.arange(0, N)[None, :], keep.to(tl.int8))


@pytest.mark.parametrize("p", [0.37, 2.0 ** -16], ids=["p0.37", "threshold1"])
def test_kernel_pattern_is_the_reference_pattern(p):
    """kernels/triton/dropout.dropout_keep bit for bit against reference.dropout_keep: two key blocks, a head row
    past the first, and a probability whose threshold is not a power of two; threshold 1, which a GPU launch passes
    as a constexpr."""
    seed, heads = 0x0123456789ABCDEF, 3
    rng = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
    got = torch.full((16, 64), -1, dtype=torch.int8, device=DEVICE)
    _keep_kernel[(2,)](rng, got, 5 * heads + 2, int(p * 2 ** 16), 64, 16, 32)  # sequence 5, head 2
    want = dropout_keep(seed, p, heads, 16, 64, [5])[0, 2]
    assert torch.equal(got.cpu().bool(), want)


def test_reference_pattern_keeps_one_minus_p():
    keep = dropout_keep(7, 0.2, 4, 64, 256, range(2))
    n = keep.numel()
    assert abs(keep.float().mean().item() - 0.8) < 4 * (0.16 / n) ** 0.5


# (batch, Sq, Sk, Hq, Hkv, D, extras) — why each is here
CASES = [
    (2, 37, 53, 4, 2, 64, dict()),  # GQA, Sq < Sk, partial tiles
    (1, 45, 45, 2, 2, 32, dict(causal=True)),
    (2, 40, 29, 4, 1, 40, dict(causal=True)),  # MQA, Sq > Sk: rows that see no key; head dim padded
    (1, 70, 86, 2, 2, 64, dict(window_size=(33, 18), softcap=5.0)),  # masked edges around unmasked blocks
    (2, 23, 31, 4, 2, 128, dict(alibi_slopes="heads", learnable_sink=True)),
]
BACKWARD_CASES = {"gqa": CASES[0], "mqa_causal": CASES[2], "d128_alibi": CASES[4]}
if ON_GPU:  # unmasked interior blocks (TMA-loaded Q / dO in the dK/dV kernel), many key blocks per row
    BACKWARD_CASES.update(d64_causal_1k=(2, 1024, 1024, 8, 2, 64, dict(causal=True)),
                          d128_777x1500=(1, 777, 1500, 4, 4, 128, dict()))
    CASES += list(BACKWARD_CASES.values())[3:]


def _extras(extras, b, hq):
    extras = dict(extras)
    if extras.get("alibi_slopes") == "heads":
        extras["alibi_slopes"] = torch.rand(b, hq, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    if extras.pop("learnable_sink", False):
        extras["learnable_sink"] = torch.randn(hq, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    return extras


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_forward_matches_the_reference(case, dtype):
    b, sq, sk, hq, hkv, d, extras = case
    q, k, v = attention_inputs(b, sq, sk, hq, hkv, d, dtype, seed=sq + d)
    kw = _extras(extras, b, hq)
    p = 0.17
    out, lse = _seeded(lambda: tileflash.flash_attn_func(q, k, v, dropout_p=p, return_lse=True, **kw), 11)
    ref_kw = dict(kw, dropout_p=p, dropout_seed=_drawn(11))
    ref32, ref_lse = attention_ref(q, k, v, **ref_kw)
    check_2x(out, ref32, attention_ref(q, k, v, upcast=False, **ref_kw)[0])
    check_lse(lse, ref_lse)  # the undropped softmax's
    undropped = tileflash.flash_attn_func(q, k, v, **kw)
    assert not torch.allclose(out.float(), undropped.float(), atol=1e-2)


# (dtype, deterministic): each dtype and each dQ design on the CPU's interpreter, every pair on the GPU
BACKWARD_PATHS = [(torch.float16, False), (torch.bfloat16, True)] + ON_GPU * [(torch.bfloat16, False),
                                                                           (torch.float16, True)]


@pytest.mark.parametrize("dtype, deterministic", BACKWARD_PATHS,
                         ids=[f"{str(t)[6:]}-{'deterministic' if det else 'atomic_dq'}" for t, det in BACKWARD_PATHS])
@pytest.mark.parametrize("case", BACKWARD_CASES.values(), ids=BACKWARD_CASES.keys())
def test_backward_matches_the_reference(case, dtype, deterministic):
    """dq, dk, dv through the regenerated pattern (d128 takes dQ by atomics in the dK/dV kernel, d64 and
    deterministic=True the dQ pass); the gradient through the returned lse too."""
    b, sq, sk, hq, hkv, d, extras = case
    g = torch.Generator().manual_seed(3)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d)
    dout, dlse = torch.randn(b, sq, hq, d, generator=g).to(DEVICE), torch.randn(b, hq, sq, generator=g).to(DEVICE)
    kw = _extras(extras, b, hq)
    kw.pop("learnable_sink", None)  # its gradient: test_sinks; here q, k, v
    p = 0.3
    check_grads(lambda q, k, v: _seeded(lambda: tileflash.flash_attn_func(
                    q, k, v, dropout_p=p, return_lse=True, deterministic=deterministic, **kw), 5),
                lambda q, k, v, upcast: attention_ref(q, k, v, upcast=upcast, dropout_p=p, dropout_seed=_drawn(5),
                                                      **kw), (q, k, v), dout, dlse)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
def test_varlen_forward_and_backward(deterministic):
    """Each sequence's own rows and keys, and its index, pick its pattern; empty sequences included."""
    lens_q, lens_k = [7, 0, 21, 5], [9, 4, 21, 0]
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 64, torch.float16, seed=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    g = torch.Generator().manual_seed(6)
    dout = torch.randn(q.shape, generator=g).to(DEVICE)
    dlse = torch.randn(4, q.shape[0], generator=g).to(DEVICE)
    p = 0.25
    check_grads(lambda q, k, v: _seeded(lambda: tileflash.flash_attn_varlen_func(
                    q, k, v, cu_q, cu_k, 21, 21, causal=True, dropout_p=p, return_lse=True,
                    deterministic=deterministic), 9),
                lambda q, k, v, upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=upcast,
                                                             dropout_p=p, dropout_seed=_drawn(9)),
                (q, k, v), dout, dlse)


def test_forward_with_the_overlapped_loop(override):
    """The S/P-overlapped loop (attn_inner's SP_OVERLAP, which no prefill plan picks today) drops the same
    probabilities: each block's pattern follows its own keys."""
    import dataclasses

    q, k, v = attention_inputs(1, 40, 70, 2, 2, 64, torch.float16, seed=17)
    want = _seeded(lambda: tileflash.flash_attn_func(q, k, v, causal=True, dropout_p=0.3), 6)
    override(fwd=lambda cfg: dataclasses.replace(cfg, sp_overlap=True))
    got = _seeded(lambda: tileflash.flash_attn_func(q, k, v, causal=True, dropout_p=0.3), 6)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


def test_kept_probabilities_are_scaled_to_keep_the_expectation():
    """With every value 1, a row's output is sum_j p_j z_j / (1 - p): 1 on average over rows."""
    q, k, _ = attention_inputs(1, 64, 256, 4, 4, 32, torch.float16, seed=8)
    v = torch.ones_like(k)
    out = tileflash.flash_attn_func(q, k, v, dropout_p=0.5)
    assert abs(out.float().mean().item() - 1.0) < 0.05
    assert out.float().std().item() > 0.05  # rows do differ: something was dropped


def test_calls_draw_new_patterns_and_manual_seed_repeats_them():
    q, k, v = attention_inputs(1, 33, 33, 2, 2, 64, torch.float16, seed=10)
    first = tileflash.flash_attn_func(q, k, v, dropout_p=0.1)
    assert not torch.equal(first, tileflash.flash_attn_func(q, k, v, dropout_p=0.1))
    assert torch.equal(_seeded(lambda: tileflash.flash_attn_func(q, k, v, dropout_p=0.1), 3),
                       _seeded(lambda: tileflash.flash_attn_func(q, k, v, dropout_p=0.1), 3))


def test_packed_entry_points_pass_dropout_p():
    q, k, v = attention_inputs(2, 29, 29, 2, 2, 64, torch.float16, seed=12)
    want = _seeded(lambda: tileflash.flash_attn_func(q, k, v, dropout_p=0.2, causal=True), 4)
    got = _seeded(lambda: tileflash.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), 0.2, causal=True), 4)
    assert torch.equal(want, got)


def _forward_backward_agree(fn, v):
    """out = A v for a matrix A that the dropout pattern fixes, so sum(out * dout) = sum(v * dv) holds only when
    the backward regenerated the forward's pattern."""
    out = fn(v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device, out.dtype)
    (dv,) = torch.autograd.grad(out, (v,), dout)
    lhs, rhs = (out.float() * dout.float()).sum().item(), (v.float() * dv.float()).sum().item()
    assert abs(lhs - rhs) <= 1e-2 * max(abs(lhs), 1.0), (lhs, rhs)


def test_compiled_forward_and_backward_share_a_pattern():
    """torch.compile draws the seed in its graph (its own RNG), so no reference has it: the pattern is checked by
    the forward/backward identity instead, eager and compiled."""
    q, k, v = attention_inputs(1, 40, 40, 2, 2, 64, torch.float16, seed=14)
    v = v.requires_grad_()
    fn = lambda v: tileflash.flash_attn_func(q, k, v, causal=True, dropout_p=0.4)  # noqa: E731
    _forward_backward_agree(fn, v)
    _forward_backward_agree(torch.compile(fn, fullgraph=True), v)


def test_none_or_zero_is_no_dropout_eager_and_compiled():
    """flash-attn callers pass dropout_p=None or 0 (a model's attention_dropout): the plain call, also through the
    custom op (whose dropout_p is a float)."""
    q, k, v = attention_inputs(1, 24, 24, 2, 2, 32, torch.float16, seed=15)
    want = tileflash.flash_attn_func(q, k, v, causal=True)
    for p in (None, 0, 0.0):
        assert torch.equal(tileflash.flash_attn_func(q, k, v, causal=True, dropout_p=p), want)
    compiled = torch.compile(lambda q: tileflash.flash_attn_func(q, k, v, causal=True, dropout_p=None), fullgraph=True)
    assert torch.equal(compiled(q), want)


def test_hugging_face_backend_passes_dropout():
    from tileflash.integrations.transformers import tileflash_attention_forward

    class Module(torch.nn.Module):
        is_causal = True

    q, k, v = attention_inputs(1, 24, 24, 2, 2, 64, torch.float16, seed=16)
    got, _ = _seeded(lambda: tileflash_attention_forward(Module(), *(t.transpose(1, 2) for t in (q, k, v)), None,
                                                         dropout=0.3), 2)
    want = _seeded(lambda: tileflash.flash_attn_func(q, k, v, causal=True, dropout_p=0.3), 2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), "half"])
def test_bad_probabilities_are_refused(bad):
    q, k, v = attention_inputs(1, 8, 8, 2, 2, 32, torch.float16)
    with pytest.raises((ValueError, TypeError), match="dropout_p"):
        tileflash.flash_attn_func(q, k, v, dropout_p=bad)


def test_combinations_without_dropout_are_refused():
    q, k, v = attention_inputs(1, 8, 8, 2, 2, 32, torch.float16)
    with pytest.raises(ValueError, match="dropout_p.*attention_chunk"):
        tileflash.flash_attn_func(q, k, v, dropout_p=0.1, attention_chunk=4)
    with pytest.raises(ValueError, match="dropout_p.*FP8"):
        tileflash.flash_attn_func(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)), dropout_p=0.1)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    flat = [t[0] for t in (q, k, v)]
    with pytest.raises(ValueError, match="dropout_p.*seqused_q"):
        tileflash.flash_attn_varlen_func(*flat, cu, cu, 8, 8, dropout_p=0.1, seqused_q=cu[1:])
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="dropout_p.*block_table"):
        tileflash.flash_attn_varlen_func(flat[0], k.view(1, 8, 2, 32), v.view(1, 8, 2, 32), cu, None, 8, 0,
                                         seqused_k=cu[1:], block_table=table, dropout_p=0.1)
