"""flash_attn_with_kvcache: decode / speculative verify over a contiguous or paged KV cache.

Split-KV: num_splits programs share one (sequence, KV head); each writes fp32 partial (o, lse), and the last to
finish merges them (the Triton kernel's fused merge), or attn_combine does in a second launch. Pack-GQA: the Hq/Hkv
query heads of one KV head x the Sq new tokens form one tile of rows.
No host-device synchronisation and no value-dependent allocation, so the call can be captured in a CUDA graph
(validate=True is the exception: it reads device values to check them).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _utils
from ..launch import direct
from ..launch.forward import (launch_attn_fwd, launch_combine, launch_decode_quant, launch_kv_append,
                              launch_mla_decode)
from ..launch.tensors import unit_scale
from ..plan.decode import KV_FORMATS, MAX_DECODE_TOKENS, MAX_SPLITS, DecodeSchedule, cache_capacity, decode_schedule
from ..plan.prefill import Mask
from .prefill import check_softcap


def _plain_append(rotary_cos, cache_leftpad, mask: Mask) -> bool:
    """Whether the call's append is a plain copy into positions its attention programs read (plan/decode.
    append_in_kernel): no rotated keys, no left pads, no left window (one narrower than the append would leave new
    tokens outside every program's key range; attention chunks likewise)."""
    return rotary_cos is None and cache_leftpad is None and mask.window_left < 0 and mask.chunk == 0


def _triton_only(cache_batch_idx, cache_leftpad, rotary_cos, alibi_slopes, cu_seqlens_k_new, learnable_sink,
                 mask: Mask) -> bool:
    """Whether a call passes an argument only the Triton decode kernel has (the register-operand one does not):
    also FA3's attention_chunk (the Triton kernel's CHUNK masks)."""
    return mask.chunk > 0 or any(t is not None for t in (cache_batch_idx, cache_leftpad, rotary_cos, alibi_slopes,
                                                         cu_seqlens_k_new, learnable_sink))


def _kv_scales(k_scale, v_scale, k_global_scale, v_global_scale) -> dict:
    """FP8: k_scale/v_scale factor out of the dots. NVFP4: the global scales do; k_scale/v_scale are block scales."""
    if k_global_scale is not None:
        return dict(k_scale=k_global_scale, v_scale=v_global_scale, k_block_scale=k_scale, v_block_scale=v_scale)
    return dict(k_scale=k_scale, v_scale=v_scale)


def _launch_kvcache(s: DecodeSchedule, mask: Mask, softmax_scale: float, sp_overlap: bool, rotary_interleaved: bool,
                    q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, rotary_cos,
                    rotary_sin, cu_seqlens_q, alibi_slopes, cu_seqlens_k_new, learnable_sink, k_scale, v_scale,
                    k_global_scale, v_global_scale, out, lse, ws, counters=None, qv=None) -> None:
    """The launches of one decode call into out [B, Sq, Hq, Dv] and lse [B, Hq, Sq] (packed queries: [total_q, Hq,
    Dv] and [Hq, total_q]; or, when lse is None, the workspace's tail): the append, the attention, the split
    combine (which adds learnable_sink once: the split partials leave it out). ws: fp32 [>= s.workspace] or None.
    counters: int32 zeros [>= s.counters] (direct.COUNTERS), or None: the attention merges its own splits when
    the schedule asks (s.counters) and counters are given, else the combine launches. qv [B, Sq, Hq, Dv] (MLA) or
    None; Dv is out's head dim."""
    hq, d = out.shape[-2:]
    scales = _kv_scales(k_scale, v_scale, k_global_scale, v_global_scale)
    rotary = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved)
    if (s.s_new or s.varlen_new) and not s.fused_append:
        launch_kv_append(k, v, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx=cache_batch_idx,
                         cu_seqlens_k_new=cu_seqlens_k_new, **rotary, **scales)
    extras = dict(cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes,
                  rotary_per_token=mask.window_left >= 0 or mask.window_right >= 0, cu_seqlens_k_new=cu_seqlens_k_new,
                  learnable_sink=learnable_sink, qv=qv, **rotary)
    if hq == 0:  # nothing to attend with; the append above still happened
        return
    if s.max_seqlen_q:  # packed queries: viewed as one batch row with a batch stride of 0
        total_q = q.shape[0]
        if lse is None:
            lse = direct.derived(ws[:hq * total_q].view(hq, total_q), ws)
        q4, out4, lse3 = (direct.derived(t.unsqueeze(0), t) for t in (q, out, lse))
        launch_attn_fwd(q4, k_cache, v_cache, out4, lse3, q_batch_stride0=True, k_batch_stride0=False,
                        num_batches=cache_seqlens.shape[0], seqlen_q=total_q, seqlen_k=s.capacity,
                        m_rows=s.max_seqlen_q, softmax_scale=softmax_scale, mask=mask, config=s.cfg,
                        cu_seqlens_q=cu_seqlens_q, seqlens_k=cache_seqlens, seqlen_k_add=s.s_new,
                        block_table=block_table, sp_overlap=s.cfg.sp_overlap, **extras, **scales)
        return
    b, sq = q.shape[:2]
    rows = b * sq * hq
    split = s.num_splits > 1
    part = rows * d * s.num_splits if split else 0
    o_part = direct.derived(ws[:part].view(s.num_splits, rows, d), ws) if split else None
    lse_part = direct.derived(ws[part:part + s.num_splits * rows].view(s.num_splits, rows), ws) if split else None
    if lse is None:
        lse = direct.derived(ws[s.workspace - rows:s.workspace].view(b, hq, sq), ws)
    if s.mcfg is not None:
        launch_mla_decode(q, qv, k_cache, v_cache, out, lse, seqlens_k=cache_seqlens, seqlen_k_add=s.s_new,
                          block_table=block_table, softmax_scale=softmax_scale, causal=mask.window_right == 0,
                          config=s.mcfg, o_part=o_part, lse_part=lse_part, after_prior=s.after_prior, **scales)
    elif s.qcfg is not None:
        launch_decode_quant(q, k_cache, v_cache, out, lse, seqlen_k=s.capacity, seqlens_k=cache_seqlens,
                            seqlen_k_add=s.s_new, block_table=block_table, softmax_scale=softmax_scale, mask=mask,
                            config=s.qcfg, num_splits=s.num_splits, o_part=o_part, lse_part=lse_part, pdl=s.pdl,
                            **scales)
    else:
        launch_attn_fwd(q, k_cache, v_cache, out, lse, q_batch_stride0=False, k_batch_stride0=False,
                        num_batches=b, seqlen_q=sq, seqlen_k=s.capacity,
                        m_rows=sq if s.prefill else sq * (hq // k_cache.shape[2]), softmax_scale=softmax_scale,
                        mask=mask, config=s.cfg, seqlens_k=cache_seqlens, seqlen_k_add=s.s_new,
                        block_table=block_table, pack_gqa=not s.prefill, num_splits=s.num_splits,
                        sp_overlap=s.cfg.sp_overlap if s.prefill else sp_overlap, o_part=o_part, lse_part=lse_part,
                        pdl=s.pdl, counters=counters, k_new=k if s.fused_append else None,
                        v_new=v if s.fused_append else None, after_prior=s.after_prior, **extras, **scales)
        if counters is not None:  # the splits merged in the attention launch
            return
    if split:
        launch_combine(o_part, lse_part, out, lse, pdl=s.pdl, learnable_sink=learnable_sink, let_next=s.after_prior)


def _attn_kvcache_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                       v: Optional[torch.Tensor], cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                       cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
                       rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor],
                       cu_seqlens_q: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                       cu_seqlens_k_new: Optional[torch.Tensor], learnable_sink: Optional[torch.Tensor],
                       max_seqlen_q: int, rotary_interleaved: bool,
                       softmax_scale: float, window_left: int, window_right: int, softcap: float, num_splits: int,
                       sp_overlap: bool, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                       k_global_scale: Optional[torch.Tensor], v_global_scale: Optional[torch.Tensor],
                       qv: Optional[torch.Tensor], attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom op's implementation (torch.compile); eager calls take a DecodePlan. max_seqlen_q > 0 with packed
    queries (cu_seqlens_q), else 0."""
    out = _utils.new_output((qv if qv is not None else q).shape, q.dtype, q.device)
    lse = _utils.new_output(_lse_shape(q, max_seqlen_q), torch.float32, q.device)
    if cache_seqlens.shape[0] == 0:
        return out, lse
    mask = Mask(window_left, window_right, softcap, attention_chunk)
    extras = _triton_only(cache_batch_idx, cache_leftpad, rotary_cos, alibi_slopes, cu_seqlens_k_new, learnable_sink,
                          mask)
    s = decode_schedule(q, k_cache, v_cache, k, block_table, num_splits, sp_overlap, lse_in_workspace=False,
                  extras=extras, causal_tiles=window_right >= 0,
                  max_seqlen_q=max_seqlen_q, varlen_new=cu_seqlens_k_new is not None, mla=qv is not None,
                  plain_mask=mask.at_most_causal, v=v, plain_append=_plain_append(rotary_cos, cache_leftpad, mask))
    ws = torch.empty(s.workspace, dtype=torch.float32, device=q.device) if s.workspace else None
    counters = direct.COUNTERS.get(q.device, direct.current_stream(q.device), s.counters) if s.counters else None
    _launch_kvcache(s, mask, softmax_scale, sp_overlap, rotary_interleaved, q, k_cache, v_cache, k, v, cache_seqlens,
                    block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, cu_seqlens_q, alibi_slopes,
                    cu_seqlens_k_new, learnable_sink, k_scale, v_scale, k_global_scale, v_global_scale, out, lse, ws,
                    counters, qv)
    return out, lse


def _lse_shape(q, max_seqlen_q: int) -> tuple:
    """[B, Hq, Sq], or [Hq, total_q] for packed queries (flash-attn's varlen layout)."""
    if max_seqlen_q:
        return q.shape[1], q.shape[0]
    b, sq, hq, _ = q.shape
    return b, hq, sq


_attn_kvcache_op = torch.library.custom_op(
    "tileflash::attn_kvcache", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))(_attn_kvcache_impl)


