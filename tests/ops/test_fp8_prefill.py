"""FP8 attention (e4m3 q, k, v with FA3's descales) against the fp32 reference of the dequantized inputs, with
flash-attn's rule for FP8: the low-precision reference rounds the probabilities to e4m3 too (and its output to the
output dtype). Also fp8_quantize_qkv (bit-exact against a per-sequence loop), the errors, and on the GPU the
long-context needle."""
import pytest
import torch
import triton
import triton.language as tl

import tileflash
from tileflash.kernels.triton.cast import round_e4m3
from helpers import DEVICE, E4M3, ON_GPU, attention_inputs, check_fp8, dequantize, packed_inputs
from tileflash.reference import attention_ref, attention_varlen_ref, gather_cache

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, softcap) — why each is here:
CASES = [
    (2, 17, 17, 4, 4, 64, True, (-1, -1), 0.0),  # causal square, partial M and N tiles
    (1, 97, 113, 8, 2, 40, False, (-1, -1), 0.0),  # GQA 4 (q's descale per KV-head group), head dim 40 -> 64
    (1, 50, 33, 4, 1, 128, True, (-1, -1), 0.0),  # MQA, Sq > Sk causal: top rows see no key (out 0, lse -inf)
    (2, 33, 64, 4, 2, 128, False, (16, 0), 5.0),  # window, softcap (scaled scores); Sk % 16 == 0: V^T by TMA
    (1, 45, 48, 2, 2, 256, True, (-1, -1), 0.0),  # largest head dim, V^T by TMA
    (1, 19, 23, 2, 1, 16, False, (-1, -1), 0.0),  # head dim 16: 8-bit dots pad it to 32
]
if ON_GPU:  # many full tiles: the unmasked fast path
    CASES += [
        (2, 1024, 1024, 8, 2, 128, True, (-1, -1), 0.0),
        (1, 777, 2049, 4, 4, 64, False, (-1, -1), 0.0),
        (1, 1000, 1000, 4, 1, 256, False, (-1, -1), 0.0),
        (3, 500, 1000, 8, 2, 128, False, (-1, -1), 0.0),  # batches of 1000 keys: V^T columns padded to 1008
        (2, 999, 999, 4, 4, 64, True, (-1, -1), 0.0),
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_fp8_flash_attn_func(case):
    b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q, k, v = attention_inputs(b, sq, sk, hq, hkv, d, torch.bfloat16)
    q8, k8, v8, qd, kd, vd = tileflash.fp8_quantize_qkv(q, k, v)
    out, lse = tileflash.flash_attn_func(q8, k8, v8, causal=causal, window_size=window, softcap=softcap,
                                         return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd)
    deq = dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd)
    check_fp8(out, lse, lambda up, inter: attention_ref(*deq, causal=causal, window_size=window, softcap=softcap,
                                                        upcast=up, intermediate_dtype=inter))


def test_fp8_alibi_sink_fp16_out_and_strided_descales():
    """ALiBi and a sink through the FP8 path, fp16 output, descales as transposed views, and an absent q_descale
    (1)."""
    b, s, hq, hkv, d = 2, 40, 4, 2, 64
    q, k, v = attention_inputs(b, s, s, hq, hkv, d, torch.bfloat16, seed=4)
    q8 = (q * 8).clamp(-448, 448).to(E4M3)
    _, k8, v8, _, kd, vd = tileflash.fp8_quantize_qkv(q, k, v)
    kd_t, vd_t = (t.t().contiguous().t() for t in (kd, vd))  # [B, Hkv] with strides (1, B)
    slopes = torch.rand(hq, device=DEVICE)
    sink = torch.randn(hq, device=DEVICE)
    out, lse = tileflash.flash_attn_func(q8, k8, v8, causal=True, return_lse=True, alibi_slopes=slopes,
                                         learnable_sink=sink, k_descale=kd_t, v_descale=vd_t,
                                         out_dtype=torch.float16)
    deq = q8.float(), dequantize(k8, kd), dequantize(v8, vd)
    check_fp8(out, lse, lambda up, inter: attention_ref(*deq, causal=True, alibi_slopes=slopes, learnable_sink=sink,
                                                        upcast=up, intermediate_dtype=inter), torch.float16)


