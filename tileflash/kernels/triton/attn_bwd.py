"""Attention backward: dQ, dK, dV for every forward variant (causal/window, softcap, GQA/MQA, varlen, seqused_k).

Notation as in the forward (attn_fwd.py): q, dq [B, Sq, Hq, D]; k, dk [B, Sk, Hkv, D]; v, dv [B, Sk, Hkv, Dv] and
do [B, Sq, Hq, Dv] (Dv = HEAD_DIM_V: V's head dim, D's or another, e.g. DeepSeek's 192 / 128) (varlen: packed rows
with a batch stride of 0 and cu_seqlens offsets); lse, delta [B, Hq, Sq] fp32 (varlen [Hq, total_q]).
With logits z = softmax_scale * q.k (softcap: z = cap * tanh(softmax_scale * q.k / cap)), P = exp(z - lse):
  dV = P^T dO,   dP = dO V^T,   dZ = P * (dP - delta),   delta = rowsum(dO * O) - dlse,
  dS = dZ * dz/d(q.k) with dz/d(q.k) = softmax_scale (softcap: softmax_scale * (1 - tanh^2)),
  (ALiBi adds -slope * |q_pos - key| to z: P is recomputed with it; it has no gradient in q, k, v),
  dQ = dS K,   dK = dS^T Q.
(-dlse folds the gradient of a returned lse into delta: d lse / dz = P.)
Attention dropout (DROPOUT; kernels/triton/dropout.py regenerates the forward's pattern Z, kept entries scaled by
1 / (1 - p)): out = (P * Z) V, so dV = (P * Z)^T dO and dZ = P * (dP * Z - delta); delta = rowsum(dO * O) holds
unchanged. (The 1 / (1 - p) of dV is applied to the fp32 sum, once.)

Kernels (on sm_90, head dims 64 and 128 without window/softcap/varlen take kernels/gluon/attn_bwd.py's warp-specialised
dK/dV kernel instead of the dK/dV kernel here; the preprocess and, for deterministic=True, the dQ pass stay):
  preprocess  delta per query row;
  dK/dV       one program per (KV block, KV head): K, V stay in registers while the program walks every
              query block of every query head of its GQA group that can see the block, so dK/dV of a group are
              summed in registers, never through memory. With ATOMIC_DQ (the default where it measured
              faster: plan.backward.BwdConfig.atomic_dq, d > 64) it also computes the block's share dS K of dQ and
              adds it into an fp32 buffer with relaxed vector atomics (the launcher scales and casts it): 5 matrix
              products per (query block, KV block) pair, as in FA2/FA3;
  dQ          otherwise (deterministic=True, or d <= 64): one program per (query block, query head) walking the KV
              blocks it sees, like the forward (masked edge blocks, unmasked interior). It recomputes S and dP, 7
              products per pair instead of 5, but no sum depends on the order programs run in: bitwise
              reproducible gradients.
Why atomics above d64: at 7 products per pair the backward's useful work (the 5 counted in "2.5 x forward
FLOPs") can reach at most 5/7 of the tensor-core rate, below cuDNN's measured backward.

Head dim 64 (why FA4 found its backward at 30-37% of peak there, against 55% at d128): each q/do tile loaded by
the dK/dV program feeds MMAs with K = d, so at d64 every loaded byte and every recomputed exp2 (BLOCK_M x BLOCK_N
per step, independent of d) buys half the matrix work of d128; the step becomes bound by exp2/ALU and by load
latency rather than the tensor cores. What the kernel does about it:
  - the dK/dV program works keys-major: it computes S^T = K Q^T and dP^T = V dO^T, so P^T and dS^T come out of the
    accumulator already in the layout the next MMAs (dV += P^T dO, dK += dS^T Q) take from registers; a
    transpose of P and dS would go through shared memory every step, which costs relatively most at d64;
  - query blocks are split into masked edges and an unmasked interior, so most steps carry no mask arithmetic;
  - at d64 a program is small (64 keys: K, V, dK, dV are 4 x 64 x 64 values), so it runs with 4 warps and 3
    stages: two or more programs share an SM and one's exp2/ALU work overlaps another's MMAs and loads, instead of
    one wide program stalling on its own dependency chain (measured in plan.backward.bwd_config: 298 TFLOP/s against
    249 for a 128-key 8-warp program; d128 takes 128-key 8-warp programs, 334);
  - whole query blocks in the interior (no row predicates on loads), lse in log2 units from the preprocess, and
    Q/dO of the interior through TMA descriptors: fewer instructions per step, which matters most where the step
    is bound by instruction issue. With these, d64 runs at 0.92-0.98x d128 at s >= 4k (`bench backward`, run 35).
"""
import triton
import triton.language as tl

