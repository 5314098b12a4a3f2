"""flash-attn 2.x's `flash_attn` module on tileflash: its public functions with its exact signatures, argument order
and conventions (`dropout_p` fourth in flash_attn_func, after max_seqlen_k in flash_attn_varlen_func; inputs whose
last dim is strided are copied, as flash-attn does; the lse of a row that sees no key is +inf, 2.x's value, where
tileflash's own API returns -inf; `return_attn_probs=True` returns (out, softmax_lse, S_dmask) with S_dmask an empty
tensor: flash-attn computes the probabilities only with dropout, for its tests, and tileflash never does).
tileflash.integrations.flash_attn.install() makes `import flash_attn` (and `flash_attn.flash_attn_interface`)
resolve here, so 2.x code runs unchanged, positional arguments included. flash-attn 2.8's lower-level functions
that ring-attention libraries call (_flash_attn_forward, _flash_attn_backward and their varlen forms: no autograd,
gradients written into the caller's dq, dk, dv, the dropout seed handed over as rng_state) are here in 2.8's
signatures; their S_dmask is empty and their softmax_d unpadded."""
from __future__ import annotations

import functools

import torch

from .. import _utils
from ..launch.backward import attn_backward
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


def _private_call_checks(q, dropout_p, name: str, rng_state=False) -> float:
    """dropout_p as a float; rng_state (backward calls): the forward's seed, required with dropout."""
    if q.dtype not in _utils.SUPPORTED_DTYPES:
        raise ValueError(f"{name}: q: expected float16 or bfloat16 (flash-attn 2.x's dtypes), got {q.dtype}")
    dropout_p = _utils.check_dropout(dropout_p) if dropout_p else 0.0
    if dropout_p and rng_state is None:
        raise ValueError(f"{name}: rng_state: required with dropout_p > 0 (the one the forward returned)")
    return dropout_p


def _forward_result(q, out, lse, rng):
    """2.8's (out, softmax_lse, S_dmask, rng_state); rng_state: the dropout seed, or an unused [2] int64."""
    return (out, _lse_2x(lse), q.new_empty(0),
            rng if rng is not None else torch.zeros(2, dtype=torch.int64, device=q.device))


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax):
    """flash-attn 2.8's _flash_attn_forward (no autograd): (out, softmax_lse, S_dmask, rng_state)."""
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    dropout_p = _private_call_checks(q, dropout_p, "_flash_attn_forward")
    mask, scale = prefill._checked_dense(q, k, v, softmax_scale, causal, (window_size_left, window_size_right),
                                         softcap, alibi_slopes, None)
    rng = _utils.dropout_seed(q.device) if dropout_p else None
    out, lse = prefill._attn_fwd_impl(q, k, v, scale, mask.window_left, mask.window_right, mask.softcap, False,
                                      alibi_slopes, None, dropout_p, rng)
    return _forward_result(q, out, lse, rng)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None):
    """flash-attn 2.8's _flash_attn_varlen_forward (no autograd; packed keys: block_table and leftpad_k are
    refused, flash_attn_varlen_func takes page pools): (out, softmax_lse, S_dmask, rng_state)."""
    if block_table is not None or leftpad_k is not None:
        raise ValueError("_flash_attn_varlen_forward: block_table and leftpad_k are not supported here; call "
                         "flash_attn_varlen_func for paged keys")
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    dropout_p = _private_call_checks(q, dropout_p, "_flash_attn_varlen_forward")
    mask, scale = prefill._checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, None, max_seqlen_q,
                                          max_seqlen_k, softmax_scale, causal, (window_size_left, window_size_right),
                                          softcap, alibi_slopes, None)
    rng = _utils.dropout_seed(q.device) if dropout_p else None
    out, lse = prefill._attn_varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q),
                                             int(max_seqlen_k), scale, mask.window_left, mask.window_right,
                                             mask.softcap, False, alibi_slopes, None, dropout_p, rng)
    return _forward_result(q, out, lse, rng)


def _backward_into(dq, dk, dv, grads, dout, out, lse_layout):
    """Write the gradients into the caller's buffers (those given) and return softmax_d = rowsum(dout * out) in the
    lse's layout ([B, H, S] or [H, total])."""
    for buf, g in zip((dq, dk, dv), grads):
        if buf is not None:
            buf.copy_(g)
    d = (dout.float() * out.float()).sum(-1)
    return d.transpose(1, 2) if lse_layout == 3 else d.transpose(0, 1)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """flash-attn 2.8's _flash_attn_backward: dq, dk, dv written into the given buffers; returns softmax_d.
    softmax_lse and rng_state as _flash_attn_forward returned them (an lse merged across calls, e.g. by ring
    attention, works too)."""
    dout, q, k, v, out = (maybe_contiguous(x) for x in (dout, q, k, v, out))
    dropout_p = _private_call_checks(q, dropout_p, "_flash_attn_backward", rng_state)
    mask, scale = prefill._checked_dense(q, k, v, softmax_scale, causal, (window_size_left, window_size_right),
                                         softcap, alibi_slopes, None)
    grads = attn_backward(q, k, v, out, softmax_lse, dout, None, None, None, None, 0, 0, scale, mask.window_left,
                          mask.window_right, mask.softcap, bool(deterministic), alibi_slopes, None, dropout_p,
                          rng_state if dropout_p else None)
    return _backward_into(dq, dk, dv, grads[:3], dout, out, 3)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """flash-attn 2.8's _flash_attn_varlen_backward: as _flash_attn_backward, for packed sequences."""
    dout, q, k, v, out = (maybe_contiguous(x) for x in (dout, q, k, v, out))
    dropout_p = _private_call_checks(q, dropout_p, "_flash_attn_varlen_backward", rng_state)
    mask, scale = prefill._checked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, max_seqlen_q,
                                          max_seqlen_k, softmax_scale, causal, (window_size_left, window_size_right),
                                          softcap, alibi_slopes, None)
    grads = attn_backward(q, k, v, out, softmax_lse, dout, None, cu_seqlens_q, cu_seqlens_k, None, int(max_seqlen_q),
                          int(max_seqlen_k), scale, mask.window_left, mask.window_right, mask.softcap,
                          bool(deterministic), alibi_slopes, None, dropout_p, rng_state if dropout_p else None)
    return _backward_into(dq, dk, dv, grads[:3], dout, out, 2)

