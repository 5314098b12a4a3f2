"""Hugging Face transformers (5.x) backend: `register()` then `attn_implementation="tileflash"`.

transformers hands an attention function query [B, Hq, Sq, D] and key/value [B, Hkv, Sk, D] (the KV cache already
concatenated, so decoding queries sit at the end: tileflash's bottom-right causal alignment) and expects
[B, Sq, Hq, D] back. The mask function registered with it is transformers' own FlashAttention one, so the model
passes either no mask (nothing padded) or the 2-D padding mask, which is unpadded into a varlen call here.
Padding-free batches (cu_seq_lens_* keyword arguments from a flattening collator, or packed position_ids) go
straight to flash_attn_varlen_func.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.prefill import flash_attn_func, flash_attn_varlen_func

NAME = "tileflash"


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _unpad(x: torch.Tensor, mask: torch.Tensor):
    """x [B, S, H, D], mask [B, S] bool -> (x[mask] [total, H, D], flat indices, cu_seqlens, max_seqlen)."""
    lengths = mask.sum(1, dtype=torch.int32)
    indices = mask.flatten().nonzero().flatten()
    return x.flatten(0, 1)[indices], indices, _cu_seqlens(lengths), int(lengths.max())


def _packed_from_position_ids(position_ids: torch.Tensor):
    """Batch-1 packed sequences whose positions restart at 0: (cu_seqlens, max_seqlen), or None."""
    if position_ids is None or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    pos = position_ids[0]
    starts = (pos == 0).nonzero().flatten()
    if starts.numel() < 2 or int(starts[0]) != 0:
        return None
    cu = torch.cat([starts, torch.tensor([pos.numel()], device=pos.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def tileflash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, is_causal=None, **kwargs):
    out_dtype = query.dtype
    # tileflash computes in fp16/bf16; fp32 activations (e.g. layer norms kept in fp32) run in bf16.
    compute = out_dtype if out_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    q, k, v = (x.transpose(1, 2).to(compute) for x in (query, key, value))
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # transformers' sliding window counts the current token; flash-attn's left window does not.
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    kw = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap or 0.0, dropout_p=dropout)
    if kwargs.get("s_aux") is not None:  # gpt-oss's per-head attention sinks
        kw["learnable_sink"] = kwargs["s_aux"].float()

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    packed = None if cu_q is not None else _packed_from_position_ids(kwargs.get("position_ids"))
    if cu_q is not None or packed is not None:  # padding-free batch: [1, T, H, D] holds several sequences
        if cu_q is not None:
            cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
            max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
        else:
            (cu_q, max_q), (cu_k, max_k) = packed, packed
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, **kw).unsqueeze(0)
    elif attention_mask is not None:  # 2-D padding mask [B, >= Sk]
        mask_k = attention_mask[:, -sk:].bool()
        k_u, _, cu_k, max_k = _unpad(k, mask_k)
        v_u = v.flatten(0, 1)[mask_k.flatten().nonzero().flatten()]
        q_u, idx_q, cu_q, max_q = _unpad(q, mask_k[:, -sq:])
        out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, **kw)
        out = torch.zeros(b * sq, hq, d, dtype=compute, device=q.device).index_copy_(0, idx_q, out_u)
        out = out.view(b, sq, hq, d)
    else:
        out = flash_attn_func(q, k, v, **kw)
    return out.to(out_dtype), None


def _preload_as_flash_implementation(name: str) -> None:
    """transformers treats every implementation whose name contains "flash" as a FlashAttention flavour and
    preloads its flash_attn_* functions, looking for a Hub kernel when the name is not a known one. tileflash's
    functions are drop-ins for flash-attn's, so install them as the loaded implementation (module state of
    transformers.modeling_flash_attention_utils, checked by tests/integrations/test_transformers.py against the pinned
    5.x)."""
    from transformers import modeling_flash_attention_utils as fa_utils

    from ..ops.kvcache import flash_attn_with_kvcache

    if fa_utils._loaded_implementation == name:
        return
    fa_utils._flash_fn, fa_utils._flash_varlen_fn = flash_attn_func, flash_attn_varlen_func
    fa_utils._flash_with_kvcache_fn = flash_attn_with_kvcache
    fa_utils._pad_fn, fa_utils._unpad_fn = fa_utils._pad_input, fa_utils._unpad_input
    fa_utils._process_flash_kwargs_fn = fa_utils._lazy_define_process_function(flash_attn_varlen_func)
    fa_utils._process_with_kvcache_kwargs_fn = fa_utils._lazy_define_process_function(flash_attn_with_kvcache)
    fa_utils._loaded_implementation = name


def register(name: str = NAME) -> str:
    """Register tileflash with transformers' AttentionInterface (and its FlashAttention mask function) under
    `name`; returns the name to pass as attn_implementation, e.g.
    `AutoModelForCausalLM.from_pretrained(path, attn_implementation=register())`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, tileflash_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    if "flash" in name:
        _preload_as_flash_implementation(name)
    return name
