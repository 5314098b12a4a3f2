"""FA3's `flash_attn_interface` module (flash-attn's hopper/ build) on tileflash: its three attention functions with
its exact signatures and argument order (`qv` sixth in flash_attn_with_kvcache, seqused_q / seqused_k right after
max_seqlen_k in flash_attn_varlen_func). tileflash.integrations.flash_attn.install() makes `import
flash_attn_interface` resolve here. Its scheduling hints (num_splits, pack_gqa, sm_margin, scheduler_metadata) are
accepted and leave results as they are (docs/api.md)."""
from __future__ import annotations

from ..ops import kvcache, prefill

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_func: out, or (out, softmax_lse) with return_attn_probs."""
    return prefill.flash_attn_func(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        deterministic=deterministic, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        return_attn_probs=return_attn_probs, num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin,
        attention_chunk=attention_chunk, qv=qv)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_varlen_func: out, or (out, softmax_lse) with return_attn_probs."""
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
    """FA3's flash_attn_with_kvcache: out, or (out, softmax_lse) with return_softmax_lse."""
    return kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved, num_splits=num_splits,
        return_softmax_lse=return_softmax_lse, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, cu_seqlens_k_new=cu_seqlens_k_new, qv=qv, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, rotary_seqlens=rotary_seqlens, attention_chunk=attention_chunk,
        scheduler_metadata=scheduler_metadata, pack_gqa=pack_gqa, sm_margin=sm_margin)
