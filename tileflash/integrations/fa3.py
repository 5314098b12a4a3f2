"""FA3's `flash_attn_interface` module (flash-attn's hopper/ build) on tileflash: its attention functions with its
exact signatures, argument order and conventions (`qv` sixth in flash_attn_with_kvcache, seqused_q / seqused_k right
after max_seqlen_k in flash_attn_varlen_func; inputs whose last dim is strided are copied; descales are read for
e4m3 inputs only; flash_attn_with_kvcache's return_softmax_lse gives (out, lse, out_accum, lse_accum), the last two
empty here). tileflash.integrations.flash_attn.install() makes `import flash_attn_interface` (and
`flash_attn_3.flash_attn_interface`) resolve here. Its scheduling hints (num_splits, pack_gqa, sm_margin,
scheduler_metadata) are accepted and leave results as they are (docs/api.md); get_scheduler_metadata returns None,
which flash_attn_with_kvcache takes."""
from __future__ import annotations

import torch

from .. import _utils
from ..launch.forward import launch_combine
from ..ops import kvcache, packed, prefill
from .fa2 import maybe_contiguous

__all__ = ["flash_attn_combine", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache", "get_scheduler_metadata"]
FP8 = torch.float8_e4m3fn


def _descales(x, *descales):
    """FA3 reads q/k/v descales for e4m3 inputs only: None for others."""
    return descales if x is not None and x.dtype == FP8 else (None,) * len(descales)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_func: out, or (out, softmax_lse) with return_attn_probs."""
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    q_descale, k_descale, v_descale = _descales(q, q_descale, k_descale, v_descale)
    return prefill.flash_attn_func(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        deterministic=deterministic, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        return_attn_probs=return_attn_probs, num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin,
        attention_chunk=attention_chunk, qv=qv)


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                              window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_qkvpacked_func: qkv [B, S, 3, H, D], or [B, S, Hq + 2 Hkv, D] with num_heads_q (a fused
    GQA projection); views of it, so gradients flow into qkv."""
    if num_heads_q is None:
        packed._check_packed("qkv", qkv, 5, 2, 3)  # flash-attn 2.x's [B, S, 3, H, D] form
        q, k, v = qkv.unbind(2)
    else:
        if qkv.dim() != 4 or (qkv.shape[2] - num_heads_q) % 2 or qkv.shape[2] <= num_heads_q:
            raise ValueError(f"qkv: expected [B, S, num_heads_q + 2 Hkv, D] with num_heads_q={num_heads_q}, got shape "
                             f"{tuple(qkv.shape)}")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k, v = qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=2)
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_varlen_func: out, or (out, softmax_lse) with return_attn_probs."""
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    q_descale, k_descale, v_descale = _descales(q, q_descale, k_descale, v_descale)
    return prefill.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        deterministic=deterministic, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        return_attn_probs=return_attn_probs, num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin,
        attention_chunk=attention_chunk, qv=qv, seqused_q=seqused_q)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """FA3's flash_attn_with_kvcache: out, or (out, softmax_lse, out_accum, softmax_lse_accum) with
    return_softmax_lse (tileflash's split partials live in its workspace: the last two are empty). Descales apply
    to e4m3 caches (tileflash also takes a 16-bit q over them)."""
    q, k, v, qv = (maybe_contiguous(x) for x in (q, k, v, qv))
    q_descale, k_descale, v_descale = _descales(k_cache, q_descale, k_descale, v_descale)
    result = kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved, num_splits=num_splits,
        return_softmax_lse=return_softmax_lse, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, cu_seqlens_k_new=cu_seqlens_k_new, qv=qv, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, rotary_seqlens=rotary_seqlens, attention_chunk=attention_chunk,
        scheduler_metadata=scheduler_metadata, pack_gqa=pack_gqa, sm_margin=sm_margin)
    if not return_softmax_lse:
        return result
    out, lse = result
    return out, lse, out.new_empty(0), lse.new_empty(0)


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
                           qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
                           cache_leftpad=None, page_size=None, max_seqlen_k_new=0, causal=False, window_size=(-1, -1),
                           attention_chunk=0, has_softcap=False, num_splits=0, pack_gqa=None, sm_margin=0):
    """FA3's precomputed schedule for flash_attn_with_kvcache: None, since tileflash plans each call signature once
    and keeps it (tileflash.decode_plan is the explicit form)."""
    return None


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FA3's split-KV merge: out_partial fp32 [splits, B, S, H, D] and lse_partial fp32 [splits, B, S, H] (natural
    log, -inf for an empty split) -> (out [B, S, H, D] in out_dtype, fp32 by default, or into out; lse [B, S, H]),
    by tileflash's combine kernel (kernels/triton/combine.py)."""
    _utils.check_tensor("out_partial", out_partial, ndim=5, dtypes=(torch.float32,))
    splits, b, s, h, d = out_partial.shape
    _utils.check_tensor("lse_partial", lse_partial, ndim=4, dtypes=(torch.float32,), device=out_partial.device)
    if tuple(lse_partial.shape) != (splits, b, s, h):
        raise ValueError(f"lse_partial: expected shape {(splits, b, s, h)}, got {tuple(lse_partial.shape)}")
    if splits < 1:
        raise ValueError("out_partial: expected at least one split")
    out_dtype = out_dtype or (out.dtype if out is not None else torch.float32)
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype: expected float32, float16 or bfloat16, got {out_dtype}")
    if out is None:
        out = torch.empty(b, s, h, d, dtype=out_dtype, device=out_partial.device)
    else:
        _utils.check_tensor("out", out, ndim=4, dtypes=(out_dtype,), device=out_partial.device)
        _utils.check_last_dim_contiguous("out", out)
        if tuple(out.shape) != (b, s, h, d):
            raise ValueError(f"out: expected shape {(b, s, h, d)}, got {tuple(out.shape)}")
    lse = torch.empty(b, h, s, dtype=torch.float32, device=out_partial.device)
    if out.numel():
        launch_combine(out_partial.contiguous().view(splits, b * s * h, d),
                       lse_partial.contiguous().view(splits, b * s * h), out, lse)
    return out, lse.transpose(1, 2)

