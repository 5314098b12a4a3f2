"""flash-attn 2.x's `flash_attn` module on tileflash: its public functions with its exact signatures, argument order
and conventions (`dropout_p` fourth in flash_attn_func, after max_seqlen_k in flash_attn_varlen_func; inputs whose
last dim is strided are copied, as flash-attn does; the lse of a row that sees no key is +inf, 2.x's value, where
tileflash's own API returns -inf; `return_attn_probs=True` returns (out, softmax_lse, S_dmask): with dropout,
S_dmask is 2.x's testing output, the probabilities as its kernel held them with the dropped ones negative
(_attn_probs_2x, computed in torch from the call's own dropout pattern), else an empty tensor, as flash-attn computes
them only with dropout).
tileflash.integrations.flash_attn.install() makes `import flash_attn` (and `flash_attn.flash_attn_interface`)
resolve here, so 2.x code runs unchanged, positional arguments included. flash-attn 2.8's lower-level functions
that ring-attention libraries call (_flash_attn_forward, _flash_attn_backward and their varlen forms: no autograd,
gradients written into the caller's dq, dk, dv, the dropout seed handed over as rng_state) are here in 2.8's
signatures; their S_dmask is the public functions' (with return_softmax) and their softmax_d unpadded."""
from __future__ import annotations

import functools
import inspect

import torch

from .. import _utils, reference
from ..launch.backward import attn_backward
from ..ops import kvcache, packed, prefill

__version__ = "2.8.3"  # the 2.x API emulated (bottom-right causal, softcap, window_size, block_table)
USE_TRITON_ROCM = False  # 2.8's flash_attn_interface name (its tests import it)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def maybe_contiguous(x):
    """flash-attn's: x, or a contiguous copy when its last dim is strided."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _lse_2x(lse):
    """2.x's lse: +inf (not -inf) for a row that sees no key."""
    return torch.where(lse == float("-inf"), float("inf"), lse)


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """flash-attn 2.x's key-block size of its forward kernel (its tests import this to read S_dmask: the running row
    max restarts its value per block). CPU tensors count as sm_90."""
    if head_dim > 256:
        raise ValueError(f"_get_block_size_n: head_dim {head_dim} > 256")
    major, minor = torch.cuda.get_device_capability(device) if torch.device(device).type == "cuda" else (9, 0)
    sm8x = major == 8 and minor > 0  # sm86 / sm89, not the A100's sm80
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 64 if not is_dropout and (is_causal or not sm8x) else 32
    if head_dim <= 160:
        return 64 if sm8x else 32
    return 64


def _next_dropout_seed(device: torch.device) -> int:
    """The seed the next dropout call on device draws (_utils.dropout_seed), read without consuming it."""
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    seed = int(_utils.dropout_seed(device))
    torch.cuda.set_rng_state(state, device) if cuda else torch.set_rng_state(state)
    return seed


def _attn_probs_2x(seed: int, a: dict, q, k, cu_seqlens_q=None, cu_seqlens_k=None):
    """2.x's S_dmask [B, Hq, Sq, Sk] (lengths rounded up to 128; varlen: the max lengths, each sequence from row and
    column 0) in q's dtype: exp(s - m_j), m_j the row max over key block j and every block after it (2.x's forward
    walks key blocks from the last, _get_block_size_n keys each), negative where dropout dropped it (a dropped 0 as
    the smallest negative value); 0 where not visible. a: the call's arguments."""
    dropout_p, causal = float(a["dropout_p"]), bool(a["causal"])
    window = tuple(int(w) for w in a["window_size"])
    alibi = a["alibi_slopes"]
    block_n = _get_block_size_n(q.device, q.shape[-1], True, causal)
    if cu_seqlens_q is None:
        seqs = [(q[b], k[b]) for b in range(q.shape[0])]
        max_q, max_k = q.shape[1], k.shape[1]
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        used = a.get("seqused_k")
        ends = [ck[b + 1] if used is None else min(ck[b + 1], ck[b] + int(used[b])) for b in range(len(cq) - 1)]
        seqs = [(q[cq[b]:cq[b + 1]], k[ck[b]:ends[b]]) for b in range(len(cq) - 1)]
        max_q = int(a.get("max_seqlen_q", a.get("max_seqlen")))
        max_k = int(a.get("max_seqlen_k", a.get("max_seqlen")))
    hq = q.shape[-2]
    probs = torch.zeros(len(seqs), hq, -(-max_q // 128) * 128, -(-max_k // 128) * 128, dtype=q.dtype,
                        device=q.device)
    tiny = torch.nextafter(torch.zeros((), dtype=q.dtype), torch.full((), -1.0, dtype=q.dtype)).to(q.device)
    for b, (qb, kb) in enumerate(seqs):
        sq, sk = qb.shape[0], kb.shape[0]
        if sq == 0 or sk == 0:
            continue
        slopes = None if alibi is None else alibi if alibi.dim() == 1 else alibi[b]
        s = reference.scores_ref(qb[None].detach().float(), kb[None].detach().float(), a["softmax_scale"], causal,
                                 window, float(a["softcap"]), slopes)[0]
        seen = reference.visible_mask(sq, sk, causal, window, device=q.device)
        block_max = torch.stack([blk.amax(-1) for blk in s.split(block_n, dim=-1)], dim=-1)
        m = block_max.flip(-1).cummax(-1).values.flip(-1).repeat_interleave(block_n, dim=-1)[..., :sk]
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)).to(q.dtype)
        keep = reference.dropout_keep(seed, dropout_p, hq, sq, sk, [b], device=q.device)[0]
        p = torch.where(keep | ~seen, p, torch.where(p > 0, -p, tiny))
        probs[b, :, :sq, :sk] = p
    return probs


