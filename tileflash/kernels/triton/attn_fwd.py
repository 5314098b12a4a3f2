"""Attention forward for prefill (batched or varlen) and decode (pack-GQA, paged, split-KV): one kernel.

Shapes (element strides are passed explicitly; the head dim must be contiguous):
  q:    [B, Sq, Hq, D]       (varlen: [total_q, Hq, D] viewed with a batch stride of 0 and cu_seqlens_q offsets)
  k, v: [B, Sk, Hkv, D]      contiguous / varlen like q; or paged [num_pages, page_size, Hkv, D] + block_table
  out:  like q, in q's dtype
  lse:  [B, Hq, Sq] (varlen: [Hq, total_q]) float32, natural log; -inf for rows that see no key
  alibi:  fp32 slopes [Hq] or [B, Hq] (ALIBI; stride_alibi_b 0 for [Hq]): scores get -slope * |q_pos - key|.
  sink:   fp32 [Hq] (HAS_SINK; FA4's learnable_sink): one more logit per row with no value, in the softmax's sum and
          the lse (a row that sees no key: out = 0, lse = sink); split partials leave it to attn_combine.
  HEAD_DIM_V: V's (and out's) head dim, HEAD_DIM's unless V differs. HAS_QV (MLA, FA3's qv): qv [B, Sq, Hq,
          HEAD_DIM_V] is a second query part whose keys are the values themselves: s = q k^T + qv v^T (DeepSeek's
          latent cache as V, its rotary part as K), so each latent byte is read once for both products.
  FP8 caches (decode): k/v in float8_e4m3fn with fp32 scales per tensor or per KV head (KV_SCALED).
  FP8 attention (QKV_FP8: inner.FP8_V_ROWS, or FP8_V_T(_DESC, _ZEROS) for v given as V^T [Hkv, D, width] with each
  sequence from launch/tensors.values_t_column, VT_GAP columns apart (0: v not V^T), stride_vs D's stride and
  stride_vh the head's; with KV_SCALED): q,
  k, v in float8_e4m3fn with FA3's descales [B, Hkv] fp32 at q/k/v_scale_ptr (element (b, h) at b * stride_*sc_b
  + h * stride_*sc_h; decode's cache scales have a batch stride of 0): s = q_descale k_descale (q k^T), out =
  v_descale (P V) / l with P rounded to e4m3 and every product on FP8 tensor cores (V rows, paged: P V in fp16;
  attn_inner's P_FP8); out in bf16 or fp16.
  NVFP4 caches (decode, KV_NVFP4): k/v uint8 [.., D/2] packed e2m1 pairs, block scales e4m3 [.., D/16] at
  k/v_bscale_ptr, and the per-tensor global scales at k/v_scale_ptr (KV_SCALED too).
  Decode extras (flash-attn's flash_attn_with_kvcache arguments): HAS_KV_BATCH reads sequence b's keys from cache
  row kv_batch[b] (cache_batch_idx); LEFTPAD_K starts them at cache position leftpad_k[b] (cache_leftpad; the keys
  are [leftpad, cache_seqlens + Snew), and positions count from the pad; paged caches by pointers); ROTARY_DIM > 0
  rotates q as it is loaded (kernels/_rotary.py) at position cache_seqlens[b] + token (ROTARY_PER_TOKEN: causal or
  windowed calls) or cache_seqlens[b] for every token (flash-attn's convention otherwise); VARLEN_K_NEW adds
  sequence b's cu_k_new[b + 1] - cu_k_new[b] appended tokens to its keys (FA3's cu_seqlens_k_new).
  Split-KV (decode): o_part [num_splits, B, Sq, Hq, D] and lse_part [num_splits, B, Sq, Hq], fp32, merged by
  attn_combine; each split holds its own normalised output and LSE (an empty split: o = 0, lse = -inf). PDL (sm_90,
  contiguous caches): the combine may launch once every program here has started (programmatic dependent launch).
  APPEND_NEW > 0 (decode, 16-bit or FP8 caches, pack-GQA, one M tile): the call's k/v_new [B, Snew, Hkv, D]
  (strides stride_n*, Snew = seqlen_k_add <= APPEND_NEW) are appended by the programs that read their positions
  (kv_append.append_in_range into k/v_cache_ptr, the raw caches under any descriptors, FP8 ones as uint8 and
  quantized with the cache scales): no append launch.
  BOX_IN_SEQ (K/V through a contiguous cache's descriptors, a call without new keys, not FP8 attention's V^T): when a
  sequence has at least BLOCK_N keys, its masked blocks read boxes that end at or before its last key, so no V tile
  is masked (inner._kv_tile); shorter sequences take the masked V tiles.
  CHUNK (flash_attn_with_kvcache's attention_chunk, FA3's): each row sees only its chunk of attention_chunk key
  positions (masks.visible, kv_block_range), intersected with causal / the window.
  DROPOUT (prefill: no pack-GQA, split or FP8): flash-attn's attention dropout (kernels/triton/dropout.py; the
  seed at rng_ptr, threshold dropout_thr, kept probabilities scaled by dropout_scale = 1 / (1 - p)); l and the lse
  are the undropped softmax's.
  FUSED_COMBINE: no combine launch; the last split of each tile to finish merges the tile's rows (combine.
  merge_tile_splits, int32 arrival counters [grid axis 0] at counter_ptr, zero before and after the launch).

Program grid: axis 0 = (batch x head) x M tiles, flattened (axis 1 is capped at 65535), heaviest causal tiles first;
axis 1 = KV split. A program's rows are either BLOCK_M consecutive query tokens of one query head (prefill) or, with
PACK_GQA, rows r = token * G + g over the G = Hq/Hkv query heads of one KV head (decode), so each K/V byte is read
once per group.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .inner import FP8_V_T, TRANS_PERM_K, attn_inner, fp8_row_max, perm_head_dim
from .cast import store_cast, values_t_column
from .masks import LOG2E, kv_block_range, logit_scales, seq_extents
from .rotary import rotate_rows
from .kv_append import append_in_range
from .combine import allow_dependent_launch, merge_tile_splits
from ...lowp.kernels.quant import E2M1_UNIT, NVFP4_PURE_ASM


@triton.jit
def _finite_amax(x):
    """The largest finite |x| of a tile (0 when there is none), fp32."""
    xf = x.to(tl.float32)
    return tl.max(tl.max(tl.where(tl.abs(xf) < float("inf"), tl.abs(xf), 0.0), 1), 0)


@triton.jit
def _fp16_range(amax):
    """(2^k, 2^-k) with k chosen so amax (a tile's largest finite |x|) times 2^k lands in [2^8, 2^9) (k = 0 for 0).
    inf and NaN pass through without moving k, so they stay in their own rows. One k per tile: a row more than 2^22
    times smaller than the tile's largest value reaches fp16's subnormals (pack-GQA rows are heads of one group)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of max|x|
    k = tl.where(e == 0, 0, tl.minimum(tl.maximum(135 - e, -126), 126))  # 2^k and 2^-k stay normal fp32
    return ((127 + k) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fold_sink(m_i, l_i, sink2):
    """Fold one value-less logit sink2 (log2 units, like m_i) into each row's (m_i, l_i); also returns the factor
    exp2(m_old - m_new) that rescales acc. m_i = -inf rows get m = sink2, l = 1, factor 0."""
    m_new = tl.maximum(m_i, sink2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a -inf sink on an unseen row: exp2 gives 0, not NaN
    alpha = tl.math.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.math.exp2(sink2 - m_safe), alpha


@triton.jit
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, counter_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqlens_k_ptr, block_table_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
    stride_qsc_b, stride_qsc_h, stride_ksc_b, stride_ksc_h, stride_vsc_b, stride_vsc_h,
    kv_batch_ptr, leftpad_k_ptr, rotary_cos_ptr, rotary_sin_ptr, stride_ro, seqlen_ro, cu_k_new_ptr,
    k_bscale_ptr, v_bscale_ptr, stride_bs_page, stride_bs_tok, stride_bs_h,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    stride_bt,
    seqlen_q_static, seqlen_k_static, seqlen_k_add, desc_rows_per_batch,
    num_heads_q, group_size, m_tiles, rows_per_split,
    softmax_scale, softcap, window_left, window_right, alibi_ptr, stride_alibi_b, sink_ptr,
    qv_ptr, stride_qvb, stride_qvs, stride_qvh,
    k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, stride_nb, stride_ns, stride_nh,
    rng_ptr, dropout_thr, dropout_scale, attention_chunk,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN_Q: tl.constexpr, VARLEN_K: tl.constexpr, HAS_SEQLENS_K: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_SCALED: tl.constexpr, KV_NVFP4: tl.constexpr,
    PACK_GQA: tl.constexpr, SPLIT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    USE_DESC: tl.constexpr, SP_OVERLAP: tl.constexpr, TILE_DTYPE: tl.constexpr,
    TRANS: tl.constexpr, RAW_SCORES: tl.constexpr, ALIBI: tl.constexpr, HAS_KV_BATCH: tl.constexpr = False,
    LEFTPAD_K: tl.constexpr = False, ROTARY_DIM: tl.constexpr = 0, ROTARY_INTERLEAVED: tl.constexpr = False,
    ROTARY_PER_TOKEN: tl.constexpr = False, VARLEN_K_NEW: tl.constexpr = False, PDL: tl.constexpr = False,
    HAS_SINK: tl.constexpr = False, HEAD_DIM_V: tl.constexpr = 0, HEAD_DIM_V_PAD: tl.constexpr = 0,
    HAS_QV: tl.constexpr = False, QKV_FP8: tl.constexpr = 0, FUSED_COMBINE: tl.constexpr = False,
    MERGE_ROWS: tl.constexpr = 1, MERGE_SPLITS: tl.constexpr = 1, APPEND_NEW: tl.constexpr = 0,
    VT_GAP: tl.constexpr = 0, BOX_IN_SEQ: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    CHUNK: tl.constexpr = False, AFTER_PRIOR: tl.constexpr = False,
):
    allow_dependent_launch(PDL)  # the split combine that follows (launch/forward.launch_combine)
    if AFTER_PRIOR:  # a programmatic dependent of the kernel before it: nothing is read before that grid is done
        gdc_wait()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = m_tiles - 1 - pid % m_tiles  # reverse order: causal tiles with the most work start first
    pid_bh = pid // m_tiles
    num_heads_prog = num_heads_q // group_size if PACK_GQA else num_heads_q
    b = pid_bh // num_heads_prog
    head = pid_bh % num_heads_prog  # the KV head when packing, else the query head
    head_kv = head if PACK_GQA else head // group_size
    # NVFP4 caches: KV_NVFP4 alone at NVFP4_PURE_ASM marks an e4m3 cache off sm_90 (quant.NVFP4_PURE_ASM)
    nvfp4_cache: tl.constexpr = KV_NVFP4 != 0 and KV_NVFP4 != NVFP4_PURE_ASM

    q_start, seqlen_q, k_start, seqlen_k = seq_extents(
        b, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seqlens_k_ptr, seqlen_q_static, seqlen_k_static, seqlen_k_add,
        VARLEN_Q, VARLEN_K, HAS_SEQLENS_K)
    if VARLEN_K_NEW:  # this sequence's appended tokens (FA3's cu_seqlens_k_new), never past the cache
        new = tl.load(cu_k_new_ptr + b + 1) - tl.load(cu_k_new_ptr + b)
        seqlen_k = tl.minimum(seqlen_k + new, seqlen_k_static)
    page_shift = 0
    if LEFTPAD_K:
        k_start = tl.minimum(tl.load(leftpad_k_ptr + b), seqlen_k)
        seqlen_k -= k_start
        if PAGE_SIZE > 0:  # key j of a paged cache sits at cache position k_start + j (inner.block_pages)
            page_shift = k_start
    kv_b = b  # the cache row of a contiguous cache
    if HAS_KV_BATCH:
        kv_b = tl.load(kv_batch_ptr + b)
    rows_total = seqlen_q * group_size if PACK_GQA else seqlen_q
    start_m = pid_m * BLOCK_M
    if start_m >= rows_total:
        return

    # ---- rows of this tile: (query token, query head) ---------------------------------------------------
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_ok = offs_m < rows_total
    if PACK_GQA:
        tok = offs_m // group_size
        head_q = head * group_size + offs_m % group_size
        last_row = tl.minimum(start_m + BLOCK_M, rows_total) - 1
        tok_min = start_m // group_size
        tok_max = last_row // group_size
    else:
        tok = offs_m
        head_q = head + tl.zeros([BLOCK_M], dtype=tl.int32)
        tok_min = start_m
        tok_max = tl.minimum(start_m + BLOCK_M, rows_total) - 1
    diag = seqlen_k - seqlen_q  # bottom-right alignment
    q_pos = tok + diag

    q_rows = (q_start + tok).to(tl.int64) * stride_qs + head_q.to(tl.int64) * stride_qh
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + q_rows[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if ROTARY_DIM > 0:
        ro_pos = tl.load(seqlens_k_ptr + b) + tl.zeros_like(tok)
        if ROTARY_PER_TOKEN:
            ro_pos += tok
        q = rotate_rows(q, q_ptr + b.to(tl.int64) * stride_qb + q_rows, ro_pos, row_ok, offs_d, rotary_cos_ptr,
                        rotary_sin_ptr, stride_ro, seqlen_ro, ROTARY_DIM, ROTARY_INTERLEAVED)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    qv = q  # not read without HAS_QV
    if HAS_QV:
        qv_rows = (q_start + tok).to(tl.int64) * stride_qvs + head_q.to(tl.int64) * stride_qvh
        qv = tl.load(qv_ptr + b.to(tl.int64) * stride_qvb + qv_rows[:, None] + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    q_unscale = 1.0
    k_scale_off = b * stride_ksc_b + head_kv * stride_ksc_h  # (b, head_kv)'s scales (KV_SCALED)
    v_scale_off = b * stride_vsc_b + head_kv * stride_vsc_h
    if QKV_FP8:  # e4m3 q: the dot takes its bytes as they are, the descale joins the logit scale
        q_unscale = tl.load(q_scale_ptr + b * stride_qsc_b + head_kv * stride_qsc_h)
    elif KV_SCALED:
        # Quantized caches widen exactly to fp16 (one conversion per pair; bf16 would take three), so the tiles
        # are fp16: q is scaled by a power of two that puts max|q| in [2^8, 2^9) (no overflow, full precision
        # down to 2^-22 of the max), undone in the logit scale.
        amax = _finite_amax(q)
        if HAS_QV:  # FP8 latent: s = k_scale (q . k8 + qv (v_scale / k_scale) . v8), both parts under one 2^k
            qv = qv.to(tl.float32) * (tl.load(v_scale_ptr + v_scale_off) / tl.load(k_scale_ptr + k_scale_off))
            amax = tl.maximum(amax, _finite_amax(qv))
        q_scale, q_unscale = _fp16_range(amax)
        q = q.to(tl.float32) * q_scale
        if HAS_QV:
            qv = qv * q_scale
    q = q.to(TILE_DTYPE)
    qv = qv.to(TILE_DTYPE)
    if TRANS:  # transposed products (see attn_inner): q^T and acc^T
        q = tl.trans(q)
        if TRANS == TRANS_PERM_K:
            q = perm_head_dim(q, 0)
        if HAS_QV:
            qv = tl.trans(qv)
        acc = tl.zeros([HEAD_DIM_V_PAD, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)

    # ---- KV block range: [n_lo, n_hi) needed at all, [full_lo, full_hi) visible to every row --------------
    n_lo, full_lo, full_hi, n_hi = kv_block_range(tok_min, tok_max, diag, seqlen_k, window_left, window_right,
                                                  HAS_LEFT, HAS_RIGHT, BLOCK_N, attention_chunk, CHUNK)
    if SPLIT:
        # Splits divide this sequence's own block range, so short sequences in a long cache stay balanced.
        split_blocks = tl.cdiv(n_hi - n_lo, tl.num_programs(1))
        s_lo = n_lo + split * split_blocks
        s_hi = tl.minimum(s_lo + split_blocks, n_hi)
    else:
        s_lo = n_lo
        s_hi = n_hi

    desc_row0 = 0
    h64 = head_kv.to(tl.int64)
    k_sbase = k_bscale_ptr + h64 * stride_bs_h  # NVFP4 block scales (unused otherwise)
    v_sbase = v_bscale_ptr + h64 * stride_bs_h
    if not PAGE_SIZE > 0:
        k_sbase += kv_b.to(tl.int64) * stride_bs_page + k_start.to(tl.int64) * stride_bs_tok
        v_sbase += kv_b.to(tl.int64) * stride_bs_page + k_start.to(tl.int64) * stride_bs_tok
    if USE_DESC:  # k_ptr / v_ptr are TMA descriptors over [rows, Hkv, D] (paged: the pool's pages x PAGE_SIZE rows)
        k_base = k_ptr
        v_base = v_ptr
        if PAGE_SIZE > 0:
            bt_ptr = block_table_ptr + b.to(tl.int64) * stride_bt
        else:
            desc_row0 = kv_b * desc_rows_per_batch + k_start
            bt_ptr = block_table_ptr
    elif PAGE_SIZE > 0:  # paged: [num_pages, PAGE_SIZE, Hkv, D]
        k_base = k_ptr + head_kv.to(tl.int64) * stride_kh
        v_base = v_ptr + head_kv.to(tl.int64) * stride_vh
        bt_ptr = block_table_ptr + b.to(tl.int64) * stride_bt
    else:
        b64, k0, h64 = kv_b.to(tl.int64), k_start.to(tl.int64), head_kv.to(tl.int64)
        k_base = k_ptr + b64 * stride_kb + k0 * stride_ks + h64 * stride_kh
        v_base = v_ptr + b64 * stride_vb + k0 * stride_vs + h64 * stride_vh
        bt_ptr = block_table_ptr
    if APPEND_NEW > 0:  # this call's new tokens (seqlen_k_add of them, at most APPEND_NEW) go into the cache first
        fp8_cache: tl.constexpr = KV_SCALED and not nvfp4_cache  # quantized with this KV head's scales
        k_scale = 1.0
        v_scale = 1.0
        if fp8_cache:
            k_scale = tl.load(k_scale_ptr + k_scale_off)
            v_scale = tl.load(v_scale_ptr + v_scale_off)
        append_in_range(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, b, kv_b, head_kv,
                        tl.load(seqlens_k_ptr + b), seqlen_k_add, s_lo * BLOCK_N, s_hi * BLOCK_N, seqlen_k_static,
                        stride_nb, stride_ns, stride_nh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                        stride_vh, bt_ptr, k_scale, v_scale, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD,
                        APPEND_NEW, PAGE_SIZE, USE_DESC and TILE_DTYPE != tl.float32, fp8_cache)
    v_row0 = desc_row0  # V's first row in its descriptor: K's, or V^T's first column (16-byte aligned)
    if QKV_FP8 >= FP8_V_T:  # V^T [Hkv, D, width] (stride_vs: D's): launch/tensors.values_t_column
        v_row0 = values_t_column(kv_b * desc_rows_per_batch + k_start, kv_b, VT_GAP)
        if QKV_FP8 == FP8_V_T:  # by pointers, K's descriptor or not
            v_base = v_ptr + v_row0.to(tl.int64) + head_kv.to(tl.int64) * stride_vh

    if KV_SCALED:
        # FP8 cache: K = k_scale * K8, V = v_scale * V8 (NVFP4: the per-tensor global scales). Both factor out of
        # the dots, so tiles are only widened (exactly) and the scales fold into the logit scale and the final
        # normalisation.
        softmax_scale = softmax_scale * q_unscale * tl.load(k_scale_ptr + k_scale_off)
        if nvfp4_cache:  # unpacked NVFP4 tiles are e2m1 * scale / E2M1_UNIT
            softmax_scale = softmax_scale * E2M1_UNIT
    qk_scale, softcap_scale = logit_scales(softmax_scale, softcap, SOFTCAP)
    alibi_slope = 0.0  # not read without ALIBI
    if ALIBI:  # each row's slope in log2 units, like the scores (pack-GQA rows differ in head)
        alibi_slope = tl.load(alibi_ptr + b * stride_alibi_b + head_q) * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    tl.static_assert(not (DROPOUT and (PACK_GQA or SPLIT or BOX_IN_SEQ)), "dropout: prefill tiles of one head")
    drop_bh = b * num_heads_q + head  # dropout's head row: (sequence, query head)
    # Three phases: masked blocks at the window's left edge, unmasked blocks, masked blocks at the diagonal/end.
    # (Only the bounds and MASK differ; a static loop over them would hide which phase is which.)
    if HAS_LEFT or CHUNK:
        acc, m_i, l_i = attn_inner(
            acc, m_i, l_i, q, q_pos, k_base, v_base, k_sbase, v_sbase, bt_ptr, stride_kb, stride_ks, stride_vb,
            stride_vs, stride_bs_page, stride_bs_tok, desc_row0, v_row0, head_kv, offs_d, seqlen_k,
            tl.maximum(s_lo, n_lo) * BLOCK_N, tl.minimum(s_hi, full_lo) * BLOCK_N, qk_scale, softcap_scale,
            window_left, window_right, alibi_slope, HEAD_DIM, BLOCK_N, True, PAGE_SIZE, USE_DESC, KV_NVFP4, HAS_LEFT,
            HAS_RIGHT, SOFTCAP, SP_OVERLAP, TILE_DTYPE, TRANS, RAW_SCORES, ALIBI, qv, offs_dv, HEAD_DIM_V, HAS_QV,
            QKV_FP8, rng_ptr=rng_ptr, drop_rows=tok, drop_bh=drop_bh, drop_thr=dropout_thr, DROPOUT=DROPOUT,
            chunk=attention_chunk, CHUNK=CHUNK, shift=page_shift)
    acc, m_i, l_i = attn_inner(
        acc, m_i, l_i, q, q_pos, k_base, v_base, k_sbase, v_sbase, bt_ptr, stride_kb, stride_ks, stride_vb,
        stride_vs, stride_bs_page, stride_bs_tok, desc_row0, v_row0, head_kv, offs_d, seqlen_k,
        tl.maximum(s_lo, full_lo) * BLOCK_N, tl.minimum(s_hi, full_hi) * BLOCK_N, qk_scale, softcap_scale,
        window_left, window_right, alibi_slope, HEAD_DIM, BLOCK_N, False, PAGE_SIZE, USE_DESC, KV_NVFP4, HAS_LEFT,
        HAS_RIGHT, SOFTCAP, SP_OVERLAP, TILE_DTYPE, TRANS, RAW_SCORES, ALIBI, qv, offs_dv, HEAD_DIM_V, HAS_QV,
        QKV_FP8, rng_ptr=rng_ptr, drop_rows=tok, drop_bh=drop_bh, drop_thr=dropout_thr, DROPOUT=DROPOUT,
        chunk=attention_chunk, CHUNK=CHUNK, shift=page_shift)
    # BOX_IN_SEQ: a compiled copy of this phase's loop per case, boxes inside the sequence (no V mask,
    # inner._kv_tile) when it holds a block, V tiles zeroed past it otherwise; the runtime test picks one.
    for boxed in tl.static_range(2 if BOX_IN_SEQ else 1):
        if (boxed == 1) == (BOX_IN_SEQ and seqlen_k >= BLOCK_N):
            acc, m_i, l_i = attn_inner(
                acc, m_i, l_i, q, q_pos, k_base, v_base, k_sbase, v_sbase, bt_ptr, stride_kb, stride_ks, stride_vb,
                stride_vs, stride_bs_page, stride_bs_tok, desc_row0, v_row0, head_kv, offs_d, seqlen_k,
                tl.maximum(s_lo, full_hi) * BLOCK_N, tl.minimum(s_hi, n_hi) * BLOCK_N, qk_scale, softcap_scale,
                window_left, window_right, alibi_slope, HEAD_DIM, BLOCK_N, True, PAGE_SIZE, USE_DESC, KV_NVFP4,
                HAS_LEFT, HAS_RIGHT, SOFTCAP, SP_OVERLAP, TILE_DTYPE, TRANS, RAW_SCORES, ALIBI, qv, offs_dv,
                HEAD_DIM_V, HAS_QV, QKV_FP8, boxed == 1, rng_ptr=rng_ptr, drop_rows=tok, drop_bh=drop_bh,
                drop_thr=dropout_thr, DROPOUT=DROPOUT, chunk=attention_chunk, CHUNK=CHUNK, shift=page_shift)

    # ---- epilogue: normalise; rows that saw no key give out = 0 and lse = -inf (with a sink: lse = sink) --
    m_i = fp8_row_max(m_i, QKV_FP8)
    acc_scale = 1.0
    if HAS_SINK and not SPLIT:  # split partials stay sink-free: attn_combine adds the sink once per row
        m_i, l_i, acc_scale = _fold_sink(m_i, l_i, tl.load(sink_ptr + head_q) * LOG2E)
    seen = l_i > 0.0
    inv_l = tl.where(seen, acc_scale / tl.where(seen, l_i, 1.0), 0.0)
    if DROPOUT:
        inv_l = inv_l * dropout_scale
    if KV_SCALED:
        inv_l = inv_l * tl.load(v_scale_ptr + v_scale_off)
        if nvfp4_cache:
            inv_l = inv_l * E2M1_UNIT
    if TRANS:
        acc = tl.trans(acc)
    o = acc * inv_l[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / LOG2E, float("-inf"))
    d_ok = offs_dv[None, :] < HEAD_DIM_V
    if SPLIT:
        # o_part [splits, B, Sq, Hq, Dv] and lse_part [splits, B, Sq, Hq], contiguous fp32; rows_per_split = B*Sq*Hq.
        part = split.to(tl.int64) * rows_per_split + ((b * seqlen_q_static + tok) * num_heads_q + head_q).to(tl.int64)
        tl.store(o_part_ptr + part[:, None] * HEAD_DIM_V + offs_dv[None, :], o, mask=row_ok[:, None] & d_ok)
        tl.store(lse_part_ptr + part, lse, mask=row_ok)
        if FUSED_COMBINE:
            merge_tile_splits(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, sink_ptr, counter_ptr, pid,
                              tl.num_programs(1), rows_per_split, start_m, tl.minimum(start_m + BLOCK_M, rows_total),
                              b.to(tl.int64), head, group_size, seqlen_q_static, num_heads_q, stride_ob, stride_os,
                              stride_oh, stride_lb, stride_lh, stride_ls, HEAD_DIM_V, HEAD_DIM_V_PAD, MERGE_ROWS,
                              MERGE_SPLITS, PACK_GQA, HAS_SINK, TILE_DTYPE == tl.float32)
    else:
        o_rows = (q_start + tok).to(tl.int64) * stride_os + head_q.to(tl.int64) * stride_oh
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + o_rows[:, None] + offs_dv[None, :]
        interpreted: tl.constexpr = TILE_DTYPE == tl.float32  # tiles are fp32 only in the interpreter
        tl.store(o_ptrs, store_cast(o, out_ptr.dtype.element_ty, interpreted), mask=row_ok[:, None] & d_ok)
        l_ptrs = lse_ptr + b.to(tl.int64) * stride_lb + head_q.to(tl.int64) * stride_lh \
            + (q_start + tok).to(tl.int64) * stride_ls
        tl.store(l_ptrs, lse, mask=row_ok)
