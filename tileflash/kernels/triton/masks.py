"""Masks and index ranges shared by the forward, decode and backward kernels.

Positions are bottom-right aligned: query token i of a sequence with Sq queries and Sk keys sits at key position
q_pos = i + Sk - Sq (diag = Sk - Sq). Query i sees key j iff j < Sk, j <= q_pos + window_right (causal is a right
window of 0) and j >= q_pos - window_left; an absent bound (HAS_* False) is unbounded. CHUNK (FA3's
attention_chunk c > 0): also only keys of the query's chunk, [chunk_start(q_pos), chunk_start(q_pos) + c). ALiBi
biases the score of (q_pos, j) by -slope * |q_pos - j| (alibi_distance).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr object: triton 3.6 rejects annotated globals


@triton.jit
def chunk_start(pos, chunk):
    """floor(pos / chunk) * chunk for any int pos (Triton's // truncates toward zero: rows that sit before the first
    key, q_pos < 0, must fall in a chunk of their own)."""
    return tl.where(pos >= 0, pos // chunk, -((chunk - 1 - pos) // chunk)) * chunk


@triton.jit
def visible(q_pos, k_pos, seqlen_k, window_left, window_right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
            chunk=0, CHUNK: tl.constexpr = False):
    """Mask of the keys at k_pos each query at q_pos may see, over the broadcast of the two (the forward passes
    q_pos[:, None] and k_pos[None, :] for [M, N] scores; the dK/dV pass the transpose for [N, M]): in range, not
    beyond q_pos + window_right (causal is a right window of 0), not before q_pos - window_left, inside q_pos's
    chunk with CHUNK. An absent bound is unbounded."""
    ok = k_pos < seqlen_k
    if HAS_RIGHT:
        ok = ok & (k_pos <= q_pos + window_right)
    if HAS_LEFT:
        ok = ok & (k_pos >= q_pos - window_left)
    if CHUNK:
        lo = chunk_start(q_pos, chunk)
        ok = ok & (k_pos >= lo) & (k_pos < lo + chunk)
    return ok


@triton.jit
def alibi_distance(q_pos, k_pos):
    """|q_pos - k_pos| as fp32 over the broadcast of the two: the ALiBi bias is -slope times this (flash-attn's
    -alibi_slope * |i + seqlen_k - seqlen_q - j|, the same for causal calls, so the lse is flash-attn's)."""
    return tl.abs(q_pos - k_pos).to(tl.float32)


@triton.jit
def seq_extents(b, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqlens_k_ptr, seqlen_q_static, seqlen_k_static,
                seqlen_k_add, VARLEN_Q: tl.constexpr, VARLEN_K: tl.constexpr, HAS_SEQLENS_K: tl.constexpr):
    """(q_start, seqlen_q, k_start, seqlen_k) of sequence b: packed (cu_seqlens) or padded (static lengths);
    seqlens_k (seqused_k / cache_seqlens) + seqlen_k_add overrides the key count, never past the stored keys.
    Packed: the static lengths are the packed row counts, and cu_seqlens entries past them (a caller's error) are
    clamped to them, so no read or write leaves the tensors."""
    if VARLEN_Q:
        q_start = tl.minimum(tl.load(cu_seqlens_q_ptr + b), seqlen_q_static)
        seqlen_q = tl.minimum(tl.load(cu_seqlens_q_ptr + b + 1), seqlen_q_static) - q_start
    else:
        q_start = 0
        seqlen_q = seqlen_q_static
    if VARLEN_K:
        k_start = tl.minimum(tl.load(cu_seqlens_k_ptr + b), seqlen_k_static)
        seqlen_k = tl.minimum(tl.load(cu_seqlens_k_ptr + b + 1), seqlen_k_static) - k_start
    else:
        k_start = 0
        seqlen_k = seqlen_k_static
    if HAS_SEQLENS_K:
        # Never past the KV actually stored (the cache capacity / this sequence's keys): no out-of-bounds reads.
        seqlen_k = tl.minimum(tl.load(seqlens_k_ptr + b) + seqlen_k_add, seqlen_k)
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def kv_block_range(tok_min, tok_max, diag, seqlen_k, window_left, window_right, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr, chunk=0, CHUNK: tl.constexpr = False):
    """KV blocks for query tokens [tok_min, tok_max]: [n_lo, n_hi) seen by some row, and inside it
    [full_lo, full_hi) seen whole by every row (no per-element mask needed)."""
    hi_key = seqlen_k
    full_hi_key = seqlen_k
    if HAS_RIGHT:
        hi_key = tl.minimum(hi_key, tok_max + diag + window_right + 1)
        full_hi_key = tl.minimum(full_hi_key, tok_min + diag + window_right + 1)
    n_lo = 0
    full_lo = 0
    if HAS_LEFT:
        n_lo = tl.maximum(tok_min + diag - window_left, 0) // BLOCK_N
        full_lo = tl.cdiv(tl.maximum(tok_max + diag - window_left, 0), BLOCK_N)
    if CHUNK:  # each row's chunk bounds both sides: the first row's chunk starts lowest, the last row's highest
        lo_first = chunk_start(tok_min + diag, chunk)
        lo_last = chunk_start(tok_max + diag, chunk)
        hi_key = tl.minimum(hi_key, lo_last + chunk)
        full_hi_key = tl.minimum(full_hi_key, lo_first + chunk)
        n_lo = tl.maximum(n_lo, tl.maximum(lo_first, 0) // BLOCK_N)
        full_lo = tl.maximum(full_lo, tl.cdiv(tl.maximum(lo_last, 0), BLOCK_N))
    n_hi = tl.cdiv(tl.maximum(hi_key, 0), BLOCK_N)
    full_hi = tl.maximum(full_hi_key, 0) // BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, n_lo), n_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), n_hi)
    return n_lo, full_lo, full_hi, n_hi


@triton.jit
def q_block_range(key_lo, key_hi, key_block_partial, diag, seqlen_q, window_left, window_right,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query blocks for keys [key_lo, key_hi) (the backward's transpose of kv_block_range): [m_lo, m_hi) hold a
    query that sees some key, and inside it [full_lo, full_hi) only queries that see every key (no per-element
    mask) and no row past seqlen_q (a partial last block stays with the masked blocks), so the interior loads
    without row predicates. Key j is visible to query i iff j - diag - window_right <= i <= j - diag +
    window_left. A key block cut by seqlen_k is masked throughout."""
    q_lo = 0
    q_hi = seqlen_q
    full_lo_tok = 0
    if HAS_RIGHT:
        q_lo = tl.maximum(key_lo - diag - window_right, 0)
        full_lo_tok = key_hi - 1 - diag - window_right
    m_lo = q_lo // BLOCK_M
    if HAS_LEFT:
        q_hi = tl.minimum(key_hi - 1 - diag + window_left + 1, seqlen_q)
    m_hi = tl.cdiv(tl.maximum(q_hi, 0), BLOCK_M)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(full_lo_tok, 0), BLOCK_M), m_lo), m_hi)
    full_hi = m_hi
    if HAS_LEFT:
        full_hi = tl.maximum(key_lo - diag + window_left + 1, 0) // BLOCK_M
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), m_hi)
    full_hi = tl.minimum(full_hi, tl.maximum(seqlen_q // BLOCK_M, full_lo))  # whole blocks only
    if key_block_partial:
        full_lo = m_hi
        full_hi = m_hi
    return m_lo, full_lo, full_hi, m_hi


@triton.jit
def logit_scales(softmax_scale, softcap, SOFTCAP: tl.constexpr):
    """(qk_scale, softcap_scale) so that logits in log2 units are qk_scale * q.k, or with softcap
    qk_scale * tanh(softcap_scale * q.k) = log2(e) * softcap * tanh(softmax_scale * q.k / softcap)."""
    if SOFTCAP:
        return softcap * LOG2E, softmax_scale / softcap
    return softmax_scale * LOG2E, 1.0