def _2x_results(inputs=None):
    """Decorator: fn's results in 2.x's conventions: a tuple's lse (second) as _lse_2x, its S_dmask (a None third)
    _attn_probs_2x's of the tensors inputs(arguments) picks (q, k[, cu_seqlens_q, cu_seqlens_k]) when the call ran
    dropout, else empty."""
    def decorate(fn):
        signature = inspect.signature(fn)
        position = {name: i for i, name in enumerate(signature.parameters)}

        def given(args, kwargs, name):  # without binding every call's arguments (host time)
            i = position.get(name, len(args))
            return kwargs.get(name, args[i] if i < len(args) else None)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            seed = None
            if inputs is not None and given(args, kwargs, "return_attn_probs") and given(args, kwargs, "dropout_p"):
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                seed = _next_dropout_seed(inputs(a)[0].device)
            result = fn(*args, **kwargs)
            if not isinstance(result, tuple):
                return result
            out, lse, *rest = result
            if rest and seed is not None:
                rest = [_attn_probs_2x(seed, a, *inputs(a))]
            return (out, _lse_2x(lse), *(out.new_empty(0) if r is None else r for r in rest))
        return wrapped
    return decorate


@_2x_results(lambda a: (a["q"], a["k"]))
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2.x's flash_attn_func: tileflash.flash_attn_func (docs/api.md) in 2.x's argument order."""
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    out = prefill.flash_attn_func(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        return_lse=return_attn_probs, deterministic=deterministic, dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    return (*out, None) if return_attn_probs else out


@_2x_results(lambda a: (a["q"], a["k"], a["cu_seqlens_q"], a["cu_seqlens_k"]))
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
def _qk_of_qkv(a):
    return a["qkv"].unbind(-3)[:2]


def _qk_of_kv(a):
    return a["q"], a["kv"].unbind(-3)[0]


flash_attn_qkvpacked_func = _2x_results(_qk_of_qkv)(packed.flash_attn_qkvpacked_func)
flash_attn_kvpacked_func = _2x_results(_qk_of_kv)(packed.flash_attn_kvpacked_func)
flash_attn_varlen_qkvpacked_func = _2x_results(lambda a: (*_qk_of_qkv(a), a["cu_seqlens"], a["cu_seqlens"]))(
    packed.flash_attn_varlen_qkvpacked_func)
flash_attn_varlen_kvpacked_func = _2x_results(lambda a: (*_qk_of_kv(a), a["cu_seqlens_q"], a["cu_seqlens_k"]))(
    packed.flash_attn_varlen_kvpacked_func)


@_2x_results()
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


def _forward_result(q, k, out, lse, rng, return_softmax, args, cu_seqlens=()):
    """2.8's (out, softmax_lse, S_dmask, rng_state); S_dmask _attn_probs_2x's with return_softmax and dropout (args:
    its call arguments), else empty; rng_state: the dropout seed, or an unused [2] int64."""
    probs = _attn_probs_2x(int(rng), args, q, k, *cu_seqlens) if return_softmax and rng is not None else q.new_empty(0)
    return (out, _lse_2x(lse), probs,
            rng if rng is not None else torch.zeros(2, dtype=torch.int64, device=q.device))


def _args(dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, **lengths):
    """The private forwards' arguments under the names _attn_probs_2x reads."""
    return dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, softcap=softcap,
                window_size=(window_size_left, window_size_right), alibi_slopes=alibi_slopes, **lengths)


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
    return _forward_result(q, k, out, lse, rng, return_softmax, _args(
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes))


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
    return _forward_result(q, k, out, lse, rng, return_softmax, _args(
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k), (cu_seqlens_q, cu_seqlens_k))


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

