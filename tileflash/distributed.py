"""Context parallelism over torch.distributed: one sequence's keys spread over the ranks of a process group.

Partial attention over disjoint key sets merges exactly (merge_attn_states / the split-KV combine), so a sequence
can be sharded along its length across GPUs with PyTorch's own collectives (NCCL on GPUs, gloo on the CPU):

- cp_decode: each rank holds a shard of every sequence's KV cache (contiguous or paged, any shard lengths); each
  runs flash_attn_with_kvcache on its shard with return_lse, the (out, lse) pairs are all-gathered and merged
  with the split-KV combine kernel. New tokens are appended on the rank that holds the sequence's tail.
- ring_attention: prefill with Q, K, V sharded along the sequence in the "zigzag" layout (the sequence cut into
  2 x world chunks; rank r holds chunks r and 2 x world - 1 - r, so causal work is balanced). K/V chunks travel
  around the ring with point-to-point sends posted before the local attention runs, so transfer overlaps compute.

cp_decode is forward-only; ring_attention is differentiable (its backward is a second ring).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _utils
from .launch.forward import launch_combine
from .launch.backward import attn_backward
from .ops.kvcache import flash_attn_with_kvcache
from .ops.merge import merge_attn_states
from .ops.prefill import flash_attn_func


def _merge_gathered(outs, lses, like_out):
    """Merge per-rank (out [B, Sq, H, D], lse [B, H, Sq]) with the split-KV combine (fp32 partials)."""
    b, sq, h, d = like_out.shape
    o_part = torch.stack([o.float().reshape(b * sq * h, d) for o in outs])
    lse_part = torch.stack([lse.transpose(1, 2).reshape(b * sq * h) for lse in lses]).contiguous()
    out = torch.empty_like(like_out)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=like_out.device)
    launch_combine(o_part, lse_part, out, lse)
    return out, lse


def cp_decode(q, k_cache, v_cache, cache_seqlens, k=None, v=None, block_table=None, group=None, tail_rank=None,
              softmax_scale=None, softcap=0.0, return_lse=False, **kwargs):
    """Decode over a KV cache sharded along the sequence across `group`.

    Every rank passes the same q [B, Sq, Hq, D] and its own shard: k_cache/v_cache (contiguous or paged, as for
    flash_attn_with_kvcache), cache_seqlens [B] int32 = tokens of each sequence in this shard, block_table for a
    paged shard. Shards hold consecutive pieces of each sequence in rank order; `tail_rank` (default: the last
    rank) holds the end of every sequence and is the only rank whose k/v [B, Snew, Hkv, D] are appended (others
    may pass k=v=None). Causal masking is bottom-right over the whole sequence, so the tail shard must hold at
    least the last Sq keys (true whenever the Sq new tokens are appended there). Returns out (and lse) of
    attention over the concatenation of all shards, identical on every rank.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    tail_rank = world - 1 if tail_rank is None else tail_rank
    if kwargs.get("window_size", (-1, -1)) != (-1, -1):
        raise ValueError("window_size: context-parallel decode supports full causal attention only")
    is_tail = rank == tail_rank
    # Keys of non-tail shards all precede the new queries: every query sees all of them.
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k if is_tail else None, v if is_tail else None,
                                       cache_seqlens=cache_seqlens, block_table=block_table,
                                       softmax_scale=softmax_scale, causal=is_tail, softcap=softcap,
                                       return_lse=True, **kwargs)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    out, lse = _merge_gathered(outs, lses, out)
    return (out, lse) if return_lse else out


def zigzag_shard(x, rank: int, world: int, dim: int = 1):
    """This rank's zigzag shard of x along `dim` (length divisible by 2 x world): chunks rank and 2w-1-rank."""
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards, world: int, dim: int = 1):
    """Inverse of zigzag_shard over the list of every rank's shard (e.g. from all_gather)."""
    chunks = [None] * (2 * world)
    for r, s in enumerate(shards):
        chunks[r], chunks[2 * world - 1 - r] = s.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _ring_exchange(tensors, group, send_to, recv_from):
    """Post sends of `tensors` to send_to and receives of same-shaped buffers from recv_from; (buffers, requests)."""
    nxt = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in nxt]
    return nxt, dist.batch_isend_irecv(ops)


