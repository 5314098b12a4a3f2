"""FA3's arguments that run as flash_attn_varlen_func over re-cut sequences: seqused_q (a sequence's first rows are
its queries, the rest a piece without keys) and attention_chunk.

attention_chunk (Llama 4's chunked local attention) on flash_attn_func and flash_attn_varlen_func: a query at key
position p sees only the keys of its own chunk, [floor(p / c) * c, floor(p / c) * c + c), with causal, windows,
softcap, ALiBi and sinks applied as usual (FA3's mask: the chunk bounds intersect the window's). It runs as packed
sequences, one per (sequence, chunk): the chunk's query rows and keys are contiguous rows of q and k, so the packed
tensors are views, and each piece's bottom-right alignment is the chunk's own (its last query sits at its last key,
or before a chunk's end only in the last chunk, where the keys end too).

Forward and backward are flash_attn_varlen_func's; only the offsets are new (from the shapes on the host once per
shape, or from device lengths without a sync).
"""
from __future__ import annotations

import torch

from .. import _utils

_OFFSETS: dict = {}


def _per_piece(owner, alibi_slopes, q_descale, k_descale, v_descale) -> dict:
    """The per-sequence arguments for the pieces (owner: each piece's sequence): [B, Hq] ALiBi slopes and [B, Hkv]
    FP8 descales repeated per piece; [Hq] slopes and absent ones as they are."""
    pick = lambda t: t.index_select(0, owner) if isinstance(t, torch.Tensor) and t.dim() == 2 else t  # noqa: E731
    return dict(alibi_slopes=pick(alibi_slopes), q_descale=pick(q_descale), k_descale=pick(k_descale),
                v_descale=pick(v_descale))


def chunk_pieces(seqlen_q: int, seqlen_k: int, chunk: int) -> list[tuple[int, int]]:
    """(query rows, keys) of one sequence's pieces in order, tiling its rows and keys: keys no query's chunk holds
    (before the first query's chunk) form a piece without rows; queries before every key (Sq > Sk) one without
    keys."""
    diag = seqlen_k - seqlen_q  # query i sits at key position i + diag
    pieces, row, key = [], 0, 0
    for j in range((0 + diag) // chunk, (seqlen_q - 1 + diag) // chunk + 1):  # the chunks of the first to last query
        rows_end = min(max((j + 1) * chunk - diag, 0), seqlen_q)
        keys_start, keys_end = (min(max(x, 0), seqlen_k) for x in (j * chunk, (j + 1) * chunk))
        if keys_start > key:  # keys of chunks that hold no query
            pieces.append((0, keys_start - key))
        if rows_end > row or keys_end > keys_start:
            pieces.append((rows_end - row, keys_end - keys_start))
        row, key = rows_end, keys_end
    return pieces


def _offsets(batch: int, seqlen_q: int, seqlen_k: int, chunk: int, device):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, the batch index of each piece) for `batch` equal
    sequences, cached per shape (the offsets' copy to the device is paid once)."""
    key = (batch, seqlen_q, seqlen_k, chunk, device)
    hit = _OFFSETS.get(key)
    if hit is None:
        pieces = chunk_pieces(seqlen_q, seqlen_k, chunk)
        cu_q, cu_k = [0], [0]
        for _ in range(batch):
            for rows, keys in pieces:
                cu_q.append(cu_q[-1] + rows)
                cu_k.append(cu_k[-1] + keys)
        owner = torch.arange(batch).repeat_interleave(len(pieces))
        as_device = lambda x: torch.tensor(x, dtype=torch.int32).to(device)  # noqa: E731
        hit = (as_device(cu_q), as_device(cu_k), max(r for r, _ in pieces), max(k for _, k in pieces),
               owner.to(device))
        if len(_OFFSETS) >= 256:
            _OFFSETS.clear()
        _OFFSETS[key] = hit
    return hit


def chunked_attention(varlen_fn, q, k, v, chunk: int, return_lse: bool, alibi_slopes, q_descale, k_descale,
                      v_descale, **kw):
    """flash_attn_func(q, k, v, ...) with attention_chunk=chunk (> 0) through varlen_fn (flash_attn_varlen_func):
    per-sequence tensors (ALiBi slopes [B, Hq], FP8 descales [B, Hkv]) are repeated for each of its pieces."""
    _utils.check_tensor("q", q, ndim=4)
    _utils.check_tensor("k", k, ndim=4, device=q.device)
    _utils.check_tensor("v", v, ndim=4, device=q.device)
    b, sq, hq, d = q.shape
    if k.shape[0] != b or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"k, v: expected [B={b}, Sk, Hkv, D] with equal B and Sk, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    sk = k.shape[1]
    cu_q, cu_k, max_q, max_k, owner = _offsets(b, sq, sk, chunk, q.device)
    res = varlen_fn(q.reshape(b * sq, hq, d), k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:]),
                    cu_q, cu_k, max_q, max_k, return_lse=return_lse,
                    **_per_piece(owner, alibi_slopes, q_descale, k_descale, v_descale), **kw)
    out, lse = res if return_lse else (res, None)
    out = out.view(b, sq, hq, out.shape[-1])
    if not return_lse:
        return out
    return out, lse.view(hq, b, sq).transpose(0, 1).contiguous()