def _check_fp8_varlen(lens_q, lens_k, hq, hkv, d, seed):
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hkv, d, torch.bfloat16, seed=seed)
    q8, k8, v8, qd, kd, vd = tileflash.fp8_quantize_qkv(q, k, v, cu_q, cu_k)
    out, lse = tileflash.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd)
    deq = dequantize(q8, qd, cu_q), dequantize(k8, kd, cu_k), dequantize(v8, vd, cu_k)
    check_fp8(out, lse, lambda up, inter: attention_varlen_ref(*deq, cu_q, cu_k, causal=True, upcast=up,
                                                               intermediate_dtype=inter))
    return q8, qd, cu_q, cu_k, deq


def test_fp8_wide_values_t_gap_keeps_sequences_apart():
    """Sequences of >= 576 keys take V^T's wide gap (plan/prefill.values_t_gap): each one's last key block reads
    zeros past its end, unmasked (inner.FP8_V_T_ZEROS). NaN values at the start of batch 1 must not reach batch 0."""
    from tileflash.plan.prefill import VALUES_T_WIDE_GAP, values_t_gap

    b, sq, sk, hq, hkv, d = 2, 9, 600, 2, 1, 32
    assert values_t_gap(b * sk, b) == VALUES_T_WIDE_GAP
    q, k, v = attention_inputs(b, sq, sk, hq, hkv, d, torch.bfloat16, seed=4)
    q8, k8, v8, qd, kd, vd = tileflash.fp8_quantize_qkv(q, k, v)
    v8.view(torch.uint8)[1, :3] = 0x7F  # e4m3 NaN
    out, lse = tileflash.flash_attn_func(q8, k8, v8, return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd)
    deq = dequantize(q8[:1], qd[:1]), dequantize(k8[:1], kd[:1]), dequantize(v8[:1], vd[:1])
    check_fp8(out[:1], lse[:1], lambda up, inter: attention_ref(*deq, upcast=up, intermediate_dtype=inter))
    if ON_GPU:  # (the interpreter's e4m3 widening does not carry NaN: on the CPU only the layout is checked)
        assert torch.isnan(out[1]).all()


@pytest.mark.skipif(not ON_GPU, reason="thousands of keys: minutes in the interpreter")
def test_fp8_varlen_long_sequences():
    """Packed sequences starting at unaligned keys, long enough for many full blocks (V^T through TMA); at d256
    (over 1024 keys, causal) on the Gluon forward, its block product P V in two column parts."""
    _check_fp8_varlen([700, 1, 301, 1000], [1000, 517, 2049, 1003], 8, 2, 128, seed=11)
    _check_fp8_varlen([700, 1, 301, 1000], [1000, 517, 2049, 1003], 4, 2, 256, seed=12)