def _ring_peers(group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    to, frm = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        to, frm = dist.get_global_rank(group, to), dist.get_global_rank(group, frm)
    return world, rank, to, frm


def _visible_pairs(q_ids, kv_ids, causal):
    """(query chunk index, key chunk index, diagonal?) of the chunk pairs with any visible key: an earlier key
    chunk is seen whole, the same chunk causally, a later one not at all."""
    for i, qi in enumerate(q_ids):
        for j, kj in enumerate(kv_ids):
            if not (causal and kj > qi):
                yield i, j, causal and kj == qi


def _ring_forward(q, k, v, group, causal, softmax_scale, softcap):
    world, rank, send_to, recv_from = _ring_peers(group)
    q_chunks = q.chunk(2, dim=1)
    q_ids = (rank, 2 * world - 1 - rank)
    acc = [None, None]
    kv = [k.contiguous(), v.contiguous()]
    for step in range(world):
        holder = (rank - step) % world  # whose chunks are held now
        nxt, reqs = _ring_exchange(kv, group, send_to, recv_from) if step < world - 1 else (None, [])
        kc, vc = kv[0].chunk(2, dim=1), kv[1].chunk(2, dim=1)
        for i, j, diagonal in _visible_pairs(q_ids, (holder, 2 * world - 1 - holder), causal):
            out, lse = flash_attn_func(q_chunks[i], kc[j], vc[j], softmax_scale=softmax_scale, causal=diagonal,
                                       softcap=softcap, return_lse=True)
            acc[i] = (out, lse) if acc[i] is None else merge_attn_states(*acc[i], out, lse)
        for r in reqs:
            r.wait()
        kv = nxt if nxt is not None else kv
    return torch.cat([a[0] for a in acc], dim=1), torch.cat([a[1] for a in acc], dim=2)


def _ring_backward(q, k, v, out, lse, dout, dlse, group, causal, softmax_scale, softcap):
    """Gradients of the ring forward. Each chunk pair's backward uses the *final* out and lse of its query rows,
    so its dQ, dK, dV are exactly that pair's share of the whole gradient (P = exp(S - lse), delta =
    rowsum(dO * O) - dlse are per query row). dQ stays here; the dK/dV of the K/V chunks held now travel with
    them (fp32) and arrive back at their owner after world hops."""
    world, rank, send_to, recv_from = _ring_peers(group)
    scale = _utils.softmax_scale_or_default(softmax_scale, q.shape[-1])
    two = lambda t, dim=1: [c.contiguous() for c in t.chunk(2, dim=dim)]  # noqa: E731
    q_c, o_c, do_c, lse_c = two(q), two(out), two(dout), two(lse, 2)
    dlse_c = two(dlse, 2) if dlse is not None else [None, None]
    q_ids = (rank, 2 * world - 1 - rank)
    dq = [torch.zeros(c.shape, dtype=torch.float32, device=q.device) for c in q_c]
    kv = [k.contiguous(), v.contiguous()]
    dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
           torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
    for step in range(world):
        holder = (rank - step) % world
        nxt, reqs = _ring_exchange(kv, group, send_to, recv_from) if step < world - 1 else (None, [])
        kc, vc = two(kv[0]), two(kv[1])
        dkc, dvc = dkv[0].chunk(2, dim=1), dkv[1].chunk(2, dim=1)  # views: the adds below land in dkv
        for i, j, diagonal in _visible_pairs(q_ids, (holder, 2 * world - 1 - holder), causal):
            dq_p, dk_p, dv_p, _ = attn_backward(q_c[i], kc[j], vc[j], o_c[i], lse_c[i], do_c[i], dlse_c[i],
                                                None, None, None, 0, 0, scale, -1, 0 if diagonal else -1, softcap,
                                                False)
            dq[i] += dq_p.float()
            dkc[j].add_(dk_p.float())
            dvc[j].add_(dv_p.float())
        for r in reqs:
            r.wait()
        # The accumulators follow their K/V chunks; after the last step this sends them home.
        dkv, dreqs = _ring_exchange(dkv, group, send_to, recv_from)
        for r in dreqs:
            r.wait()
        kv = nxt if nxt is not None else kv
    return torch.cat(dq, dim=1).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale, softcap):
        out, lse = _ring_forward(q, k, v, group, causal, softmax_scale, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, softmax_scale, softcap)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, dlse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, group=None, causal=False, softmax_scale=None, softcap=0.0, return_lse=False):
    """Prefill attention with q, k, v [B, S_local, H, D] sharded along the sequence in zigzag order
    (zigzag_shard); returns this rank's shard of the output (and lse [B, Hq, S_local]). Differentiable: the
    backward runs a second ring (see _ring_backward), so every rank must call backward.

    World steps: at each, the K/V pair of chunks held now is sent to rank + 1 and the next one received from
    rank - 1 (posted before the local attention runs, so the transfer overlaps it); local query chunks attend
    to the held chunks with chunk-level causality (earlier chunk: full, same chunk: causal, later: skipped) and
    partial results merge through merge_attn_states.
    """
    if q.shape[1] % 2 or k.shape[1] % 2:
        raise ValueError(f"q, k: zigzag shards hold two equal chunks, got lengths {q.shape[1]} and {k.shape[1]}")
    out, lse = _RingAttention.apply(q, k, v, group, causal, softmax_scale, softcap)
    return (out, lse) if return_lse else out
