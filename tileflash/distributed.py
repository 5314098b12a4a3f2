"""Context parallelism over torch.distributed: one sequence's keys spread over the ranks of a process group.

Partial attention over disjoint key sets merges exactly (merge_attn_states / the split-KV combine), so a sequence
can be sharded along its length across GPUs with PyTorch's own collectives (NCCL on GPUs, gloo on the CPU):

- cp_decode: each rank holds a shard of every sequence's KV cache (contiguous or paged, any shard lengths); each
  runs flash_attn_with_kvcache on its shard with return_lse, the (out, lse) pairs are all-gathered and merged
  with the split-KV combine kernel. New tokens are appended on the rank that holds the sequence's tail.
- ring_attention: prefill with Q, K, V sharded along the sequence in the "zigzag" layout (the sequence cut into
  2 x world chunks; rank r holds chunks r and 2 x world - 1 - r, so causal work is balanced). K/V chunks travel
  around the ring with point-to-point sends posted before the local attention runs, so transfer overlaps compute.

Both are forward-only (no autograd through the collectives).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .ops._launch import launch_combine
from .ops.decode import flash_attn_with_kvcache
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


def _ring_step(q_chunks, q_ids, kv, kv_ids, causal, softmax_scale, softcap, acc):
    """Fold attention of local query chunks over one (k, v) pair of chunks into acc[(out, lse) per query chunk]."""
    k, v = kv
    for i, (q, qi) in enumerate(zip(q_chunks, q_ids)):
        for kc, vc, ki in zip(k.chunk(2, dim=1), v.chunk(2, dim=1), kv_ids):
            if causal and ki > qi:
                continue  # the whole chunk is in this query chunk's future
            out, lse = flash_attn_func(q, kc, vc, softmax_scale=softmax_scale, causal=causal and ki == qi,
                                       softcap=softcap, return_lse=True)
            acc[i] = (out, lse) if acc[i] is None else merge_attn_states(*acc[i], out, lse)
    return acc


def ring_attention(q, k, v, group=None, causal=False, softmax_scale=None, softcap=0.0, return_lse=False):
    """Prefill attention with q, k, v [B, S_local, H, D] sharded along the sequence in zigzag order
    (zigzag_shard); returns this rank's shard of the output (and lse [B, Hq, S_local]).

    World steps: at each, the K/V pair of chunks held now is sent to rank + 1 and the next one received from
    rank - 1 (posted before the local attention runs, so the transfer overlaps it); local query chunks attend
    to the held chunks with chunk-level causality (earlier chunk: full, same chunk: causal, later: skipped) and
    partial results merge through merge_attn_states.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if q.shape[1] % 2 or k.shape[1] % 2:
        raise ValueError(f"q, k: zigzag shards hold two equal chunks, got lengths {q.shape[1]} and {k.shape[1]}")
    q_chunks = q.chunk(2, dim=1)
    q_ids = (rank, 2 * world - 1 - rank)
    acc = [None, None]
    kv = (k.contiguous(), v.contiguous())
    send_to = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    recv_from = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    for step in range(world):
        holder = (rank - step) % world  # whose chunks are held now
        reqs, nxt = [], None
        if step < world - 1:
            nxt = (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
            ops = [dist.P2POp(dist.isend, t, send_to, group) for t in kv]
            ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in nxt]
            reqs = dist.batch_isend_irecv(ops)
        acc = _ring_step(q_chunks, q_ids, kv, (holder, 2 * world - 1 - holder), causal, softmax_scale, softcap, acc)
        for r in reqs:
            r.wait()
        if nxt is not None:
            kv = nxt
    out = torch.cat([a[0] for a in acc], dim=1)
    lse = torch.cat([a[1] for a in acc], dim=2)
    return (out, lse) if return_lse else out
