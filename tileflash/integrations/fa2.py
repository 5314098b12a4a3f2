"""flash-attn 2.x's `flash_attn` module on tileflash: its functions with its exact signatures and argument order
(`dropout_p` fourth in flash_attn_func, after max_seqlen_k in flash_attn_varlen_func; `return_attn_probs=True`
returns (out, softmax_lse, None): flash-attn's third value, the probabilities, is only computed there with dropout
and only for tests). tileflash.integrations.flash_attn.install() makes `import flash_attn` (and
`flash_attn.flash_attn_interface`) resolve here, so 2.x code runs unchanged, positional arguments included."""
from __future__ import annotations

import torch

from ..ops.kvcache import flash_attn_with_kvcache
from ..ops.packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                          flash_attn_varlen_qkvpacked_func)
from ..ops import prefill

__version__ = "2.8.3+tileflash"  # the 2.x API emulated: bottom-right causal, softcap, window_size, block_table

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def _with_probs(result, return_attn_probs: bool):
    return (*result, None) if return_attn_probs else result


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2.x's flash_attn_func: tileflash.flash_attn_func (docs/api.md) in 2.x's argument order."""
    return _with_probs(prefill.flash_attn_func(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        return_lse=return_attn_probs, deterministic=deterministic, dropout_p=dropout_p, alibi_slopes=alibi_slopes),
        return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2.x's flash_attn_varlen_func: tileflash.flash_attn_varlen_func in 2.x's argument order. With
    block_table (k, v page pools), 2.x's cu_seqlens_k holds the keys of each sequence (cumulative), which tileflash
    takes as seqused_k."""
    seqused_k = None
    if block_table is not None and isinstance(cu_seqlens_k, torch.Tensor):
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    return _with_probs(prefill.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, return_lse=return_attn_probs,
        deterministic=deterministic, block_table=block_table, dropout_p=dropout_p, alibi_slopes=alibi_slopes),
        return_attn_probs)