def chunked_varlen(varlen_fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                   chunk: int, alibi_slopes, q_descale, k_descale, v_descale, **kw):
    """flash_attn_varlen_func(...) with attention_chunk=chunk (> 0). The pieces come from device lengths without a
    sync: every sequence takes the chunks j of one range [J0, J1] that covers every query of every sequence
    (J0 = floor(-max_seqlen_q / c), J1 = floor((max_seqlen_k - 1) / c)); piece j of sequence b holds its rows
    with key positions in [jc, jc + c) and its keys there (empty pieces are free), so rows and keys stay in order."""
    first, last = -max_seqlen_q // chunk, max(max_seqlen_k - 1, 0) // chunk
    ends = (torch.arange(first, last + 1, device=q.device) + 1) * chunk  # [P]: each piece's end key position
    len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()[:, None]  # [B, 1]
    len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()[:, None]
    rows_end = torch.minimum(torch.clamp(ends[None, :] - (len_k - len_q), min=0), len_q)  # [B, P]
    keys_end = torch.minimum(torch.clamp(ends[None, :], min=0), len_k)
    cu_q = torch.cat([cu_seqlens_q[:1], (cu_seqlens_q[:-1, None].long() + rows_end).flatten().to(torch.int32)])
    cu_k = torch.cat([cu_seqlens_k[:1], (cu_seqlens_k[:-1, None].long() + keys_end).flatten().to(torch.int32)])
    owner = torch.arange(len_q.shape[0], device=q.device).repeat_interleave(ends.shape[0])
    return varlen_fn(q, k, v, cu_q, cu_k, min(max_seqlen_q, chunk), min(max_seqlen_k, chunk),
                     **_per_piece(owner, alibi_slopes, q_descale, k_descale, v_descale), **kw)


def used_rows_varlen(varlen_fn, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, max_seqlen_q: int,
                     max_seqlen_k: int, seqused_k, alibi_slopes, q_descale, k_descale, v_descale, **kw):
    """flash_attn_varlen_func(...) with FA3's seqused_q [B] int32: sequence b's first seqused_q[b] rows are its
    queries (bottom-right aligned to its keys), its other rows a piece without keys (out 0, lse -inf)."""
    _utils.check_int32("seqused_q", seqused_q, 1, q.device)
    if seqused_q.shape[0] != cu_seqlens_q.shape[0] - 1:
        raise ValueError(f"seqused_q: expected {cu_seqlens_q.shape[0] - 1} elements, got {seqused_q.shape[0]}")
    starts, ends = cu_seqlens_q[:-1], cu_seqlens_q[1:]
    used_end = torch.minimum(starts + seqused_q.clamp(min=0), ends)
    cu_q = torch.cat([cu_seqlens_q[:1], torch.stack([used_end, ends], dim=1).flatten()]).to(torch.int32)
    cu_k = torch.cat([cu_seqlens_k[:1], cu_seqlens_k[1:].repeat_interleave(2)])
    if seqused_k is not None:
        seqused_k = torch.stack([seqused_k, torch.zeros_like(seqused_k)], dim=1).flatten()
    owner = torch.arange(seqused_q.shape[0], device=q.device).repeat_interleave(2)
    return varlen_fn(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                     **_per_piece(owner, alibi_slopes, q_descale, k_descale, v_descale), **kw)
