"""flash-attn 2.x's packed entry points: q, k, v (or k, v) stacked in one tensor, as fused QKV projections produce
them. Each unbinds its views (no copy: the last dim stays contiguous, the other strides are free) and calls
flash_attn_func / flash_attn_varlen_func, so gradients flow into the packed tensor. Signatures are flash-attn
2.x's: dropout_p second (attention dropout, as in flash_attn_func); alibi_slopes as in flash_attn_func;
return_attn_probs=True returns (out, lse, None): flash-attn's third value, the probabilities with the dropout
pattern, is a debugging aid tileflash does not materialise. learnable_sink (FA4's
name, a trailing keyword) as in flash_attn_func.
"""
from __future__ import annotations

from .. import _utils
from .prefill import flash_attn_func, flash_attn_varlen_func


def _check_packed(name: str, t, ndim: int, dim: int, count: int) -> None:
    _utils.check_tensor(name, t, ndim=ndim)
    if t.shape[dim] != count:
        raise ValueError(f"{name}: expected {count} stacked tensors in dim {dim}, got shape {tuple(t.shape)}")


def _result(out, return_attn_probs: bool):
    return (*out, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              learnable_sink=None):
    """qkv [B, S, 3, H, D] -> out [B, S, H, D] (with return_attn_probs also lse [B, H, S] and None)."""
    _check_packed("qkv", qkv, 5, 2, 3)
    q, k, v = qkv.unbind(2)
    return _result(flash_attn_func(q, k, v, softmax_scale, causal, window_size, softcap,
                                   return_lse=return_attn_probs, deterministic=deterministic,
                                   dropout_p=dropout_p, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink),
                   return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             learnable_sink=None):
    """q [B, Sq, Hq, D], kv [B, Sk, 2, Hkv, D] -> out [B, Sq, Hq, D]."""
    _check_packed("kv", kv, 5, 2, 2)
    k, v = kv.unbind(2)
    return _result(flash_attn_func(q, k, v, softmax_scale, causal, window_size, softcap,
                                   return_lse=return_attn_probs, deterministic=deterministic,
                                   dropout_p=dropout_p, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink),
                   return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, learnable_sink=None):
    """qkv [total, 3, H, D] packed sequences (cu_seqlens int32 [batch + 1]) -> out [total, H, D]."""
    _check_packed("qkv", qkv, 4, 1, 3)
    q, k, v = qkv.unbind(1)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=softmax_scale,
                                 causal=causal, window_size=window_size, softcap=softcap,
                                 return_lse=return_attn_probs, deterministic=deterministic,
                                 dropout_p=dropout_p, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    return _result(out, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                    learnable_sink=None):
    """q [total_q, Hq, D], kv [total_k, 2, Hkv, D] -> out [total_q, Hq, D]."""
    _check_packed("kv", kv, 4, 1, 2)
    k, v = kv.unbind(1)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                                 return_lse=return_attn_probs, deterministic=deterministic,
                                 dropout_p=dropout_p, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)
    return _result(out, return_attn_probs)