@_attn_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
      cu_seqlens_q, alibi_slopes, cu_seqlens_k_new, learnable_sink, max_seqlen_q, rotary_interleaved, softmax_scale,
      window_left, window_right, softcap, num_splits, sp_overlap, k_scale, v_scale, k_global_scale, v_global_scale,
      qv, attention_chunk=0):
    return torch.empty_like(qv if qv is not None else q), q.new_empty(_lse_shape(q, max_seqlen_q), dtype=torch.float32)


def _check_kv_scales(k_cache, v_cache, k_scale, v_scale, k_global_scale, v_global_scale, num_heads_kv: int,
                     head_dim: int, device) -> None:
    """FP8 caches need fp32 scales ([1] per tensor or [Hkv] per KV head; FA3's per-sequence [B, Hkv], whose shape
    _check_kvcache checks); NVFP4 caches (uint8) need e4m3 block scales shaped like the cache with D/16 in the last
    dim, sharing strides, and fp32 global scales; bf16/fp16 caches take none."""
    fmt = KV_FORMATS.get(k_cache.dtype)
    if fmt is not None:
        _utils.check_fp8_hardware("k_cache", k_cache)
    names = (("k_scale", k_scale), ("v_scale", v_scale), ("k_global_scale", k_global_scale),
             ("v_global_scale", v_global_scale))
    needed = {None: (), "fp8": ("k_scale", "v_scale"), "nvfp4": tuple(n for n, _ in names)}[fmt]
    for name, t in names:
        if name not in needed:
            if t is not None:
                raise ValueError(f"{name}: not used with a {k_cache.dtype} cache (fp8 caches take k_scale/v_scale, "
                                 f"nvfp4 (uint8) caches also k_global_scale/v_global_scale); expected None, got a "
                                 f"tensor")
        elif t is None:
            raise ValueError(f"{name}: required with a {k_cache.dtype} cache, got None")
    if fmt == "fp8":
        for name, t in names[:2]:
            _utils.check_tensor(name, t, dtypes=(torch.float32,), device=device)
            if t.dim() == 2:  # FA3's [B, Hkv] descales (flash_attn_with_kvcache's k_descale / v_descale)
                continue
            if t.dim() != 1 or t.shape[0] not in (1, num_heads_kv) or (t.shape[0] > 1 and t.stride(0) != 1):
                raise ValueError(f"{name}: expected a contiguous shape [1] or [{num_heads_kv}], got {tuple(t.shape)}")
        if k_scale.shape != v_scale.shape:
            raise ValueError(f"k_scale, v_scale: expected equal shapes, got {tuple(k_scale.shape)} and "
                             f"{tuple(v_scale.shape)}")
    elif fmt == "nvfp4":
        if head_dim & (head_dim - 1) or head_dim < 32:
            # Head dim 16 (one scale per head vector) decoded wrongly on the H200 (triton 3.6) while the
            # interpreter was exact; refused until that is understood (benchmarks/archive/notebook-2026-11.md).
            raise ValueError(f"k_cache: NVFP4 caches need a power-of-two head dim >= 32, got {head_dim}")
        expected = (*k_cache.shape[:-1], head_dim // 16)
        for name, t in names[:2]:
            _utils.check_tensor(name, t, ndim=4, dtypes=(torch.float8_e4m3fn,), device=device)
            if tuple(t.shape) != expected or t.stride(-1) != 1:
                raise ValueError(f"{name}: expected e4m3 block scales of shape {expected} (last dim contiguous), "
                                 f"got {tuple(t.shape)}")
        if k_scale.stride() != v_scale.stride() or k_cache.stride() != v_cache.stride():
            raise ValueError(f"k_scale, v_scale / k_cache, v_cache: NVFP4 K and V tensors must share strides, got "
                             f"{k_scale.stride()} / {v_scale.stride()} and {k_cache.stride()} / {v_cache.stride()}")
        for name, t in names[2:]:
            _utils.check_tensor(name, t, dtypes=(torch.float32,), device=device)
            if t.numel() != 1:
                raise ValueError(f"{name}: expected one float32 value, got shape {tuple(t.shape)}")


def _check_extras(q, b: int, k, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, capacity: int):
    """flash-attn's cache_batch_idx / cache_leftpad ([B] int32; cache_batch_idx for contiguous caches) and rotary tables
    (rotary_cos / rotary_sin [seqlen_ro >= the cache capacity, rotary_dim / 2], q's dtype or fp32; they rotate the
    new k, so k and v must be given)."""
    dev = q.device
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is None:
            continue
        if block_table is not None and name == "cache_batch_idx":  # (flash_attn_with_kvcache gathers table rows)
            raise ValueError(f"{name}: not supported with a paged cache (block_table); index pages instead")
        _utils.check_int32(name, t, 1, dev)
        if t.shape[0] != b or (b > 1 and t.stride(0) != 1):
            raise ValueError(f"{name}: expected a contiguous [{b}] tensor (batch), got shape {tuple(t.shape)}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: pass both or neither")
    if rotary_cos is None:
        return
    if k is None:
        raise ValueError("rotary_cos: rotary embedding applies to new keys; pass k and v (flash-attn's rule)")
    d = q.shape[-1]
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _utils.check_tensor(name, t, ndim=2, dtypes=(q.dtype, torch.float32), device=dev)
        _utils.check_last_dim_contiguous(name, t)
    if rotary_cos.shape != rotary_sin.shape or rotary_cos.stride() != rotary_sin.stride() \
            or rotary_cos.dtype != rotary_sin.dtype:
        raise ValueError(f"rotary_cos, rotary_sin: expected equal shapes, strides and dtypes, got "
                         f"{tuple(rotary_cos.shape)} / {tuple(rotary_sin.shape)}")
    seqlen_ro, half = rotary_cos.shape
    if not 1 <= 2 * half <= d:
        raise ValueError(f"rotary_cos: expected [seqlen_ro, rotary_dim / 2] with 2 <= rotary_dim <= {d} (the head "
                         f"dim), got {tuple(rotary_cos.shape)}")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos: expected at least {capacity} rows (the cache capacity), got {seqlen_ro}")


def _check_qv(q, qv, k_cache, v_cache) -> None:
    """MLA (FA3's qv): qv [B, Sq, Hq, Dv] in q's dtype, Dv = v_cache's head dim (the latent, <= MAX_LATENT_DIM), 16-bit
    or FP8 caches whose shapes differ only in the head dim, and decode-sized calls (at most MAX_DECODE_TOKENS query
    tokens per sequence, packed queries only when all have the same count)."""
    _utils.check_tensor("qv", qv, ndim=q.dim(), dtypes=(q.dtype,), device=q.device)
    _utils.check_last_dim_contiguous("qv", qv)
    if k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"qv: MLA takes {q.dtype} (q's dtype) or float8_e4m3fn caches, got {k_cache.dtype}")
    dv = v_cache.shape[3]
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache, v_cache: expected equal shapes but the head dim, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if not 1 <= dv <= _utils.MAX_LATENT_DIM:
        raise ValueError(f"v_cache: MLA's latent head dim must be 1..{_utils.MAX_LATENT_DIM}, got {dv}")
    if tuple(qv.shape) != (*q.shape[:-1], dv):
        raise ValueError(f"qv: expected shape {(*q.shape[:-1], dv)} (q's, with v_cache's head dim), got "
                         f"{tuple(qv.shape)}")
    if q.dim() == 3:
        raise ValueError("qv: packed queries (cu_seqlens_q) only when every sequence has max_seqlen_q of them")
    if q.shape[1] > MAX_DECODE_TOKENS:
        raise ValueError(f"qv: MLA decode takes at most {MAX_DECODE_TOKENS} query tokens per sequence, got "
                         f"{q.shape[1]}")


