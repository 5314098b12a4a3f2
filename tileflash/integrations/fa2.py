"""flash-attn 2.x's `flash_attn` module on tileflash: its public functions with its exact signatures, argument order
and conventions (`dropout_p` fourth in flash_attn_func, after max_seqlen_k in flash_attn_varlen_func; inputs whose
last dim is strided are copied, as flash-attn does; the lse of a row that sees no key is +inf, 2.x's value, where
tileflash's own API returns -inf; `return_attn_probs=True` returns (out, softmax_lse, S_dmask) with S_dmask an empty
tensor: flash-attn computes the probabilities only with dropout, for its tests, and tileflash never does).
tileflash.integrations.flash_attn.install() makes `import flash_attn` (and `flash_attn.flash_attn_interface`)
resolve here, so 2.x code runs unchanged, positional arguments included. flash-attn's private functions
(_flash_attn_forward and the like, whose signatures change between releases) are not provided."""
from __future__ import annotations

import functools

import torch

from ..ops import kvcache, packed, prefill

__version__ = "2.8.3"  # the 2.x API emulated (bottom-right causal, softcap, window_size, block_table)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def maybe_contiguous(x):
    """flash-attn's: x, or a contiguous copy when its last dim is strided."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _lse_2x(lse):
    """2.x's lse: +inf (not -inf) for a row that sees no key."""
    return torch.where(lse == float("-inf"), float("inf"), lse)


def _2x_results(fn):
    """fn's results in 2.x's conventions: a tuple's lse (second) as _lse_2x, its S_dmask (a None third) empty."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        if not isinstance(result, tuple):
            return result
        out, lse, *rest = result
        return (out, _lse_2x(lse), *(out.new_empty(0) if r is None else r for r in rest))
    return wrapped


@_2x_results
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2.x's flash_attn_func: tileflash.flash_attn_func (docs/api.md) in 2.x's argument order."""
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    out = prefill.flash_attn_func(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        return_lse=return_attn_probs, deterministic=deterministic, dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    return (*out, None) if return_attn_probs else out


@_2x_results
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2.x's flash_attn_varlen_func: tileflash.flash_attn_varlen_func in 2.x's argument order. With
    block_table (k, v page pools), 2.x's cu_seqlens_k holds the keys of each sequence (cumulative), which tileflash
    takes as seqused_k."""
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    seqused_k = None
    if block_table is not None and isinstance(cu_seqlens_k, torch.Tensor):
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    out = prefill.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, return_lse=return_attn_probs,
        deterministic=deterministic, block_table=block_table, dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    return (*out, None) if return_attn_probs else out


# tileflash's own forms of these already take 2.x's signatures (ops/packed.py, ops/kvcache.py)
flash_attn_qkvpacked_func = _2x_results(packed.flash_attn_qkvpacked_func)
flash_attn_kvpacked_func = _2x_results(packed.flash_attn_kvpacked_func)
flash_attn_varlen_qkvpacked_func = _2x_results(packed.flash_attn_varlen_qkvpacked_func)
flash_attn_varlen_kvpacked_func = _2x_results(packed.flash_attn_varlen_kvpacked_func)


@_2x_results
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2.x's flash_attn_with_kvcache (q, k, v copied where their last dim is strided; the caches must
    have a contiguous last dim, as there)."""
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    return kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                           cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                           window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                           return_softmax_lse)
