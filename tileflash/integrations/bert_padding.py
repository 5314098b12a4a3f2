"""flash-attn 2.x's `flash_attn.bert_padding` helpers (what its users and older transformers call around
flash_attn_varlen_func), in plain torch: a padded batch [B, S, ...] with a [B, S] mask to packed rows and back."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x[indices] along dim 0 (differentiable; int32 or int64 indices)."""
    return x.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros [first_axis_dim, ...] with values at rows indices (differentiable)."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_copy(0, indices.long(), values)  # flash-attn takes int32 indices too


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """hidden_states [B, S, ...] and attention_mask [B, S] (1 = a real token) -> (rows [total, ...], their flat
    indices [total] int64, cu_seqlens [B + 1] int32, max_seqlen (an int), used seqlens [B] int32). unused_mask [B, S]:
    tokens kept in the rows and the offsets but not counted as used (flash-attn's seqused_k)."""
    everything = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = everything.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = everything.flatten().nonzero().flatten()
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, int(seqlens.max()), used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: rows [total, ...] at indices into zeros [batch, seqlen, ...]."""
    return index_put_first_axis(hidden_states, indices, batch * seqlen).view(batch, seqlen, *hidden_states.shape[1:])