def _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, k_scale, v_scale,
                   k_global_scale, v_global_scale, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
                   rotary_sin=None, cu_seqlens_q=None, max_seqlen_q=None, alibi_slopes=None, cu_seqlens_k_new=None,
                   learnable_sink=None, qv=None):
    """q [B, Sq, Hq, D], or packed [total_q, Hq, D] with cu_seqlens_q [B + 1] int32 and max_seqlen_q (FA3); k, v
    [B, Snew, Hkv, D], or packed [total_new, Hkv, D] with cu_seqlens_k_new [B + 1] int32 (FA3). MLA (qv [B, Sq, Hq,
    Dv]): v_cache and v are Dv wide."""
    _utils.check_tensor("q", q, ndim=4 if cu_seqlens_q is None else 3, dtypes=_utils.SUPPORTED_DTYPES)
    dev = q.device
    cache_dtypes = (q.dtype, torch.float8_e4m3fn, torch.uint8)
    _utils.check_tensor("k_cache", k_cache, ndim=4, dtypes=cache_dtypes, device=dev)
    _utils.check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=dev)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _utils.check_last_dim_contiguous(name, t)
    hq, d = q.shape[-2:]
    _utils.check_head_dim(d)
    if cu_seqlens_q is None:
        b = q.shape[0]
        if q.shape[1] < 1:
            raise ValueError(f"q: expected at least one query token per sequence (dim 1), got {q.shape[1]}")
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q: only with cu_seqlens_q (packed queries)")
    else:
        _utils.check_int32("cu_seqlens_q", cu_seqlens_q, 1, dev)
        if cu_seqlens_q.shape[0] < 2 or cu_seqlens_q.stride(0) != 1:
            raise ValueError(f"cu_seqlens_q: expected a contiguous [batch + 1] tensor, got {tuple(cu_seqlens_q.shape)}")
        b = cu_seqlens_q.shape[0] - 1
        if max_seqlen_q is None or _utils.as_int("max_seqlen_q", max_seqlen_q) < 0:
            raise ValueError(f"max_seqlen_q: required with cu_seqlens_q (>= every sequence's query count), got "
                             f"{max_seqlen_q}")
    dv = v_cache.shape[3] if qv is not None else d
    if qv is not None:
        _check_qv(q, qv, k_cache, v_cache)
    elif k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache, v_cache: expected equal shapes, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)} (different head dims need qv: MLA)")
    hkv = k_cache.shape[2]
    cache_d = k_cache.shape[3] * (2 if k_cache.dtype == torch.uint8 else 1)  # NVFP4 packs two values per byte
    if cache_d != d:
        raise ValueError(f"k_cache: expected head dim {d} (q's; NVFP4: {d // 2} bytes), got {k_cache.shape[3]}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k_cache: number of KV heads must divide the query heads, got Hq={hq}, Hkv={hkv}")
    _check_kv_scales(k_cache, v_cache, k_scale, v_scale, k_global_scale, v_global_scale, hkv, d, dev)
    if k_scale is not None and k_scale.dim() == 2:  # FA3's per-sequence descales
        if tuple(k_scale.shape) != (b, hkv):
            raise ValueError(f"k_scale, v_scale (FA3's k_descale, v_descale): per-sequence scales are [batch, Hkv] = "
                             f"({b}, {hkv}), got {tuple(k_scale.shape)}")
        if k is not None or qv is not None:
            raise NotImplementedError("k_scale, v_scale (FA3's k_descale, v_descale): per-sequence [batch, Hkv] scales "
                                      "are for reading the cache; appends (k, v) and qv take [1] or [Hkv] scales")
    if block_table is not None:
        _utils.check_int32("block_table", block_table, 2, dev)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table: expected {b} rows (batch), got {block_table.shape[0]}")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise ValueError(f"block_table: last dimension must be contiguous (stride 1), got stride "
                             f"{block_table.stride(1)}")
        page_size = k_cache.shape[1]
        if page_size < 1:  # any size: the kernels read one table entry per token (or per TMA box)
            raise ValueError(f"k_cache: page size (dim 1) must be >= 1, got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != b and cache_batch_idx is None:
            raise ValueError(f"k_cache: expected batch {b} (q's) for a contiguous cache, got {k_cache.shape[0]} "
                             f"(pass block_table for a paged cache, or cache_batch_idx)")
        if k_cache.shape[0] == 0 and b:
            raise ValueError("k_cache: a contiguous cache with no rows")
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: required with new keys k, v ([batch] int32, tokens already in each "
                         "sequence's cache; without k, v it defaults to the whole cache), got None")
    _utils.check_int32("cache_seqlens", cache_seqlens, 1, dev)
    if cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens: expected {b} elements (batch), got {cache_seqlens.shape[0]}")
    if (k is None) != (v is None):
        given = lambda t: "None" if t is None else "a tensor"  # noqa: E731
        raise ValueError(f"k, v: pass both new keys and new values, or neither; got k={given(k)}, v={given(v)}")
    s_new = 0
    packed_new = cu_seqlens_k_new is not None
    if packed_new:
        if k is None:
            raise ValueError("cu_seqlens_k_new: given without k and v (the new tokens it indexes)")
        _utils.check_int32("cu_seqlens_k_new", cu_seqlens_k_new, 1, dev)
        if cu_seqlens_k_new.shape[0] != b + 1 or cu_seqlens_k_new.stride(0) != 1:
            raise ValueError(f"cu_seqlens_k_new: expected a contiguous [{b + 1}] tensor (batch + 1), got "
                             f"{tuple(cu_seqlens_k_new.shape)}")
    if k is not None:
        for name, t, width in (("k", k, d), ("v", v, dv)):
            _utils.check_tensor(name, t, ndim=3 if packed_new else 4, dtypes=(q.dtype,), device=dev)
            _utils.check_last_dim_contiguous(name, t)
            if packed_new and tuple(t.shape[1:]) != (hkv, width):
                raise ValueError(f"{name}: expected shape [total_new, {hkv}, {width}], got {tuple(t.shape)}")
            if not packed_new and tuple(t.shape) != (b, t.shape[1], hkv, width):
                raise ValueError(f"{name}: expected shape [{b}, Snew, {hkv}, {width}], got {tuple(t.shape)}")
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"k, v: expected equal shapes but the head dim, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        s_new = 0 if packed_new else k.shape[1]
        if s_new > capacity:
            raise _utils.CacheCapacityError(f"k: {s_new} new tokens exceed the cache capacity of {capacity} tokens")
    _check_extras(q, b, k, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, capacity)
    _utils.check_alibi_slopes(alibi_slopes, b, hq, dev)
    _utils.check_learnable_sink(learnable_sink, hq, dev)
    num_splits = _utils.as_int("num_splits", num_splits)
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 0 (heuristic), 1 (no split) or 2..{MAX_SPLITS}, got {num_splits}")
    return capacity, s_new


def _validate_values(k_cache, cache_seqlens, block_table, capacity: int, s_new: int, cache_batch_idx=None,
                     cache_leftpad=None, cu_seqlens_k_new=None) -> None:
    """Checks that read device values (a host sync): lengths within capacity, page indices inside the pool, cache
    rows inside the cache, left pads inside their sequences; packed appends (cu_seqlens_k_new) non-decreasing,
    each sequence's count in place of s_new."""
    seqlens = cache_seqlens.cpu()
    if cache_batch_idx is not None and cache_batch_idx.numel():
        rows = cache_batch_idx.cpu()
        if int(rows.min()) < 0 or int(rows.max()) >= k_cache.shape[0]:
            raise ValueError(f"cache_batch_idx: expected values in [0, {k_cache.shape[0]}) (cache rows), got min "
                             f"{int(rows.min())}, max {int(rows.max())}")
    if cache_leftpad is not None and cache_leftpad.numel():
        pads = cache_leftpad.cpu()
        if int(pads.min()) < 0 or bool((pads > seqlens).any()):
            raise ValueError("cache_leftpad: expected 0 <= cache_leftpad <= cache_seqlens for every sequence")
    if seqlens.numel() and int(seqlens.min()) < 0:
        raise ValueError(f"cache_seqlens: expected values >= 0, got min {int(seqlens.min())}")
    new = s_new
    if cu_seqlens_k_new is not None:
        new = cu_seqlens_k_new.cpu().diff()
        if new.numel() and int(new.min()) < 0:
            raise ValueError("cu_seqlens_k_new: expected non-decreasing offsets")
    used = seqlens + new
    if used.numel() and int(used.max()) > capacity:
        where = "" if block_table is None else f" (block_table's {block_table.shape[1]} pages of {k_cache.shape[1]})"
        raise _utils.CacheCapacityError(f"cache_seqlens + Snew: {int(used.max())} tokens exceed the cache capacity "
                                        f"of {capacity} tokens{where}")
    if block_table is not None:
        _utils.check_block_table_values(block_table, used.tolist(), k_cache.shape[1], k_cache.shape[0])


class DecodePlan(direct.Replayable):
    """One decode call's host work done once (checks, tiles, splits, workspace layout, the kernels' arguments),
    runnable per layer with that layer's q and caches. Made by `decode_plan` (or internally by every eager
    flash_attn_with_kvcache call, keyed on its signature). Its first run records the launches (launch/direct.py);
    later runs replay them, so a run costs a few microseconds plus the kernels. cache_seqlens, block_table,
    cache_batch_idx, cache_leftpad, the rotary tables, the ALiBi slopes, the sink and the scale tensors are the
    plan's (bound by decode_plan; the plans flash_attn_with_kvcache caches keep none, so they hold no call's tensors
    alive): change their values in place between runs (CUDA-graph replays included), not the tensors."""
    # cache_seqlens, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, cu_seqlens_q, alibi_slopes,
    # cu_seqlens_k_new, learnable_sink
    index = (None,) * 10
    scales = (None, None, None, None)

    def __init__(self, schedule: DecodeSchedule, mask: Mask, softmax_scale: float, sp_overlap: bool,
                 rotary_interleaved: bool, q_key, k_cache, v_cache, k, v, scales, return_lse: bool, validate: bool,
                 batch: int, qv=None):
        self.schedule, self.mask, self.softmax_scale, self.sp_overlap = schedule, mask, softmax_scale, sp_overlap
        self.rotary_interleaved, self.batch = rotary_interleaved, batch
        self.keys = (q_key, *map(direct.tensor_key, (k_cache, v_cache, k, v, *scales, qv)))
        # A run without new tokens, scales or qv compares three keys (the plan's scales are its own)
        self.cache_keys = self.keys[:3] if k is None and v is None and qv is None else None
        self.return_lse, self.validate = return_lse, validate
        self.out_shape, self.dtype, self.device = q_key[0], q_key[2], q_key[3]
        if qv is not None:  # MLA: out is the latent's width
            self.out_shape = tuple(qv.shape)
        self.lse_shape = (self.out_shape[1], self.out_shape[0]) if schedule.max_seqlen_q else \
            (self.out_shape[0], self.out_shape[2], self.out_shape[1])

    def run(self, q, k_cache, v_cache, k=None, v=None, out=None, k_scale=None, v_scale=None, k_global_scale=None,
            v_global_scale=None, qv=None):
        """flash_attn_with_kvcache(q, k_cache, v_cache, k, v, <the plan's arguments>, qv=qv): out [B, Sq, Hq, D]
        (MLA: qv's shape; into `out` when given: contiguous, that shape and q's dtype), with return_lse also lse. The
        tensors must have the plan's shapes, strides, dtypes, devices and 16-byte alignment (qv: given exactly when
        the plan's was); scale tensors default to the plan's."""
        given = (k_scale, v_scale, k_global_scale, v_global_scale)
        if self.cache_keys is not None and k is v is qv is k_scale is v_scale is k_global_scale is v_global_scale \
                is None:
            scales, keys, expected = self.scales, (q, k_cache, v_cache), self.cache_keys
        else:
            scales = tuple(g if g is not None else p for g, p in zip(given, self.scales))
            keys, expected = (q, k_cache, v_cache, k, v, *scales, qv), self.keys
        if tuple(map(direct.tensor_key, keys)) != expected:
            raise ValueError("DecodePlan.run: q, k_cache, v_cache, k, v, scales and qv must match the plan's shapes, "
                             "strides, dtypes, devices and 16-byte alignment (make a plan per layout)")
        if out is not None and (out.shape != self.out_shape or out.dtype != self.dtype or out.device != self.device
                                or not out.is_contiguous() or out.data_ptr() & 15):
            raise ValueError(f"out: expected a contiguous, 16-byte aligned {self.dtype} tensor of shape "
                             f"{tuple(self.out_shape)} on {self.device}, got {tuple(out.shape)} {out.dtype}")
        return self._run(q, k_cache, v_cache, k, v, self.index, scales, out, qv)

    def _launch(self, *slots):
        _launch_kvcache(self.schedule, self.mask, self.softmax_scale, self.sp_overlap, self.rotary_interleaved,
                        *slots)

    def _run(self, q, k_cache, v_cache, k, v, index, scales, out=None, qv=None):
        """index: (cache_seqlens, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
        cu_seqlens_q, alibi_slopes, cu_seqlens_k_new, learnable_sink)."""
        s = self.schedule
        if self.validate:
            _validate_values(k_cache, index[0], index[1], s.capacity, s.s_new, index[2], index[3], index[8])
        if out is None:
            out = _utils.new_output_like(qv if qv is not None else q)
        lse = _utils.new_output(self.lse_shape, torch.float32, self.device) if self.return_lse else None
        stream = direct.current_stream(self.device)
        ws = direct.WORKSPACE.get(self.device, stream, s.workspace) if s.workspace else None
        counters = direct.COUNTERS.get(self.device, stream, s.counters) if s.counters else None
        slots = (q, k_cache, v_cache, k, v, *index, *scales, out, lse, ws, counters, qv)
        if self.batch and s.counters and counters is None:  # inside a CUDA-graph capture (direct.Counters):
            self._launch(*slots)  # the combine launch, not recorded
        elif self.batch:  # an empty batch launches nothing
            self.execute(self._launch, slots, stream)
        return (out, lse) if self.return_lse else out


_PLANS = direct.PlanCache()


def _make_plan(q, k_cache, v_cache, k, v, index, softmax_scale, causal, window_size, softcap, rotary_interleaved,
               num_splits, return_lse, sp_overlap, validate, scales, max_seqlen_q=None, qv=None,
               attention_chunk=0) -> DecodePlan:
    """Check every argument (raising before any launch) and plan the call."""
    cache_seqlens, block_table, batch_idx, leftpad, rotary_cos, rotary_sin, cu_seqlens_q, alibi_slopes, cu_k_new, \
        learnable_sink = index
    capacity, s_new = _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, *scales,
                                     batch_idx, leftpad, rotary_cos, rotary_sin, cu_seqlens_q, max_seqlen_q,
                                     alibi_slopes, cu_k_new, learnable_sink, qv)
    if qv is not None and sp_overlap:
        raise ValueError("sp_overlap: not with qv (MLA takes the plain loop)")
    left, right = _utils.check_window(window_size)
    mask = Mask.make(causal, (left, right), check_softcap(softcap), _utils.check_attention_chunk(attention_chunk))
    packed = cu_seqlens_q is not None  # its tiles need at least one row
    sched = decode_schedule(q, k_cache, v_cache, k, block_table, int(num_splits), bool(sp_overlap),
                      lse_in_workspace=not return_lse,
                      extras=_triton_only(batch_idx, leftpad, rotary_cos, alibi_slopes, cu_k_new, learnable_sink, mask),
                      causal_tiles=mask.window_right >= 0, max_seqlen_q=max(int(max_seqlen_q), 1) if packed else 0,
                      varlen_new=cu_k_new is not None, mla=qv is not None, plain_mask=mask.at_most_causal, v=v,
                      plain_append=_plain_append(rotary_cos, leftpad, mask))
    # On the CPU reading values costs no sync, so they are always checked there.
    validate = bool(validate) or q.device.type == "cpu"
    return DecodePlan(sched, mask, _utils.default_scale(softmax_scale, q, qv), bool(sp_overlap),
                      bool(rotary_interleaved), direct.tensor_key(q), k_cache, v_cache, k, v, scales,
                      bool(return_lse), validate, cache_seqlens.shape[0], qv)