def test_fp8_varlen_and_paged():
    lens_q, lens_k, hq, hkv, d = [5, 0, 17, 33], [5, 3, 40, 33], 4, 2, 64
    q8, qd, cu_q, cu_k, deq = _check_fp8_varlen(lens_q, lens_k, hq, hkv, d, seed=7)

    # The same keys in pages of 5 tokens (a pool quantized per KV head: descales [Hkv] expanded to [B, Hkv]).
    page, max_pages = 5, 9
    g = torch.Generator().manual_seed(2)
    pool = [torch.randn(len(lens_k) * max_pages + 2, page, hkv, d, generator=g).to(DEVICE) for _ in range(2)]
    (k_pool, kd_h), (v_pool, vd_h) = (tileflash.fp8_quantize(p, per_head_dim=2) for p in pool)
    table = torch.randperm(k_pool.shape[0], generator=g)[:len(lens_k) * max_pages].view(len(lens_k), max_pages)
    table = table.to(DEVICE, torch.int32)
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)
    kd_p, vd_p = (t.expand(len(lens_k), hkv) for t in (kd_h, vd_h))  # a batch stride of 0
    out, lse = tileflash.flash_attn_varlen_func(q8, k_pool, v_pool, cu_q, None, max(lens_q), 0, seqused_k=used,
                                                causal=True, block_table=table, return_lse=True, q_descale=qd,
                                                k_descale=kd_p, v_descale=vd_p)
    kk, vv = (torch.cat([gather_cache(c.float() * s[:, None], table, n, i) for i, n in enumerate(lens_k)])
              for c, s in ((k_pool, kd_h), (v_pool, vd_h)))
    check_fp8(out, lse, lambda up, inter: attention_varlen_ref(deq[0], kk, vv, cu_q, cu_k, causal=True, upcast=up,
                                                               intermediate_dtype=inter))


def _quantize_loop(x, hkv, cu=None):
    """fp8_quantize_qkv's rule, one (sequence, KV head) at a time."""
    seqs = [x[i] for i in range(x.shape[0])] if cu is None else [x[a:b] for a, b in zip(cu[:-1], cu[1:])]
    x8, descales = torch.empty_like(x, dtype=E4M3), []
    for i, xs in enumerate(seqs):
        groups = xs.float().unflatten(1, (hkv, -1))  # [S, Hkv, group, D]
        amax = torch.where(groups.isfinite(), groups.abs(), 0.0).amax((0, 2, 3)) if xs.shape[0] else \
            torch.zeros(hkv, device=x.device)
        descale = torch.where(amax > 0, amax / torch.tensor(448.0, device=x.device), 1.0)
        q = (groups / descale[None, :, None, None]).clamp(-448, 448).to(E4M3).flatten(1, 2)
        if cu is None:
            x8[i] = q
        else:
            x8[cu[i]:cu[i + 1]] = q
        descales.append(descale)
    if cu is not None and cu[-1] < x.shape[0]:  # tokens of no sequence: descale 1
        x8[cu[-1]:] = x[cu[-1]:].float().clamp(-448, 448).to(E4M3)
    return x8, torch.stack(descales)


def test_fp8_quantize_qkv_bit_exact():
    q, k, v = attention_inputs(2, 9, 7, 6, 2, 32, torch.float16, seed=1)
    k[1] = 0  # an all-zero group: descale 1
    v[0, 3, 1, 5] = float("inf")  # saturates; the amax ignores it
    got = tileflash.fp8_quantize_qkv(q, k, v)
    for x8, descale, x in zip(got[:3], got[3:], (q, k, v)):
        want8, want = _quantize_loop(x, 2)
        assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(descale, want)
    # Packed, with an empty sequence and (keys) tokens past cu_seqlens[-1].
    q, k, v, cu_q, cu_k = packed_inputs([3, 0, 8], [4, 0, 6], 4, 1, 16, torch.bfloat16, seed=2)
    k, v = (torch.cat([t, torch.randn_like(t[:2]) * 1000]) for t in (k, v))
    got = tileflash.fp8_quantize_qkv(q, k, v, cu_q, cu_k)
    for x8, descale, x, cu in zip(got[:3], got[3:], (q, k, v), (cu_q, cu_k, cu_k)):
        want8, want = _quantize_loop(x, 1, cu.tolist())
        assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(descale, want)


