"""Pure-PyTorch references. Never used by the kernels; tests compare kernels against these.

`upcast=True` computes in float32 (the accuracy target); `upcast=False` mimics a low-precision kernel (matmuls in
the input dtype, softmax in float32, probabilities rounded to the input dtype) and measures the rounding noise a
correct fp16/bf16 kernel is allowed: pass iff max|out - ref32| <= 2 * max|ref_lowp - ref32| + atol.
"""
from __future__ import annotations

import math

import torch


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1),
                 device=None, attention_chunk: int = 0) -> torch.Tensor:
    """[Sq, Sk] bool: query i sees key j. Bottom-right aligned: row i sits at key position i + Sk - Sq.
    attention_chunk c > 0 (FA3's): only keys in the query's chunk [floor(p / c) * c, + c) are seen."""
    left, right = window_size
    if causal:
        right = 0
    q_pos = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    k_pos = torch.arange(seqlen_k, device=device)[None, :]
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= k_pos <= q_pos + right
    if left >= 0:
        ok &= k_pos >= q_pos - left
    if attention_chunk > 0:
        ok &= k_pos // attention_chunk == torch.div(q_pos, attention_chunk, rounding_mode="floor")
    return ok


def alibi_bias(alibi_slopes, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """[B or 1, Hq, Sq, Sk] float32: flash-attn's ALiBi bias -slope * |i + Sk - Sq - j| for slopes [Hq] or [B, Hq]."""
    slopes = alibi_slopes.float()
    slopes = slopes.view(1, -1) if slopes.dim() == 1 else slopes
    i = torch.arange(seqlen_q, device=slopes.device, dtype=torch.float32)[:, None]
    j = torch.arange(seqlen_k, device=slopes.device, dtype=torch.float32)[None, :]
    return -slopes[:, :, None, None] * (i + (seqlen_k - seqlen_q) - j).abs()


_M32 = 0xFFFFFFFF


def _mul32(a, b):
    """(high, low) 32-bit halves of a * b for int64 tensors / ints holding 32-bit unsigned values, without
    overflowing int64 (a split into 16-bit halves)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    return (a_hi * b + ((a_lo * b) >> 16)) >> 16, ((((a_hi * b) & 0xFFFF) << 16) + a_lo * b) & _M32


def philox4x32(key: int, c0, c1, c2, c3, rounds: int = 10):
    """Random123's Philox4x32-`rounds` of counters (c0, c1, c2, c3) (int64 tensors of 32-bit values) under the 64-bit
    key, written from the Random123 paper, not from Triton's code: the four output words as int64 tensors."""
    k0, k1 = key & _M32, (key >> 32) & _M32
    for _ in range(rounds):
        hi0, lo0 = _mul32(c0, 0xD2511F53)
        hi1, lo1 = _mul32(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


DROPOUT_ROUNDS = 7  # kernels/triton/dropout.PHILOX_ROUNDS


def dropout_keep(seed: int, dropout_p: float, num_heads: int, seqlen_q: int, seqlen_k: int, sequences,
                 device=None) -> torch.Tensor:
    """[len(sequences), num_heads, Sq, Sk] bool: which probabilities attention dropout keeps for these sequence
    indices (kernels/triton/dropout.py's definition): key j of row i of head h of sequence s is kept iff 16-bit half
    bit0(j) (the low one first) of word 2 * bit3(i) + bit3(j) of Philox4x32-7(seed; j with bits 0 and 3 cleared, i
    with bit 3 cleared, s * num_heads + h, 0) is >= floor(p * 2^16)."""
    seq = torch.as_tensor(list(sequences), dtype=torch.int64, device=device)[:, None, None, None]
    h = torch.arange(num_heads, device=device)[None, :, None, None]
    i = torch.arange(seqlen_q, device=device)[None, None, :, None]
    j = torch.arange(seqlen_k, device=device)[None, None, None, :]
    shape = (seq.shape[0], num_heads, seqlen_q, seqlen_k)
    words = philox4x32(seed, (j & ~9).expand(shape), (i & ~8).expand(shape), (seq * num_heads + h).expand(shape),
                       torch.zeros(shape, dtype=torch.int64, device=device), DROPOUT_ROUNDS)
    word = (2 * ((i >> 3) & 1) + ((j >> 3) & 1)).expand(shape)
    chosen = torch.stack(words, dim=-1).gather(-1, word[..., None])[..., 0]
    return ((chosen >> (16 * (j & 1))) & 0xFFFF) >= int(dropout_p * 2 ** 16)


def scores_ref(q, k, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
               attention_chunk=0):
    """q [B, Sq, Hq, D], k [B, Sk, Hkv, D] -> the logits [B, Hq, Sq, Sk] float32 (the product in q's dtype, then
    fp32): scaled, softcapped, ALiBi-biased, -inf where visible_mask hides the key."""
    sq, hq, d = q.shape[1:]
    sk = k.shape[1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(hq // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, sq, sk)
    ok = visible_mask(sq, sk, causal, window_size, device=q.device, attention_chunk=attention_chunk)
    return s.masked_fill(~ok, float("-inf"))


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, upcast=True,
                  alibi_slopes=None, learnable_sink=None, intermediate_dtype=None, attention_chunk=0, dropout_p=0.0,
                  dropout_seed=None, dropout_sequence=0):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (v's head dim may differ: Dv) -> (out [B, Sq, Hq, Dv] in q's dtype,
    lse [B, Hq, Sq] float32).
    intermediate_dtype (flash-attn's rule for FP8): the probabilities are rounded to it before the PV product (the
    low-precision reference of FP8 attention, on dequantized inputs).
    alibi_slopes [Hq] or [B, Hq]: alibi_bias is added after the scale and softcap, before the mask.
    learnable_sink [Hq]: one more logit column per row (unscaled, never masked) with no value: it enters the
    logsumexp, so lse includes it and p = exp(s - lse) sums to less than 1 (autograd reaches the sink).
    attention_chunk: FA3's chunked attention (visible_mask).
    dropout_p > 0 with dropout_seed (the int seed of a call): the probabilities dropout_keep drops are zeroed and the
    others scaled by 1 / (1 - dropout_p) before the PV product; the lse is the undropped one. dropout_sequence: the
    sequence index of batch row 0 (attention_varlen_ref's)."""
    dtype = q.dtype
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    v = v.repeat_interleave(hq // v.shape[2], dim=2)
    s = scores_ref(q, k, softmax_scale, causal, window_size, softcap, alibi_slopes, attention_chunk)
    if learnable_sink is None:
        lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see no key
    else:
        sink = learnable_sink.float()[None, :, None, None].expand(b, hq, sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)  # >= sink: out = 0 where no key is seen
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    if intermediate_dtype is not None:
        p = p.to(intermediate_dtype).to(p.dtype)
    if dropout_p:
        keep = dropout_keep(dropout_seed, dropout_p, hq, sq, sk, range(dropout_sequence, dropout_sequence + b),
                            device=q.device)
        p = torch.where(keep, p / (1.0 - dropout_p), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return out.to(dtype), lse


def _slopes_of(alibi_slopes, b: int):
    """Sequence b's ALiBi slopes [Hq] from slopes [Hq] (shared) or [batch, Hq]; None stays None."""
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[b]


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, alibi_slopes=None, **kw):
    """Packed sequences: q [total_q, Hq, D], k/v [total_k, Hkv, D] (v's head dim may differ: Dv) -> (out
    [total_q, Hq, Dv], lse [Hq, total_q]).
    alibi_slopes [Hq] or [batch, Hq]: positions and lengths are each sequence's. learnable_sink [Hq] (through kw):
    every sequence's. dropout_p / dropout_seed (through kw): sequence i's pattern is dropout_keep's for sequence i."""
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if seqused_k is not None:
            k1 = k0 + min(int(seqused_k[i]), k1 - k0)
        if q1 == q0:
            continue
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                             alibi_slopes=_slopes_of(alibi_slopes, i), dropout_sequence=i, **kw)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def gather_cache(cache, block_table, seqlen: int, b: int):
    """Sequence b's first `seqlen` tokens [seqlen, Hkv, D] from a contiguous [B, S, H, D] or paged cache."""
    if block_table is None:
        return cache[b, :seqlen]
    page_size = cache.shape[1]
    pages = block_table[b, : math.ceil(seqlen / page_size)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:seqlen]


def rotary_ref(x, cos, sin, positions, interleaved: bool, upcast: bool = True):
    """x [S, H, D] rotated at positions [S] by cos/sin [seqlen_ro, rotary_dim / 2] (flash-attn's rotary: GPT-J pairs
    (2i, 2i + 1) when interleaved, else GPT-NeoX pairs (i, i + rotary_dim / 2)); columns past rotary_dim unchanged.
    upcast=False computes in x's dtype (flash-attn's torch reference), else in fp32; returns x's dtype."""
    dt = torch.float32 if upcast else x.dtype
    r = 2 * cos.shape[1]
    c, s_ = (t[positions.long()].to(dt)[:, None, :] for t in (cos, sin))  # [S, 1, R/2]
    xr = x[..., :r].to(dt)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        rot = torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., r:]), dim=-1)


def fp8_quantize_ref(x, scale):
    """x / scale per KV head (scale [1] or [Hkv], heads at dim -2), saturated to +-448, round to nearest even."""
    from .lowp.formats import e4m3_saturate

    return e4m3_saturate(x.float() / scale.float().view(*([1] * (x.dim() - 2)), -1, 1))


def fp8_dequantize_ref(x8, scale):
    return x8.float() * scale.float().view(*([1] * (x8.dim() - 2)), -1, 1)


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False,
                k_scale=None, v_scale=None, k_global_scale=None, v_global_scale=None, cache_batch_idx=None,
                cache_leftpad=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, alibi_slopes=None,
                qv=None, **kw):
    """Reference for flash_attn_with_kvcache on copies of the caches. Returns (out, lse, k_cache, v_cache) with the
    new tokens appended to the returned caches.

    flash-attn's extras: cache_batch_idx picks each sequence's cache row; cache_leftpad drops a sequence's first
    keys (its positions count from the pad); rotary tables rotate the new k at cache_seqlens + i (rounded to k's
    dtype, as stored) and q at cache_seqlens + i when causal or windowed, else at cache_seqlens.

    FP8 caches (k_scale/v_scale): appends are quantized, attention runs on the dequantized cache (fp32; q's dtype
    for the low-precision variant). NVFP4 caches (uint8 data, e4m3 block scales k_scale/v_scale, global scales):
    the same, and the returned k_cache/v_cache are (data, block_scales) pairs. alibi_slopes [Hq] or [B, Hq]: Sk is
    the sequence's length after the append. learnable_sink [Hq] (through kw): as in attention_ref.
    qv [B, Sq, Hq, Dv] (MLA): the queries' latent part, whose keys are the values (v_cache is Dv wide): attention
    of [q, qv] over [k, v] with values v; the default scale is 1 / sqrt(D + Dv)."""
    from .lowp.formats import nvfp4_dequantize_ref, nvfp4_quantize_ref

    b, sq = q.shape[:2]
    s_new = 0 if k is None else k.shape[1]
    if rotary_cos is not None:
        per_token = causal or tuple(kw.get("window_size", (-1, -1))) != (-1, -1)
        q_rot, k_rot = torch.empty_like(q), torch.empty_like(k)
        for i in range(b):
            n0 = int(cache_seqlens[i])
            q_pos = n0 + (torch.arange(sq) if per_token else torch.zeros(sq, dtype=torch.long))
            q_rot[i] = rotary_ref(q[i], rotary_cos, rotary_sin, q_pos, rotary_interleaved, kw.get("upcast", True))
            k_rot[i] = rotary_ref(k[i], rotary_cos, rotary_sin, n0 + torch.arange(s_new), rotary_interleaved)
        q, k = q_rot, k_rot
    nvfp4 = k_global_scale is not None
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if nvfp4:
        k_scale, v_scale = k_scale.clone(), v_scale.clone()
    new = {}
    if k is not None:
        if nvfp4:
            new = {"k": nvfp4_quantize_ref(k, k_global_scale)[:2], "v": nvfp4_quantize_ref(v, v_global_scale)[:2]}
        elif k_scale is not None:
            new = {"k": (fp8_quantize_ref(k, k_scale),), "v": (fp8_quantize_ref(v, v_scale),)}
        else:
            new = {"k": (k,), "v": (v,)}
    stores = {"k": (k_cache, k_scale) if nvfp4 else (k_cache,), "v": (v_cache, v_scale) if nvfp4 else (v_cache,)}
    out = torch.empty_like(q if qv is None else qv)
    lse = torch.empty(b, q.shape[2], sq, dtype=torch.float32, device=q.device)
    page_size = k_cache.shape[1]
    for i in range(b):
        n0 = int(cache_seqlens[i])
        row = i if cache_batch_idx is None else int(cache_batch_idx[i])  # the cache row (a paged cache: i)
        for t in range(s_new):
            pos = n0 + t
            at = (row, pos) if block_table is None else (int(block_table[i, pos // page_size]), pos % page_size)
            for name in ("k", "v"):
                for dst, src in zip(stores[name], new[name]):
                    dst[at] = src[i, t]
        n = n0 + s_new
        pad = 0 if cache_leftpad is None else int(cache_leftpad[i])
        kk, vv = (gather_cache(x, block_table, n, row)[None, pad:] for x in (k_cache, v_cache))
        if nvfp4:
            kk = nvfp4_dequantize_ref(kk, gather_cache(k_scale, block_table, n, row)[None, pad:], k_global_scale)
            vv = nvfp4_dequantize_ref(vv, gather_cache(v_scale, block_table, n, row)[None, pad:], v_global_scale)
        elif k_scale is not None:  # [1], [Hkv], or per sequence [B, Hkv] (FA3's descales)
            kk = fp8_dequantize_ref(kk, k_scale[i] if k_scale.dim() == 2 else k_scale)
            vv = fp8_dequantize_ref(vv, v_scale[i] if v_scale.dim() == 2 else v_scale)
        if kk.dtype != q.dtype and not kw.get("upcast", True):
            kk, vv = kk.to(q.dtype), vv.to(q.dtype)
        qq = q[i: i + 1]
        if qv is not None:
            qq, kk = torch.cat([qq, qv[i: i + 1]], -1), torch.cat([kk, vv], -1)
        o, l = attention_ref(qq, kk, vv, causal=causal, alibi_slopes=_slopes_of(alibi_slopes, i), **kw)
        out[i], lse[i] = o[0], l[0]
    if nvfp4:
        return out, lse, (k_cache, k_scale), (v_cache, v_scale)
    return out, lse, k_cache, v_cache


def merge_ref(out_a, lse_a, out_b, lse_b):
    """out_* [B, S, H, D], lse_* [B, H, S] -> merged (out, lse), float32 maths. A part that saw no key (lse -inf,
    or flash-attn 2.x's +inf) contributes nothing, whatever its out holds."""
    lse_a, lse_b = (torch.where(t == float("inf"), float("-inf"), t) for t in (lse_a, lse_b))
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    wa = torch.exp(lse_a - safe).transpose(1, 2)[..., None]
    wb = torch.exp(lse_b - safe).transpose(1, 2)[..., None]
    out = torch.where(wa > 0, wa * out_a.float(), 0.0) + torch.where(wb > 0, wb * out_b.float(), 0.0)
    return out.to(out_a.dtype), lse


def dtype_atol(ref, dtype) -> float:
    """flash-attn's floor for the 2x rule: twice the rounding error of (r + 0.3 - 0.3) in `dtype` over the reference
    values r, so it scales with the magnitude of the tensor (gradients can be far from 1)."""
    r = ref.to(dtype)
    return 2 * (r + 0.3 - 0.3 - r).abs().max().item() + 1e-6


def error_and_bound(out, ref32, ref_lowp) -> tuple[float, float]:
    """(max|out - ref32|, 2 * max|ref_lowp - ref32| + atol): the project's "2x rule" passes iff err <= bound.
    NaN anywhere in out gives err = inf."""
    if out.numel() == 0:
        return 0.0, 0.0
    if torch.isnan(out).any():
        return float("inf"), 0.0
    err = (out.float() - ref32.float()).abs().max().item()
    noise = (ref_lowp.float() - ref32.float()).abs().max().item()
    return err, 2 * noise + dtype_atol(ref32, ref_lowp.dtype)