def _block_table(block_table, page_table):
    """flash-attn 2.x's block_table or FA3's page_table (the same argument)."""
    if page_table is None:
        return block_table
    if block_table is not None:
        raise ValueError("block_table, page_table: the same argument under two names (flash-attn 2.x's and FA3's); "
                         "pass one")
    return page_table


def decode_plan(q, k_cache, v_cache, cache_seqlens, block_table=None, k=None, v=None, softmax_scale=None,
                causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0, return_lse=False, sp_overlap=False,
                validate=False, k_scale=None, v_scale=None, k_global_scale=None, v_global_scale=None,
                dtype=torch.bfloat16, *, rotary_cos=None, rotary_sin=None, cache_batch_idx=None, cache_leftpad=None,
                rotary_interleaved=True, alibi_slopes=None, learnable_sink=None, qv=None,
                attention_chunk=0) -> DecodePlan:
    """Plan flash_attn_with_kvcache calls that share everything but q, the caches and the new k/v (the layers of
    one decode step; FlashInfer's plan/run pattern): `plan = decode_plan(q, k_cache, v_cache, cache_seqlens, ...)`
    once per step, then `plan.run(q, k_cache, v_cache, k, v)` per layer, graph-capturable. Arguments as
    flash_attn_with_kvcache's; q may be a tensor or a shape (a contiguous q of `dtype` on k_cache's device);
    k/v (new tokens, if any) give their shapes; cache_seqlens, block_table, the scales and the other index tensors
    (rotary tables, cache_batch_idx, cache_leftpad, alibi_slopes, learnable_sink) are bound to the plan. Results equal
    flash_attn_with_kvcache's bitwise. qv (MLA), like q, a tensor or a shape: then every run passes its qv."""
    if not isinstance(q, torch.Tensor):
        q = torch.empty(tuple(q), dtype=dtype, device=k_cache.device)
    if qv is not None and not isinstance(qv, torch.Tensor):
        qv = torch.empty(tuple(qv), dtype=q.dtype, device=q.device)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected an int32 tensor, got {type(cache_seqlens).__name__}")
    scales = (k_scale, v_scale, k_global_scale, v_global_scale)
    index = (cache_seqlens, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, None, alibi_slopes,
             None, learnable_sink)
    plan = _make_plan(q, k_cache, v_cache, k, v, index, softmax_scale, causal, window_size, softcap,
                      rotary_interleaved, num_splits, return_lse, sp_overlap, validate, scales, qv=qv,
                      attention_chunk=attention_chunk)
    plan.index, plan.scales = index, scales
    return plan


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            return_lse=False, page_table=None, cu_seqlens_q=None, max_seqlen_q=None,
                            cu_seqlens_k_new=None, sp_overlap=False, validate=False, k_scale=None, v_scale=None,
                            k_global_scale=None, v_global_scale=None, learnable_sink=None, qv=None, q_descale=None,
                            k_descale=None, v_descale=None, rotary_seqlens=None, attention_chunk=0,
                            scheduler_metadata=None, pack_gqa=None, sm_margin=0):
    """Attention of new query tokens over a KV cache, appending new K/V in place: decode (1..16 tokens per
    sequence: pack-GQA tiles, split-KV) or extend / chunked prefill (more tokens: prefill tiles, no split).

    Arguments in flash-attn 2.x's order (FA3's page_table and return_softmax_lse names are accepted too).
    q [B, Sq, Hq, D]; k_cache/v_cache [B, S_max, Hkv, D], or paged [num_pages, page_size, Hkv, D] with
    block_table [B, max_pages] int32 (any page size, pages in any order); cache_seqlens [B] int32.
    k, v [B, Snew, Hkv, D] are written at positions cache_seqlens .. cache_seqlens + Snew, then attention runs over
    cache_seqlens + Snew tokens; causal=True masks bottom-right aligned (flash-attn's default, causal=False, lets
    every new query see every new key: pass causal=True for several new tokens of one sequence). cache_seqlens may
    be an int (every sequence's length), or None without k, v: the whole cache (flash-attn 2.x). num_splits
    (decode): 0 heuristic, 1 none, n exactly n.
    cache_batch_idx [B] int32: the contiguous cache's row of each sequence (the cache may hold more rows than B);
    with a paged cache (FA3's), the block_table row of each sequence (the table may hold more rows than B).
    cache_leftpad [B] int32: sequence b's keys start at cache position cache_leftpad[b] (keys [cache_leftpad,
    cache_seqlens + Snew), positions and masks counted from the pad; a paged cache reads them by pointers).
    rotary_cos / rotary_sin [seqlen_ro >= the capacity, rotary_dim / 2] (q's dtype or fp32; with k and v): the new k
    is rotated at positions cache_seqlens + i before the append, q at cache_seqlens + i when causal or windowed and
    at cache_seqlens otherwise; rotary_interleaved=True pairs dims (2i, 2i + 1) (GPT-J), False pairs i and
    i + rotary_dim / 2 (GPT-NeoX). Columns past rotary_dim are not rotated (flash-attn's semantics throughout).
    sp_overlap=True selects the S/P-overlapped inner loop (QK^T of block j+1 issued before the softmax of block j);
    the default plain loop measured as fast or faster on the H200 with triton 3.6 (notebook).
    FP8 caches: k_cache/v_cache in float8_e4m3fn with k_scale/v_scale (float32, [1] per tensor or [Hkv] per KV
    head): K = k_scale * k_cache; new k/v (in q's dtype) are quantized into the cache (x / scale, saturated, RNE).
    NVFP4 caches: k_cache/v_cache uint8 [.., S, Hkv, D/2] (element 2i in the low nibble), k_scale/v_scale
    float8_e4m3fn [.., S, Hkv, D/16] (one scale per 16 elements), k_global_scale/v_global_scale float32 [1] or []:
    K = e2m1 * k_scale * k_global_scale (tileflash.nvfp4_quantize's format); appends quantize with the global
    scale. D must be a power of two >= 32.
    validate=True checks cache_seqlens, block_table, cache_batch_idx and cache_leftpad values against the cache
    (costs a device sync); without it they are the caller's contract (lengths are clamped to the capacity in the
    kernel; page and row indices are trusted).
    FA3's packed queries: q [total_q, Hq, D] with cu_seqlens_q [B + 1] int32 and max_seqlen_q (SGLang's extend and
    decode); out [total_q, Hq, D], lse [Hq, total_q]. When every sequence has max_seqlen_q tokens (total_q =
    B * max_seqlen_q, e.g. one each in decode) the call runs as the padded one; ragged queries take the prefill
    tiles. A q of exactly B * max_seqlen_q rows is taken to hold max_seqlen_q queries per sequence (read from
    cu_seqlens_q only on CPU tensors or with validate=True: on the GPU that costs a sync), so a buffer of that size
    with ragged counts must be trimmed to cu_seqlens_q[-1] rows. FA3's packed appends: k, v [total_new, Hkv, D]
    with cu_seqlens_k_new [B + 1] int32 (sequence b appends k[cu[b]:cu[b + 1]] at cache_seqlens[b]).
    alibi_slopes: fp32 [Hq] or [B, Hq], as in flash_attn_func, with Sk = cache_seqlens + Snew (after the append).
    learnable_sink: fp32 [Hq], as in flash_attn_func (forward only here); split-KV adds it once, in the combine.
    MLA (DeepSeek-V2/V3's latent attention, FA3's qv): qv [B, Sq, Hq, Dv] holds the queries' latent part and q their
    rotary part [.., D]; k_cache [.., Hkv, D] the keys' rotary part and v_cache [.., Hkv, Dv] the latent, which is both
    the rest of the key and the value: score = q . k + qv . v, out [B, Sq, Hq, Dv]. Dv <= 512, 16-bit or FP8 caches
    (k_scale for the rotary keys, v_scale for the latent), at most 16 query tokens per sequence; k, v append rotary rows
    and latent rows. The default softmax_scale is 1 / sqrt(D + Dv) (FA3's).
    FA3's FP8 call: q (float8_e4m3fn, or 16-bit) over float8_e4m3fn caches with q_descale / k_descale / v_descale
    (fp32 [B, Hkv], FA3's names; absent: 1), so K = k_descale[b, h] * k_cache for sequence b and KV head h; out is
    bfloat16 (q's dtype when 16-bit). Runs as the FP8-cache call above with q exact in bfloat16 and q_descale folded
    into the keys' scale; appends (k, v) and qv take tileflash's k_scale / v_scale instead. e4m3 new k, v over an e4m3
    cache (FA3's) are appended as stored (their values at the cache's scale).
    FA3's rotary_seqlens [B] int32 (with the rotary tables and k, v; padded q and k): the rotary positions start at
    rotary_seqlens[b] instead of cache_seqlens[b] (q and the new k rotated by torch ops before the launch, in fp32 and
    rounded once; the cache positions stay cache_seqlens + i). Ignored, as FA3 ignores it, without rotary tables, and
    when it is cache_seqlens itself (the default positions).
    FA3's scheduling arguments (scheduler_metadata, pack_gqa, sm_margin) are accepted and leave the result as it is
    (tileflash plans its own schedule, cached per call signature: decode_plan for engines). FA3's attention_chunk
    c > 0 (Llama 4's chunked attention): a query at key position p sees only keys in [floor(p / c) * c, + c),
    intersected with causal / the window, on the Triton decode kernel (masks.visible's chunks).
    Returns out [B, Sq, Hq, D], and with return_softmax_lse=True (or return_lse=True) (out, lse [B, Hq, Sq] fp32).
    """
    return_lse = bool(return_lse or return_softmax_lse)
    if pack_gqa is not None or sm_margin:
        _utils.check_fa3_tail(num_splits, pack_gqa, sm_margin)
    if q_descale is not None or k_descale is not None or v_descale is not None or \
            getattr(q, "dtype", None) == torch.float8_e4m3fn:
        q, k_scale, v_scale = _fa3_fp8(q, k_cache, k_scale, v_scale, q_descale, k_descale, v_descale)
    if getattr(k, "dtype", None) == torch.float8_e4m3fn and k_cache.dtype == torch.float8_e4m3fn \
            and isinstance(q, torch.Tensor):
        k, v = (_widened(x, s, q.dtype) for x, s in ((k, k_scale), (v, v_scale)))
    if getattr(rotary_cos, "dtype", None) == torch.float8_e4m3fn and isinstance(rotary_sin, torch.Tensor):
        rotary_cos, rotary_sin = rotary_cos.float(), rotary_sin.float()  # FA3's tables in an e4m3 q's dtype: exact
    if rotary_seqlens is not None and (rotary_cos is None or rotary_seqlens is cache_seqlens):
        rotary_seqlens = None  # FA3 reads them only with the rotary tables; cache_seqlens' are the default positions
    if rotary_seqlens is not None:
        q, k = _rotate_from(rotary_seqlens, q, k, rotary_cos, rotary_sin, rotary_interleaved,
                            causal or _utils.check_window(window_size) != (-1, -1), cu_seqlens_q, cu_seqlens_k_new,
                            validate)
        rotary_cos = rotary_sin = None
    block_table = _block_table(block_table, page_table)
    if block_table is not None and cache_batch_idx is not None:
        block_table, cache_batch_idx = _table_rows(block_table, cache_batch_idx, validate), None
    if cu_seqlens_q is not None and isinstance(q, torch.Tensor) and q.dim() == 3 and isinstance(max_seqlen_q, int) \
            and cu_seqlens_q.dim() == 1 and 0 < max_seqlen_q and q.shape[0] == (len(cu_seqlens_q) - 1) * max_seqlen_q \
            and _equal_counts(cu_seqlens_q, max_seqlen_q, validate):
        # Every sequence holds exactly max_seqlen_q queries: the padded call, with its decode tiles and splits.
        total_q, hq = q.shape[:2]
        padded = lambda t: t if t is None else t.view(-1, max_seqlen_q, hq, t.shape[-1])  # noqa: E731
        res = _kvcache(padded(q), k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                       cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                       window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, return_lse, None, None,
                       cu_seqlens_k_new, sp_overlap, validate, k_scale, v_scale, k_global_scale, v_global_scale,
                       learnable_sink, padded(qv) if isinstance(qv, torch.Tensor) and qv.dim() == 3 else qv,
                       attention_chunk)
        if not return_lse:
            return res.view(total_q, hq, res.shape[-1])
        out, lse = res
        return out.view(total_q, hq, out.shape[-1]), lse.transpose(0, 1).reshape(hq, total_q)
    return _kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                    num_splits, return_lse, cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new, sp_overlap, validate,
                    k_scale, v_scale, k_global_scale, v_global_scale, learnable_sink, qv, attention_chunk)