from .inner import tanh
from .dropout import dropout_keep
from .cast import store_cast
from .masks import LOG2E, alibi_distance, kv_block_range, logit_scales, q_block_range, seq_extents, visible


@triton.jit
def attn_bwd_preprocess_kernel(o_ptr, do_ptr, lse_ptr, dlse_ptr, delta_ptr, lse2_ptr, dq_acc_ptr, sink_ptr, dsink_ptr,
                               cu_seqlens_q_ptr, num_seqs, seqlen, num_heads, num_rows,
                               stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
                               stride_lb, stride_lh, stride_ls, stride_sb, stride_sh,
                               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                               HEAD_DIM_V_PAD: tl.constexpr, BLOCK_R: tl.constexpr, HAS_DLSE: tl.constexpr,
                               ZERO_DQ: tl.constexpr, HAS_SINK: tl.constexpr = False, VARLEN: tl.constexpr = False):
    """delta = rowsum(dO * O) - dlse and lse2 = lse in log2 units (+inf for rows that saw no key, so their P is 0)
    for rows (b, s, h) of O and dO [B, S, H, Dv]; dlse laid out like lse, delta and lse2 with strides (stride_sb,
    stride_sh, 1) (launch/backward._stats_views pads their rows for TMA). ZERO_DQ: also zero the rows of dq_acc
    (contiguous fp32 [B, S, H, D], q's head dim) that the dK/dV kernel then adds dQ into, which spares the caller a
    fill kernel (its launch cost ~8-16 us of host time per backward on the GPU machine). HAS_SINK: add each row's
    share of d sink, -exp(sink[h] - lse) * delta (the lse includes the sink), into dsink (fp32 [H], zeroed by the
    caller: every program adds to it; VARLEN: packed rows past cu_seqlens_q[num_seqs] belong to no sequence, and
    their unwritten lse stays out of the sum). Converting lse once here spares the main loops a compare, a multiply
    and a select per query row and step, which the keys-major dK/dV program repeats for every query column a thread
    holds (48 of its 710 SASS instructions per step at d128)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = r < num_rows
    b = r // (seqlen * num_heads)
    s = (r // num_heads) % seqlen
    h = r % num_heads
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    o = tl.load(o_ptr + (b * stride_ob + s * stride_os + h * stride_oh)[:, None] + offs_dv[None, :], mask=mask,
                other=0.0).to(tl.float32)
    do = tl.load(do_ptr + (b * stride_dob + s * stride_dos + h * stride_doh)[:, None] + offs_dv[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    lse_off = b * stride_lb + h * stride_lh + s * stride_ls
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + lse_off, mask=row_ok, other=0.0)
    stat_off = b * stride_sb + h * stride_sh + s
    tl.store(delta_ptr + stat_off, delta, mask=row_ok)
    lse = tl.load(lse_ptr + lse_off, mask=row_ok, other=0.0)
    tl.store(lse2_ptr + stat_off, tl.where(lse == float("-inf"), float("inf"), lse * LOG2E), mask=row_ok)
    if HAS_SINK:
        sink_ok = row_ok
        if VARLEN:
            sink_ok = sink_ok & (s < tl.load(cu_seqlens_q_ptr + num_seqs))
        sink = tl.load(sink_ptr + h, mask=sink_ok, other=0.0)
        tl.atomic_add(dsink_ptr + h, -tl.exp(sink - lse) * delta, mask=sink_ok)
    if ZERO_DQ:
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        tl.store(dq_acc_ptr + r[:, None] * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_R, HEAD_DIM_PAD], tl.float32),
                 mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _load_rows(ptr, rows, row_ok, offs_d, stride_s, HEAD_DIM: tl.constexpr, TILE_DTYPE: tl.constexpr,
               ROWS_IN_RANGE: tl.constexpr):
    """[len(rows), DP] tile of rows of one head; padding rows and columns are 0. ROWS_IN_RANGE: every row is
    known to be valid (row_ok is ignored), so an unpadded head dim loads without predicates."""
    ptrs = ptr + rows.to(tl.int64)[:, None] * stride_s + offs_d[None, :]
    if ROWS_IN_RANGE and HEAD_DIM == offs_d.shape[0]:
        t = tl.load(ptrs)
    elif ROWS_IN_RANGE:
        t = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        t = tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return t.to(TILE_DTYPE)  # as in the forward: the input dtype, fp32 in the interpreter


@triton.jit
def _probs_and_dscores(q, k, v, do, lse2, delta, q_pos, k_pos, seqlen_k, qk_scale, softcap_scale, window_left,
                       window_right, alibi_slope, MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                       SOFTCAP: tl.constexpr, KEYS_MAJOR: tl.constexpr, ALIBI: tl.constexpr, rng_ptr, rows, bh,
                       start_n, dropout_thr, dropout_scale, DROPOUT: tl.constexpr):
    """Recompute P from the saved lse (lse2 = lse * log2(e), +inf for rows that saw no key), with the forward's
    ALiBi bias when ALIBI (alibi_slope: the head's slope times log2(e); the bias has no gradient), and return
    (P, dS / softmax_scale) for one block: [BM, BN] tiles, or with KEYS_MAJOR their transposes [BN, BM], which the
    dK/dV program feeds to its MMAs as the register operand as they come out of the accumulator (a transpose of
    P and dS would move each through shared memory every step). DROPOUT: the P returned is the dropped one dV takes,
    unscaled (the caller scales dV by 1 / (1 - p) once: P scaled before its cast to fp16 could overflow as p nears 1),
    and dP is dropped and scaled before dS (rows: the block's query rows, bh: its (sequence, query head) row,
    start_n: its first key)."""
    if KEYS_MAJOR:
        s = tl.dot(k, tl.trans(q))
        lse_b, delta_b = lse2[None, :], delta[None, :]
        qp, kp = q_pos[None, :], k_pos[:, None]
    else:
        s = tl.dot(q, tl.trans(k))
        lse_b, delta_b = lse2[:, None], delta[:, None]
        qp, kp = q_pos[:, None], k_pos[None, :]
    if SOFTCAP:
        t = tanh(s * softcap_scale)
        s = qk_scale * t
    else:
        s = s * qk_scale
    if ALIBI:
        s = s - alibi_slope * alibi_distance(qp, kp)
    p = tl.math.exp2(s - lse_b)
    if MASK:
        p = tl.where(visible(qp, kp, seqlen_k, window_left, window_right, HAS_LEFT, HAS_RIGHT), p, 0.0)
    if KEYS_MAJOR:
        dp = tl.dot(v, tl.trans(do))
    else:
        dp = tl.dot(do, tl.trans(v))
    if DROPOUT:
        kept = tl.where(dropout_keep(rng_ptr, rows, bh, start_n, dropout_thr, k.shape[0]), 1.0, 0.0)
        if KEYS_MAJOR:
            kept = tl.trans(kept)
        dp = dp * kept * dropout_scale
    ds = p * (dp - delta_b)
    if DROPOUT:
        p = p * kept
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return p, ds


@triton.jit
def _alibi_slope(alibi_ptr, b, stride_alibi_b, head_q, ALIBI: tl.constexpr):
    """Query head head_q's ALiBi slope in log2 units (the scores' units) for sequence b; 0.0 (unread) without
    ALIBI (one return: see _row_stats)."""
    slope = 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + b * stride_alibi_b + head_q) * LOG2E
    return slope


@triton.jit
def _row_stats(lse2_ptr, delta_ptr, b, h, tok, row_ok, stride_lb, stride_lh, stride_ls,
               ROWS_IN_RANGE: tl.constexpr):
    """lse2 (the preprocess's log2-unit lse, +inf for rows that saw no key) and delta for rows tok of head h."""
    off = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + tok.to(tl.int64) * stride_ls
    if ROWS_IN_RANGE:  # (no early return: a return inside a static if once failed to compile for the GPU)
        lse2 = tl.load(lse2_ptr + off)
        delta = tl.load(delta_ptr + off)
    else:
        lse2 = tl.load(lse2_ptr + off, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_ptr + off, mask=row_ok, other=0.0)
    return lse2, delta


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, dq_base, q_desc, do_desc, desc_row0, lse2_ptr, delta_ptr, b, head_q,
                 stride_lb, stride_lh, stride_ls, stride_qs, stride_dos, stride_dqs, q_start, offs_d, offs_dv,
                 start_n, diag, seqlen_q, seqlen_k, lo, hi, rot, qk_scale, softcap_scale, window_left, window_right,
                 alibi_slope, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr,
                 MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                 TILE_DTYPE: tl.constexpr, ATOMIC_DQ: tl.constexpr, QDO_DESC: tl.constexpr, ALIBI: tl.constexpr,
                 rng_ptr, drop_bh, dropout_thr, dropout_scale, DROPOUT: tl.constexpr):
    """dV += P^T dO and dK += dS^T Q (dS without softmax_scale) over query blocks [lo, hi) of one head (multiples
    of BLOCK_M), starting at block rot and wrapping around; with ATOMIC_DQ also dQ += dS K, added in fp32 into
    dq_base's rows (relaxed: only the sum matters). QDO_DESC: unmasked blocks read Q and dO through TMA
    descriptors over [rows, Hq, D] (row desc_row0 + token), no per-thread addresses; masked blocks keep pointer
    loads, which zero rows past seqlen_q (a descriptor would read the next sequence's rows there)."""
    # No modulo by the block count inside the loop: that count is 0 for an empty range, and a version that divided
    # by it there crashed on the GPU with an illegal address (notebook, run 29).
    first = lo + (rot % tl.maximum((hi - lo) // BLOCK_M, 1)) * BLOCK_M
    offs_n = start_n + tl.arange(0, k.shape[0])
    for start in range(lo, hi, BLOCK_M):
        start_m = start + (first - lo)
        start_m = tl.where(start_m >= hi, start_m - (hi - lo), start_m)
        tok = start_m + tl.arange(0, BLOCK_M)
        row_ok = tok < seqlen_q
        # Unmasked (interior) blocks hold no row past seqlen_q (q_block_range): loads need no row predicates.
        if QDO_DESC and not MASK:
            q = q_desc.load([desc_row0 + start_m, head_q, 0]).reshape(BLOCK_M, offs_d.shape[0]).to(TILE_DTYPE)
            do = do_desc.load([desc_row0 + start_m, head_q, 0]).reshape(BLOCK_M, offs_dv.shape[0]).to(TILE_DTYPE)
        else:
            q = _load_rows(q_base, q_start + tok, row_ok, offs_d, stride_qs, HEAD_DIM, TILE_DTYPE, not MASK)
            do = _load_rows(do_base, q_start + tok, row_ok, offs_dv, stride_dos, HEAD_DIM_V, TILE_DTYPE, not MASK)
        lse2, delta = _row_stats(lse2_ptr, delta_ptr, b, head_q, q_start + tok, row_ok, stride_lb, stride_lh,
                                 stride_ls, not MASK)
        p_t, ds_t = _probs_and_dscores(q, k, v, do, lse2, delta, tok + diag, offs_n, seqlen_k, qk_scale,
                                       softcap_scale, window_left, window_right, alibi_slope, MASK, HAS_LEFT,
                                       HAS_RIGHT, SOFTCAP, True, ALIBI, rng_ptr, tok, drop_bh, start_n,
                                       dropout_thr, dropout_scale, DROPOUT)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t), k)
            dq_ptrs = dq_base + (q_start + tok).to(tl.int64)[:, None] * stride_dqs + offs_d[None, :]
            if not MASK and HEAD_DIM == offs_d.shape[0]:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
            elif not MASK:
                tl.atomic_add(dq_ptrs, dq, mask=offs_d[None, :] < HEAD_DIM, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, dq_acc_ptr, q_desc, do_desc,
    desc_rows_per_batch, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ls,
    seqlen_q_static, seqlen_k_static, num_heads_kv, group_size, n_tiles,
    softmax_scale, softcap, window_left, window_right, alibi_ptr, stride_alibi_b, rng_ptr, dropout_thr,
    dropout_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN_Q: tl.constexpr, VARLEN_K: tl.constexpr,
    HAS_SEQUSED_K: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    TILE_DTYPE: tl.constexpr, ATOMIC_DQ: tl.constexpr, ROTATE: tl.constexpr, QDO_DESC: tl.constexpr,
    ALIBI: tl.constexpr, DROPOUT: tl.constexpr = False,
):
    """dK, dV of one KV block of one KV head; with ATOMIC_DQ also the block's share of dQ (dq_acc, fp32, without
    softmax_scale). ROTATE: the programs of one head start their unmasked query blocks at different blocks (their
    KV block index), so they do not all add into the same dQ rows at the same time."""
    pid = tl.program_id(0)
    start_n = (pid % n_tiles) * BLOCK_N
    bh = pid // n_tiles
    b = bh // num_heads_kv
    head_kv = bh % num_heads_kv
    q_start, seqlen_q, k_start, seqlen_k = seq_extents(
        b, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr, seqlen_q_static, seqlen_k_static, 0,
        VARLEN_Q, VARLEN_K, HAS_SEQUSED_K)
    if VARLEN_K:  # keys stored for this sequence (seqused_k may use fewer; the rest get zero gradients)
        stored_k = tl.minimum(tl.load(cu_seqlens_k_ptr + b + 1), seqlen_k_static) - k_start
    else:
        stored_k = seqlen_k_static
    if start_n >= stored_k:
        return

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    key_ok = offs_n < seqlen_k
    b64 = b.to(tl.int64)
    k = _load_rows(k_ptr + b64 * stride_kb + head_kv.to(tl.int64) * stride_kh, k_start + offs_n, key_ok, offs_d,
                   stride_ks, HEAD_DIM, TILE_DTYPE, False)
    v = _load_rows(v_ptr + b64 * stride_vb + head_kv.to(tl.int64) * stride_vh, k_start + offs_n, key_ok, offs_dv,
                   stride_vs, HEAD_DIM_V, TILE_DTYPE, False)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V_PAD], dtype=tl.float32)
    qk_scale, softcap_scale = logit_scales(softmax_scale, softcap, SOFTCAP)

    diag = seqlen_k - seqlen_q
    m_lo, full_lo, full_hi, m_hi = q_block_range(start_n, tl.minimum(start_n + BLOCK_N, seqlen_k),
                                                 start_n + BLOCK_N > seqlen_k, diag, seqlen_q, window_left,
                                                 window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M)
    if start_n >= seqlen_k:
        m_hi = m_lo  # keys past seqused_k: nothing to accumulate, zeros are stored below
        full_lo = m_lo
        full_hi = m_lo
    rot = (pid % n_tiles) if ROTATE else 0
    desc_row0 = b * desc_rows_per_batch + q_start  # this sequence's first row in the [rows, Hq, D] descriptors
    for g in range(group_size):
        head_q = head_kv * group_size + g
        q_base = q_ptr + b64 * stride_qb + head_q.to(tl.int64) * stride_qh
        do_base = do_ptr + b64 * stride_dob + head_q.to(tl.int64) * stride_doh
        dq_base = dq_acc_ptr + b64 * stride_dqb + head_q.to(tl.int64) * stride_dqh
        alibi_slope = _alibi_slope(alibi_ptr, b, stride_alibi_b, head_q, ALIBI)
        drop_bh = b * num_heads_kv * group_size + head_q  # dropout's (sequence, query head) row
        # Masked blocks at the diagonal, unmasked interior (staggered start), masked blocks at the left window edge
        # (one call each: MASK is a compile-time constant and Triton unrolls no loop over a tuple).
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, dq_base, q_desc, do_desc, desc_row0, lse2_ptr, delta_ptr,
                              b, head_q, stride_lb, stride_lh, stride_ls, stride_qs, stride_dos, stride_dqs, q_start,
                              offs_d, offs_dv, start_n, diag, seqlen_q, seqlen_k, m_lo * BLOCK_M, full_lo * BLOCK_M,
                              0, qk_scale, softcap_scale, window_left, window_right, alibi_slope, HEAD_DIM,
                              HEAD_DIM_V, BLOCK_M, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, TILE_DTYPE, ATOMIC_DQ,
                              QDO_DESC, ALIBI, rng_ptr, drop_bh, dropout_thr, dropout_scale, DROPOUT)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, dq_base, q_desc, do_desc, desc_row0, lse2_ptr, delta_ptr,
                              b, head_q, stride_lb, stride_lh, stride_ls, stride_qs, stride_dos, stride_dqs, q_start,
                              offs_d, offs_dv, start_n, diag, seqlen_q, seqlen_k, full_lo * BLOCK_M, full_hi * BLOCK_M,
                              rot, qk_scale, softcap_scale, window_left, window_right, alibi_slope, HEAD_DIM,
                              HEAD_DIM_V, BLOCK_M, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, TILE_DTYPE, ATOMIC_DQ,
                              QDO_DESC, ALIBI, rng_ptr, drop_bh, dropout_thr, dropout_scale, DROPOUT)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, dq_base, q_desc, do_desc, desc_row0, lse2_ptr, delta_ptr,
                              b, head_q, stride_lb, stride_lh, stride_ls, stride_qs, stride_dos, stride_dqs, q_start,
                              offs_d, offs_dv, start_n, diag, seqlen_q, seqlen_k, full_hi * BLOCK_M, m_hi * BLOCK_M,
                              0, qk_scale, softcap_scale, window_left, window_right, alibi_slope, HEAD_DIM,
                              HEAD_DIM_V, BLOCK_M, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, TILE_DTYPE, ATOMIC_DQ,
                              QDO_DESC, ALIBI, rng_ptr, drop_bh, dropout_thr, dropout_scale, DROPOUT)
    dk = dk * softmax_scale
    if DROPOUT:
        dv = dv * dropout_scale  # _probs_and_dscores' dropped P is unscaled
    interpreted: tl.constexpr = TILE_DTYPE == tl.float32  # tiles are fp32 only in the interpreter
    key_stored = offs_n[:, None] < stored_k
    rows = (k_start + offs_n).to(tl.int64)
    tl.store(dk_ptr + b64 * stride_dkb + head_kv.to(tl.int64) * stride_dkh + rows[:, None] * stride_dks
             + offs_d[None, :], store_cast(dk, dk_ptr.dtype.element_ty, interpreted),
             mask=key_stored & (offs_d[None, :] < HEAD_DIM))
    tl.store(dv_ptr + b64 * stride_dvb + head_kv.to(tl.int64) * stride_dvh + rows[:, None] * stride_dvs
             + offs_dv[None, :], store_cast(dv, dv_ptr.dtype.element_ty, interpreted),
             mask=key_stored & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, q_pos, k_base, v_base, stride_ks, stride_vs, k_start, offs_d, offs_dv,
               seqlen_k, lo, hi, qk_scale, softcap_scale, window_left, window_right, alibi_slope,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, TILE_DTYPE: tl.constexpr,
               ALIBI: tl.constexpr, rng_ptr, drop_rows, drop_bh, dropout_thr, dropout_scale, DROPOUT: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < seqlen_k
        # Unmasked (interior) blocks hold no key past seqlen_k (kv_block_range): loads need no row predicates.
        k = _load_rows(k_base, k_start + offs_n, key_ok, offs_d, stride_ks, HEAD_DIM, TILE_DTYPE, not MASK)
        v = _load_rows(v_base, k_start + offs_n, key_ok, offs_dv, stride_vs, HEAD_DIM_V, TILE_DTYPE, not MASK)
        p, ds = _probs_and_dscores(q, k, v, do, lse2, delta, q_pos, offs_n, seqlen_k, qk_scale, softcap_scale,
                                   window_left, window_right, alibi_slope, MASK, HAS_LEFT, HAS_RIGHT, SOFTCAP, False,
                                   ALIBI, rng_ptr, drop_rows, drop_bh, start_n, dropout_thr, dropout_scale, DROPOUT)
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr, dq_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_ls,
    seqlen_q_static, seqlen_k_static, num_heads_q, group_size, m_tiles,
    softmax_scale, softcap, window_left, window_right, alibi_ptr, stride_alibi_b, rng_ptr, dropout_thr,
    dropout_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN_Q: tl.constexpr, VARLEN_K: tl.constexpr,
    HAS_SEQUSED_K: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    TILE_DTYPE: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    start_m = (m_tiles - 1 - pid % m_tiles) * BLOCK_M  # heaviest causal tiles first
    bh = pid // m_tiles
    b = bh // num_heads_q
    head_q = bh % num_heads_q
    head_kv = head_q // group_size
    q_start, seqlen_q, k_start, seqlen_k = seq_extents(
        b, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqused_k_ptr, seqlen_q_static, seqlen_k_static, 0,
        VARLEN_Q, VARLEN_K, HAS_SEQUSED_K)
    if start_m >= seqlen_q:
        return
    tok = start_m + tl.arange(0, BLOCK_M)
    row_ok = tok < seqlen_q
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    b64 = b.to(tl.int64)
    q = _load_rows(q_ptr + b64 * stride_qb + head_q.to(tl.int64) * stride_qh, q_start + tok, row_ok, offs_d,
                   stride_qs, HEAD_DIM, TILE_DTYPE, False)
    do = _load_rows(do_ptr + b64 * stride_dob + head_q.to(tl.int64) * stride_doh, q_start + tok, row_ok, offs_dv,
                    stride_dos, HEAD_DIM_V, TILE_DTYPE, False)
    lse2, delta = _row_stats(lse2_ptr, delta_ptr, b, head_q, q_start + tok, row_ok, stride_lb, stride_lh,
                             stride_ls, False)
    qk_scale, softcap_scale = logit_scales(softmax_scale, softcap, SOFTCAP)
    diag = seqlen_k - seqlen_q
    n_lo, full_lo, full_hi, n_hi = kv_block_range(start_m, tl.minimum(start_m + BLOCK_M, seqlen_q) - 1, diag,
                                                  seqlen_k, window_left, window_right, HAS_LEFT, HAS_RIGHT, BLOCK_N)
    k_base = k_ptr + b64 * stride_kb + head_kv.to(tl.int64) * stride_kh
    v_base = v_ptr + b64 * stride_vb + head_kv.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    q_pos = tok + diag
    alibi_slope = _alibi_slope(alibi_ptr, b, stride_alibi_b, head_q, ALIBI)
    drop_bh = b * num_heads_q + head_q  # dropout's (sequence, query head) row
    # Masked blocks at the left window edge, unmasked interior, masked blocks at the diagonal / end.
    dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, k_base, v_base, stride_ks, stride_vs, k_start, offs_d, offs_dv,
                    seqlen_k, n_lo * BLOCK_N, full_lo * BLOCK_N, qk_scale, softcap_scale, window_left, window_right,
                    alibi_slope, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, TILE_DTYPE, ALIBI,
                    rng_ptr, tok, drop_bh, dropout_thr, dropout_scale, DROPOUT)
    dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, k_base, v_base, stride_ks, stride_vs, k_start, offs_d, offs_dv,
                    seqlen_k, full_lo * BLOCK_N, full_hi * BLOCK_N, qk_scale, softcap_scale, window_left, window_right,
                    alibi_slope, HEAD_DIM, HEAD_DIM_V, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, TILE_DTYPE, ALIBI,
                    rng_ptr, tok, drop_bh, dropout_thr, dropout_scale, DROPOUT)
    dq = _dq_blocks(dq, q, do, lse2, delta, q_pos, k_base, v_base, stride_ks, stride_vs, k_start, offs_d, offs_dv,
                    seqlen_k, full_hi * BLOCK_N, n_hi * BLOCK_N, qk_scale, softcap_scale, window_left, window_right,
                    alibi_slope, HEAD_DIM, HEAD_DIM_V, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, TILE_DTYPE, ALIBI,
                    rng_ptr, tok, drop_bh, dropout_thr, dropout_scale, DROPOUT)
    dq = dq * softmax_scale
    interpreted: tl.constexpr = TILE_DTYPE == tl.float32  # tiles are fp32 only in the interpreter
    rows = (q_start + tok).to(tl.int64)
    tl.store(dq_ptr + b64 * stride_dqb + head_q.to(tl.int64) * stride_dqh + rows[:, None] * stride_dqs
             + offs_d[None, :], store_cast(dq, dq_ptr.dtype.element_ty, interpreted),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