@pytest.mark.parametrize("gap", [16, 144], ids=["gap16", "wide"])
@pytest.mark.parametrize("lengths", [[37, 37, 37], [5, 0, 40, 16, 1]], ids=["padded", "packed"])
def test_values_t_layout(lengths, gap):
    """launch_values_t: every sequence's tokens from its 16-byte aligned column (values_t_column), whatever the
    lengths, and zeros up to the next sequence's first column (a V^T buffer full of NaN bytes to start with)."""
    from tileflash.launch.tensors import launch_values_t, values_t_column, values_t_width

    h, d = 3, 40
    padded = len(set(lengths)) == 1
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    total, n = int(cu[-1]), len(lengths)
    v = torch.randn(total, h, d, device=DEVICE).to(E4M3)
    v4 = v.view(n, lengths[0], h, d) if padded else v.unsqueeze(0)
    vt = torch.full((h, d, values_t_width(total, n, gap)), 0x7F, dtype=torch.uint8, device=DEVICE).view(E4M3)  # NaN
    launch_values_t(v4, vt, None if padded else cu.to(DEVICE), gap)
    vt = vt.view(torch.uint8).cpu()
    v = v.cpu()
    for i in range(n):
        start, length = int(cu[i]), lengths[i]
        col = values_t_column(start, i, gap)
        nxt = values_t_column(start + length, i + 1, gap)
        assert torch.equal(vt[:, :, col:col + length], v[start:start + length].view(torch.uint8).permute(1, 2, 0))
        assert not vt[:, :, col + length:nxt].any()
    assert nxt == vt.shape[2]


@triton.jit
def _round_e4m3_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_e4m3(x), mask=offs < n)