def _table_rows(block_table, cache_batch_idx, validate: bool):
    """FA3's cache_batch_idx over a paged cache: sequence b reads the pages of block_table row cache_batch_idx[b],
    gathered here before the launch. Rows outside the table raise where reading them costs no sync (CPU tensors) or
    on request (validate=True); otherwise they are clamped into it, so no launch reads past the table."""
    _utils.check_int32("block_table", block_table, 2, block_table.device)
    _utils.check_int32("cache_batch_idx", cache_batch_idx, 1, block_table.device)
    rows = block_table.shape[0]
    if (validate or cache_batch_idx.device.type == "cpu") and cache_batch_idx.numel():
        lo, hi = int(cache_batch_idx.min()), int(cache_batch_idx.max())
        if lo < 0 or hi >= rows:
            raise ValueError(f"cache_batch_idx: expected values in [0, {rows}) (block_table rows), got min {lo}, "
                             f"max {hi}")
        return block_table.index_select(0, cache_batch_idx)
    return block_table.index_select(0, cache_batch_idx.clamp(0, max(rows - 1, 0)))


def _equal_counts(cu_seqlens_q, max_seqlen_q: int, validate: bool) -> bool:
    """Whether every packed sequence holds max_seqlen_q queries, for a q of exactly batch * max_seqlen_q rows (then
    the call runs as the padded one, with decode tiles and splits). Read where it costs no sync (CPU tensors) or on
    request (validate=True); otherwise the caller's contract (flash_attn_with_kvcache's docstring)."""
    if not (validate or cu_seqlens_q.device.type == "cpu") or cu_seqlens_q.dtype != torch.int32:
        return True
    steps = torch.arange(cu_seqlens_q.shape[0], dtype=torch.int32, device=cu_seqlens_q.device) * max_seqlen_q
    return bool(torch.equal(cu_seqlens_q, steps))


