"""The backward of flash_attn_func / flash_attn_varlen_func as a custom op (for torch.compile) and the autograd
formulas the forward custom ops register (prefill.py). The launches are launch/backward.py's."""
from __future__ import annotations

from typing import Optional

import torch

from ..launch.backward import attn_backward


def _attn_bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dout: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
                   cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
                   max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
                   softcap: float, deterministic: bool, alibi_slopes: Optional[torch.Tensor],
                   learnable_sink: Optional[torch.Tensor], dropout_p: float = 0.0,
                   rng: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
    """The op's (dq, dk, dv, dsink): a schema has no optional outputs, so without a sink dsink is empty ([0])."""
    dq, dk, dv, dsink = attn_backward(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                      max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
                                      deterministic, alibi_slopes, learnable_sink, dropout_p, rng)
    return dq, dk, dv, dsink if dsink is not None else q.new_empty(0, dtype=torch.float32)


attn_bwd_op = torch.library.custom_op("tileflash::attn_bwd", mutates_args=())(_attn_bwd_impl)


@attn_bwd_op.register_fake
def _(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, softcap, deterministic, alibi_slopes, learnable_sink, dropout_p=0.0,
      rng=None):
    dsink_len = learnable_sink.shape[0] if learnable_sink is not None else 0
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(dsink_len, dtype=torch.float32)


def _sink_grad(dsink, learnable_sink):
    """The op's dsink as autograd wants it: None for an absent sink (the op returns an empty tensor then)."""
    return dsink if learnable_sink is not None else None


def setup_fwd_context(ctx, inputs, output):
    (q, k, v, softmax_scale, window_left, window_right, softcap, deterministic, alibi_slopes, learnable_sink,
     dropout_p, rng) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, learnable_sink, rng)
    ctx.args = (softmax_scale, window_left, window_right, softcap, deterministic)
    ctx.dropout_p = dropout_p


def fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes, learnable_sink, rng = ctx.saved_tensors
    dq, dk, dv, dsink = attn_bwd_op(q, k, v, out, lse, dout, dlse, None, None, None, 0, 0, *ctx.args, alibi_slopes,
                                    learnable_sink, ctx.dropout_p, rng)
    return dq, dk, dv, None, None, None, None, None, None, _sink_grad(dsink, learnable_sink), None, None


def setup_varlen_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
     window_right, softcap, deterministic, alibi_slopes, learnable_sink, dropout_p, rng) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink,
                          rng)
    ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, deterministic)
    ctx.dropout_p = dropout_p


def varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, learnable_sink, rng = ctx.saved_tensors
    dq, dk, dv, dsink = attn_bwd_op(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                    *ctx.args, alibi_slopes, learnable_sink, ctx.dropout_p, rng)
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None,
            _sink_grad(dsink, learnable_sink), None, None)