def test_round_e4m3_matches_the_cast():
    """The interpreter's P rounding (kernels/triton/cast.round_e4m3) against torch's e4m3 cast: every e4m3 value,
    the midpoints between neighbours (ties to even) and their fp32 neighbours, subnormals, and saturation."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # the non-negative finite values
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                   torch.rand(500) * 450, torch.rand(200) * 2 ** -6, torch.tensor([448.0, 449.0, 470.0])])
    x = x.clamp(max=448.0).to(DEVICE)
    y = torch.empty_like(x)
    _round_e4m3_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(y, x.to(E4M3).float())


def _fp8_inputs(b=1, s=8, hq=2, hkv=1, d=32):
    q, k, v = attention_inputs(b, s, s, hq, hkv, d, torch.bfloat16)
    return tileflash.fp8_quantize_qkv(q, k, v)


@pytest.mark.parametrize("bad, match", [
    (dict(q_descale=torch.ones(1, 1, dtype=torch.float16)), "q_descale: expected dtype"),
    (dict(k_descale=torch.ones(1, 2)), r"k_descale: expected shape \(1, 1\)"),
    (dict(v_descale=torch.ones(1)), "v_descale: expected 2 dimensions"),
    (dict(out_dtype=torch.float32), "out_dtype: FP8 attention writes bfloat16 or float16"),
])
def test_fp8_errors(bad, match):
    q8, k8, v8, qd, kd, vd = _fp8_inputs()
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    kw.update({name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in bad.items()})
    with pytest.raises((ValueError, TypeError), match=match):
        tileflash.flash_attn_func(q8, k8, v8, **kw)


def test_fp8_errors_of_mixed_calls():
    q8, k8, v8, qd, kd, vd = _fp8_inputs()
    q, k, v = attention_inputs(1, 8, 8, 2, 1, 32, torch.bfloat16)
    with pytest.raises(TypeError, match="k: expected dtype"):
        tileflash.flash_attn_func(q8, k, v8)
    with pytest.raises(ValueError, match="q_descale: descales are for float8_e4m3fn"):
        tileflash.flash_attn_func(q, k, v, q_descale=qd)
    with pytest.raises(ValueError, match="out_dtype: torch.bfloat16 inputs give"):
        tileflash.flash_attn_func(q, k, v, out_dtype=torch.float16)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_descale: expected shape \(1, 1\)"):
        tileflash.flash_attn_varlen_func(q8[0], k8[0], v8[0], cu, cu, 8, 8, k_descale=kd.expand(2, 1))


def test_fp8_inputs_that_require_grad_run_forward_only():
    """FA3 takes FP8 q, k, v that require grad (its own tests pass such tensors) and has no FP8 backward: the output
    is the same as without grad, descales applied, and a backward through it raises rather than leave q, k, v
    without their gradient. Packed and paged calls likewise."""
    q8, k8, v8, qd, kd, vd = _fp8_inputs()
    kw = dict(q_descale=qd, k_descale=kd * 2, v_descale=vd * 3, return_lse=True)
    ref = tileflash.flash_attn_func(q8, k8, v8, **kw)
    q8g, k8g, v8g = (t.float().requires_grad_().to(E4M3) for t in (q8, k8, v8))  # e4m3 leaves cannot require grad
    out, lse = tileflash.flash_attn_func(q8g, k8g, v8g, **kw)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]) and out.requires_grad
    with pytest.raises(RuntimeError, match="FP8 attention .* is forward only"):
        out.float().sum().backward()
    cu = torch.tensor([0, q8.shape[1]], dtype=torch.int32, device=DEVICE)
    args = (cu, cu, q8.shape[1], q8.shape[1])
    ref = tileflash.flash_attn_varlen_func(q8[0], k8[0], v8[0], *args, q_descale=qd, v_descale=vd * 3)
    out = tileflash.flash_attn_varlen_func(q8g[0], k8g[0], v8g[0], *args, q_descale=qd, v_descale=vd * 3)
    assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="forward only"):
        out.float().sum().backward()


@pytest.mark.skipif(not ON_GPU, reason="65k keys: minutes in the interpreter")
def test_fp8_needle_in_64k_keys():
    """One key that every query should find among 65,536 random keys: the output must keep that key's value to
    bf16 precision (vLLM's trap: accumulating P V over the whole row in the tensor cores' reduced-precision FP8
    accumulator lost the needle; each block's product is added into fp32 here)."""
    g = torch.Generator().manual_seed(5)
    sk, hq, d, at = 65536, 4, 128, 40961
    u = torch.randn(d, generator=g)
    u /= u.norm()
    noise = torch.randn(1, 16, hq, d, generator=g)
    q = 8 * u + noise - (noise @ u)[..., None] * u  # every query: 8 u plus noise orthogonal to u
    k = torch.randn(1, sk, 1, d, generator=g) * 0.5  # scores ~ N(0, 0.6^2)
    k[0, at, 0] = 28 * u  # the needle's score: 8 * 28 / sqrt(128) ~ 19.8, so the other keys weigh ~2e-4 together
    v = torch.randn(1, sk, 1, d, generator=g)
    q, k, v = (t.to(DEVICE, torch.bfloat16) for t in (q, k, v))
    q8, k8, v8, qd, kd, vd = tileflash.fp8_quantize_qkv(q, k, v)
    out = tileflash.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd).float()
    needle = (v8[0, at, 0].float() * vd[0, 0]).expand_as(out)
    err = (out - needle).abs()
    assert (err <= needle.abs() * 2 ** -8 + 2 ** -12).all(), f"max error {err.max().item():.3e}"


def test_fp8_attention_chunk():
    """FA3's attention_chunk with FP8 inputs: the per-sequence descales follow each sequence into its chunk pieces."""
    q, k, v = attention_inputs(2, 40, 40, 4, 2, 64, torch.bfloat16, seed=5)
    q8, k8, v8, qd, kd, vd = tileflash.fp8_quantize_qkv(q, k, v)
    out, lse = tileflash.flash_attn_func(q8, k8, v8, causal=True, return_lse=True, q_descale=qd, k_descale=kd,
                                         v_descale=vd, attention_chunk=16)
    deq = dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd)
    check_fp8(out, lse, lambda up, inter: attention_ref(*deq, causal=True, attention_chunk=16, upcast=up,
                                                        intermediate_dtype=inter))