def _widened(x8, scale, dtype):
    """FA3's e4m3 new keys / values for an e4m3 cache, in q's 16-bit dtype: x8 * scale, which the append's
    quantization (x / scale, rounded to e4m3) stores as x8's own bytes. Per-tensor or per-head scales ([1] / [Hkv];
    appends refuse FA3's per-sequence ones), 1 where absent."""
    if not isinstance(x8, torch.Tensor) or not isinstance(scale, torch.Tensor) or scale.dim() != 1:
        return x8  # the call's checks say what is wrong
    return (x8.float() * (scale[:, None] if scale.numel() > 1 else scale)).to(dtype)


def _fa3_fp8(q, k_cache, k_scale, v_scale, q_descale, k_descale, v_descale):
    """FA3's FP8 KV-cache call as tileflash's: (q in bfloat16, the keys' scale with q_descale folded in, the values'
    scale). e4m3 values are exact in bfloat16, and the scores' scale q_descale * k_descale is what the kernel
    multiplies the dots by either way."""
    if k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q_descale, k_descale, v_descale, an e4m3 q: FA3's FP8 call needs float8_e4m3fn caches, got "
                         f"{k_cache.dtype}")
    if k_descale is not None or v_descale is not None:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale, v_scale / k_descale, v_descale: pass the cache's scales one way, tileflash's "
                             "([1] or [Hkv]) or FA3's ([batch, Hkv] descales)")
        k_scale, v_scale = k_descale, v_descale
    one = unit_scale(k_cache.device)
    k_scale, v_scale = (t if t is not None else one for t in (k_scale, v_scale))
    if q_descale is not None:
        _utils.check_tensor("q_descale", q_descale, ndim=2, dtypes=(torch.float32,), device=k_cache.device)
        if k_scale.dim() == 2 and k_scale.shape != q_descale.shape:
            raise ValueError(f"q_descale, k_descale: expected equal shapes ([batch, Hkv]), got "
                             f"{tuple(q_descale.shape)} and {tuple(k_scale.shape)}")
        k_scale = q_descale * k_scale  # [B, Hkv] (the batch and head counts are checked with the call)
    if k_scale.shape != v_scale.shape:  # one [B, Hkv], the other 1: the same shape, the kernel reads stride 0
        k_scale, v_scale = torch.broadcast_tensors(k_scale, v_scale)
    if q.dtype == torch.float8_e4m3fn:
        q = q.to(torch.bfloat16)
    return q, k_scale, v_scale


def _rotate_from(rotary_seqlens, q, k, rotary_cos, rotary_sin, interleaved: bool, per_token: bool, cu_seqlens_q,
                 cu_seqlens_k_new, validate: bool):
    """(q, k) rotated at positions rotary_seqlens[b] + i (q at rotary_seqlens[b] for every token unless per_token),
    as the kernels rotate at cache_seqlens[b] + i: fp32, rounded once; positions past the table take its last row."""
    if rotary_cos is None or k is None:
        raise ValueError("rotary_seqlens: the rotary positions of q and the new k; pass rotary_cos, rotary_sin, k "
                         "and v")
    if cu_seqlens_q is not None or cu_seqlens_k_new is not None:
        raise NotImplementedError("rotary_seqlens: with padded q and k (not with cu_seqlens_q / cu_seqlens_k_new)")
    _utils.check_int32("rotary_seqlens", rotary_seqlens, 1, q.device)
    if rotary_seqlens.shape[0] != q.shape[0]:
        raise ValueError(f"rotary_seqlens: expected {q.shape[0]} elements (q's batch), got {rotary_seqlens.shape[0]}")
    if (validate or q.device.type == "cpu") and rotary_seqlens.numel() and int(rotary_seqlens.min()) < 0:
        raise ValueError(f"rotary_seqlens: expected values >= 0, got min {int(rotary_seqlens.min())}")
    for name, t in (("k", k), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _utils.check_tensor(name, t, device=q.device)
    if rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape or not 0 < 2 * rotary_cos.shape[1] <= q.shape[-1]:
        raise ValueError(f"rotary_cos, rotary_sin: expected equal shapes [seqlen_ro, rotary_dim / 2] with "
                         f"rotary_dim <= {q.shape[-1]}, got {tuple(rotary_cos.shape)} / {tuple(rotary_sin.shape)}")
    base = rotary_seqlens.long()[:, None]
    last = rotary_cos.shape[0] - 1

    def rotate(x, offsets):
        pos = (base + offsets.to(x.device)).clamp(0, last)  # [B, S]
        c, s_ = (t[pos].float()[:, :, None, :] for t in (rotary_cos, rotary_sin))  # [B, S, 1, rotary_dim / 2]
        r = 2 * rotary_cos.shape[1]
        xr = x[..., :r].float()
        if interleaved:  # GPT-J pairs (2i, 2i + 1)
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            rot = torch.stack((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1).flatten(-2)
        else:  # GPT-NeoX pairs (i, i + rotary_dim / 2)
            x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
            rot = torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1)
        return torch.cat((rot.to(x.dtype), x[..., r:]), dim=-1)

    sq = q.shape[1]
    q_offsets = torch.arange(sq) if per_token else torch.zeros(sq, dtype=torch.long)
    return rotate(q, q_offsets), rotate(k, torch.arange(k.shape[1]))


def _kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
             block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
             return_lse, cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new, sp_overlap, validate, k_scale, v_scale,
             k_global_scale, v_global_scale, learnable_sink, qv=None, attention_chunk=0):
    """flash_attn_with_kvcache without its argument aliases: plan (cached per signature) and run."""
    scales = (k_scale, v_scale, k_global_scale, v_global_scale)
    if cache_seqlens is None and k is None and isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4 and \
            (block_table is None or isinstance(block_table, torch.Tensor) and block_table.dim() == 2):
        cache_seqlens = cache_capacity(k_cache, block_table)  # flash-attn 2.x: without new keys, the whole cache
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool) and isinstance(q, torch.Tensor):
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    index = (cache_seqlens, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, cu_seqlens_q,
             alibi_slopes, cu_seqlens_k_new, learnable_sink)
    if torch.compiler.is_compiling():
        capacity, s_new = _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits,
                                         *scales, *index[2:7], max_seqlen_q, alibi_slopes, cu_seqlens_k_new,
                                         learnable_sink, qv)
        if qv is not None and sp_overlap:
            raise ValueError("sp_overlap: not with qv (MLA takes the plain loop)")
        if validate:
            _validate_values(k_cache, cache_seqlens, block_table, capacity, s_new, cache_batch_idx, cache_leftpad,
                             cu_seqlens_k_new)
        left, right = _utils.check_window(window_size)
        mask = Mask.make(causal, (left, right), check_softcap(softcap), _utils.check_attention_chunk(attention_chunk))
        packed_max = max(int(max_seqlen_q), 1) if cu_seqlens_q is not None else 0
        out, lse = _attn_kvcache_op(q, k_cache, v_cache, k, v, cache_seqlens.contiguous(), *index[1:], packed_max,
                                    bool(rotary_interleaved), _utils.default_scale(softmax_scale, q, qv),
                                    mask.window_left, mask.window_right, mask.softcap, int(num_splits),
                                    bool(sp_overlap), *scales, qv, mask.chunk)
        return (out, lse) if return_lse else out
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() == 1 and cache_seqlens.stride(0) != 1:
        cache_seqlens = cache_seqlens.contiguous()  # read with unit stride by the kernels
        index = (cache_seqlens, *index[1:])
    key = direct.tensor_key
    plan = direct.plan_for(  # (index[2:]: the extras a plain decode call leaves out; ~1 us less key work, CPU)
        _PLANS, lambda: (key(q), key(k_cache), key(v_cache), key(k), key(v), key(cache_seqlens), key(index[1]),
                         direct.optional_keys(*index[2:], *scales, qv), softmax_scale, causal,
                         direct.window_key(window_size), softcap, rotary_interleaved, num_splits, return_lse,
                         sp_overlap, validate, max_seqlen_q, attention_chunk),
        lambda: _make_plan(q, k_cache, v_cache, k, v, index, softmax_scale, causal, window_size, softcap,
                           rotary_interleaved, num_splits, return_lse, sp_overlap, validate, scales, max_seqlen_q,
                           qv, attention_chunk))
    return plan._run(q, k_cache, v_cache, k, v, index, scales, qv=qv)
