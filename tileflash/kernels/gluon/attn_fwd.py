"""Prefill forward for sm_90 with warp specialisation (FA3's structure), written in Gluon.

Why a second forward: the Triton kernel (attn_fwd.py) runs loads, both products and the softmax of a tile in one
instruction stream per warpgroup, and Triton's own warp specialisation does not apply to it on sm_90 (notebook,
session 8); it stayed at 0.78-0.86x cuDNN for d128. Gluon states the partitions and the pipeline explicitly:

  producer (1 warp, 24 registers): TMA loads of the two Q tiles, then K and V blocks into two rings of K_STAGES
      and V_STAGES stages (k_ready / v_ready carry the transaction bytes; k_empty / v_empty count one arrival per
      consumer). The rings are separate because S_j and PV_{j-1} run together: K_j's stage is free once S_j has
      retired, half a step before V_{j-1}'s, so its next load starts that much earlier (with one shared ring a
      2-stage pipeline had no slack at all: the load of block j+1 began when step j ended, where it was needed).
  consumers (2 warpgroups, 240 registers each): 64 query rows each of the CTA's 128. Per KV block j:
      S_j = Q K_j^T (shared-memory operands) is issued, then O += P_{j-1} V_{j-1} (P from registers); the softmax
      of S_j runs while that PV product is still in flight (FA3's intra-warpgroup overlap), and the two warpgroups
      interleave their products and softmaxes on the SM's tensor cores without further synchronisation.

Persistent CTAs (PERSISTENT, for short rows: plan.prefill.fwd_ws_config): one CTA per SM walks units of two tiles
(see _tile); the rings run on across tiles, a consumer releases its Q buffer as soon as its last S product has
retired, so the next tile's Q and first K block load during the last PV product and the epilogue, which stores O
from registers (Q's buffer, the TMA store's staging otherwise, may already hold the next Q). With Q_BUFS = 2 each
warpgroup alternates two Q buffers, so a tile's Q loads while the tile before it still runs (d64, where shared
memory has room: +0.6-3.2%, run 190).

Layout: q, out [B, Sq, Hq, D] and k, v [B, Sk, Hkv, D] through 4-D TMA descriptors with blocks [1, rows, 1, D], so
rows past a sequence's end arrive as zeros and are never stored (no row masks on loads; the persistent epilogue
masks its stores); lse [B, Hq, Sq] float32 contiguous. Varlen batches (VARLEN): the packed [total, H, D] tensors
as [1, total, H, D], each tile's rows and keys offset by its sequence's start; rows past a sequence's end then
load the next sequence's rows, so keys there are masked (the last partial block of a sequence always takes the
mask) and O is stored from registers with row masks. Scope (plan/prefill.ws_forward_config decides, else the
Triton kernel runs): 16-bit dtypes, head dims 64, 128 and 256, or q, k 192 wide with v 128 (DeepSeek-V3's prefill:
q's and k's columns arrive as a 128-wide block and a 64-wide tail, two S products into one accumulator, and O, not
Q's width, is stored from registers), or FP8 (e4m3 q, k and V^T with FA3's descales, d128 and d256: P through shared
memory, each block's P V added into the fp32 accumulator, at d256 in two 128-column parts), no window or softcap
beyond causal, a positive softmax scale, a learnable sink or none (HAS_SINK: fp32 [Hq], folded into each row's sum
once, in the epilogue); varlen without seqused_k or a paged cache. Gluon has no CPU
interpreter: the CPU suite checks this kernel's compilation for sm_90 (tests/sm90_compile_check.py) and the GPU
suite its results.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .common import barrier, opaque_zero, packed_sequence
from ..triton.masks import LOG2E

ROWS_PER_WARPGROUP = 64  # wgmma's M: each consumer warpgroup owns 64 query rows
WG_ROWS = gl.constexpr(ROWS_PER_WARPGROUP)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _tile(step, m_tiles, num_heads_q, group_size, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
          PERSISTENT: gl.constexpr, VARLEN: gl.constexpr):
    """(batch coordinate of the descriptors, query head, KV head, first row, valid) of this CTA's step-th tile, then
    its sequence's (first query row, query rows, first key, keys) as _gluon.packed_sequence gives them, and the
    sequence's index; producer and consumers walk the same tiles. With VARLEN the tiles cover the longest sequence:
    rows past this one's are not valid.

    One tile per CTA (step 0 only): the heaviest causal tiles of a head start first and the hardware hands the next
    CTA to whichever SM frees up. Persistent CTAs walk units of two tiles of one head, the i-th heaviest and the
    i-th lightest, so every unit holds the same number of causal blocks and a static round robin over units stays
    balanced while the CTAs in flight share few heads' K/V in L2 (with an odd count of tiles the middle one is a
    unit alone: its second slot is not valid)."""
    if PERSISTENT:
        unit = gl.program_id(0) + (step // 2) * gl.num_programs(0)
        half = (m_tiles + 1) // 2
        i = unit % half
        rank = gl.where(step % 2 == 0, i, m_tiles - 1 - i)  # 0 = the heaviest tile (the last rows)
        bh = unit // half
        valid = (step % 2 == 0) | (rank != i)
    else:
        tile = gl.program_id(0) + step
        bh = tile // m_tiles
        rank = tile % m_tiles
        valid = tile >= 0
    h = bh % num_heads_q
    start_m = (m_tiles - 1 - rank) * (2 * WG_ROWS)
    seq = bh // num_heads_q
    bd, q0, sq, k0, sk = packed_sequence(seq, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    if VARLEN:
        valid = valid & (start_m < sq)
    return bd, h, h // group_size, start_m, valid, q0, sq, k0, sk, seq


@gluon.jit
def _tile_count(num_units, PERSISTENT: gl.constexpr):
    """Tiles this CTA walks (grid: min(units, SMs) persistent CTAs, else one CTA per tile)."""
    if PERSISTENT:
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        return 2 * ((num_units - pid + nprog - 1) // nprog)
    return gl.to_tensor(1)


@gluon.jit
def _block_range(start_m, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """KV blocks [0, n_hi) that rows [start_m, start_m + 128) need; blocks >= full_hi need the mask (past Sk or
    past the diagonal of the tile's first row; causal is bottom-right aligned: row i sees keys <= i + Sk - Sq)."""
    full_hi = seqlen_k // BLOCK_N
    n_hi = (seqlen_k + BLOCK_N - 1) // BLOCK_N
    if CAUSAL:
        diag = seqlen_k - seqlen_q
        keys = gl.minimum(gl.maximum(start_m + 2 * WG_ROWS + diag, 0), seqlen_k)  # keys the last row sees
        n_hi = (keys + BLOCK_N - 1) // BLOCK_N
        full_hi = gl.minimum(gl.maximum(start_m + diag + 1, 0) // BLOCK_N, full_hi)
    return gl.minimum(full_hi, n_hi), n_hi


@gluon.jit
def _producer(q_desc, qt_desc, k_desc, kt_desc, v_desc, q_smem, qt_smem, k_bufs, kt_bufs, v_bufs, q_bar, q_empty,
              k_ready, v_ready, k_empty, v_empty, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, m_tiles,
              num_heads_q, group_size, num_units, vt_gap, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
              TAIL: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
              Q_BUFS: gl.constexpr, PERSISTENT: gl.constexpr, VARLEN: gl.constexpr, FP8: gl.constexpr):
    it = 0  # K/V blocks loaded so far: the position in both rings
    tiles_done = 0
    for step in range(_tile_count(num_units, PERSISTENT)):
        bd, h, hk, start_m, valid, q0, sq, k0, sk, seq = _tile(step, m_tiles, num_heads_q, group_size, cu_seqlens_q,
                                                               cu_seqlens_k, seqlen_q, seqlen_k, PERSISTENT, VARLEN)
        if valid:
            qb = (tiles_done % Q_BUFS) * 2
            for w in gl.static_range(2):
                # Q's buffer is free once the consumer's last S product of the tile before (Q_BUFS tiles before)
                # retired.
                mbarrier.wait(q_empty.index(qb + w), ((tiles_done // Q_BUFS) & 1) ^ 1)  # fresh: parity 1 passes
                row = q0 + start_m + w * WG_ROWS
                if TAIL:  # q's columns [HEAD_DIM, HEAD_DIM + TAIL) in a buffer of their own, on the same barrier
                    mbarrier.expect(q_bar.index(qb + w), q_desc.block_type.nbytes + qt_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(qt_desc, [bd, row, h, HEAD_DIM], q_bar.index(qb + w),
                                                    qt_smem.index(qb + w))
                else:
                    mbarrier.expect(q_bar.index(qb + w), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [bd, row, h, 0], q_bar.index(qb + w), q_smem.index(qb + w))
            full_hi, n_hi = _block_range(start_m, sq, sk, CAUSAL, BLOCK_N)
            v0 = k0  # the sequence's first key row in V, or its first column in FP8's V^T
            if FP8:  # launch/tensors.values_t_column of the sequence's first merged key row
                v0 = (((k0 if VARLEN else seq * seqlen_k) + 15) // 16) * 16 + vt_gap * seq
            for j in range(n_hi):
                ks = it % K_STAGES
                mbarrier.wait(k_empty.index(ks), ((it // K_STAGES) & 1) ^ 1)
                if TAIL:
                    mbarrier.expect(k_ready.index(ks), k_desc.block_type.nbytes + kt_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(kt_desc, [bd, k0 + j * BLOCK_N, hk, HEAD_DIM],
                                                    k_ready.index(ks), kt_bufs.index(ks))
                else:
                    mbarrier.expect(k_ready.index(ks), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [bd, k0 + j * BLOCK_N, hk, 0], k_ready.index(ks),
                                                k_bufs.index(ks))
                vs = it % V_STAGES
                mbarrier.wait(v_empty.index(vs), ((it // V_STAGES) & 1) ^ 1)
                mbarrier.expect(v_ready.index(vs), v_desc.block_type.nbytes)
                if FP8:  # V^T [Hkv, D, width]: tokens contiguous, the K-major operand FP8 products read
                    tma.async_copy_global_to_shared(v_desc, [hk, 0, v0 + j * BLOCK_N], v_ready.index(vs),
                                                    v_bufs.index(vs))
                else:
                    tma.async_copy_global_to_shared(v_desc, [bd, v0 + j * BLOCK_N, hk, 0], v_ready.index(vs),
                                                    v_bufs.index(vs))
                it += 1
            tiles_done += 1


@gluon.jit
def _scores(q, qt, k_bufs, kt_bufs, ks, s_init, HEAD_DIM: gl.constexpr, TAIL: gl.constexpr, BLOCK_N: gl.constexpr):
    """S = Q K^T of K stage ks, issued (async): over q's first HEAD_DIM columns, then, with a TAIL, over the rest
    into the same accumulator (a head dim of 192 as 128 + 64: no product over padding)."""
    s = warpgroup_mma(q, k_bufs.index(ks).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_init, use_acc=False,
                      is_async=True)
    if TAIL:
        s = warpgroup_mma(qt, kt_bufs.index(ks).reshape([BLOCK_N, TAIL]).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _masked(s, j, row0, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Scores of keys a row may not see (past Sk, or past its diagonal) set to -inf. The column and row indices
    carry a zero the compiler cannot see: otherwise it hoists loop-invariant parts of the causal compare out of the
    block loop, and the persistent d128 causal tile spilled them (184 bytes of stack under triton 3.6, 17 reloads
    per block; 0 with the zero; 3.7.1: 40 -> 24 bytes)."""
    z = opaque_zero(j)
    cols = j * BLOCK_N + z + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
    ok = gl.expand_dims(cols < seqlen_k, 0)
    if CAUSAL:
        rows = row0 + z + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s.type.layout))
        ok = ok & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + seqlen_k - seqlen_q, 1))
    return gl.where(ok, s, float("-inf"))


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, P_SHIFT: gl.constexpr = 0.0):
    """Online softmax of raw scores s (qk_scale = softmax_scale * log2(e) > 0, so the scale applies after the row
    max and joins the subtraction in one FMA). A row with only masked keys so far keeps m = -inf and subtracts 0,
    so its p and alpha are 0, not NaN. P_SHIFT (FP8: the Triton kernel's P_FP8_LOG2): p and l carry 2^P_SHIFT, so
    P spans [0, 2^8] and stays clear of e4m3's subnormals."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    m_sub = m_safe
    if P_SHIFT != 0.0:
        m_sub = m_safe - P_SHIFT
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_safe)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _p_operand(p, p_buf, p_layout: gl.constexpr, FP8: gl.constexpr):
    """P (in q's dtype) as the PV product's first operand: registers in wgmma's A layout, or for FP8 this
    warpgroup's shared-memory buffer (an 8-bit register operand cannot be kept live across the asynchronous
    product: triton's wgmma wait takes 16- and 32-bit values only), stored, fenced and complete in every warp.
    Kept in registers anyway (a volatile use after the wait) it ran 16-24% slower (run 245): triton converts S's
    accumulator layout to the 8-bit A layout through shared memory, with two barriers a step."""
    if FP8:
        p_buf.store(p)
        fence_async_shared()
        barrier()
        a = p_buf
    else:
        a = gl.convert_layout(p, p_layout)
    return a


@gluon.jit
def _values(v_bufs, i, BLOCK_N: gl.constexpr, HEAD_DIM_V: gl.constexpr, FP8: gl.constexpr, part=0,
            PARTS: gl.constexpr = 1):
    """V stage i as the PV product's [BLOCK_N, HEAD_DIM_V] operand: rows as loaded, or FP8's V^T tile read
    transposed (K-major, as FP8 products need); with PARTS > 1 (FP8) its columns [part * W, (part + 1) * W), W =
    HEAD_DIM_V / PARTS."""
    if FP8:
        vt = v_bufs.index(i).reshape([HEAD_DIM_V, BLOCK_N])
        if PARTS > 1:
            vt = vt.slice(part * (HEAD_DIM_V // PARTS), HEAD_DIM_V // PARTS)
        v = vt.permute((1, 0))
    else:
        v = v_bufs.index(i).reshape([BLOCK_N, HEAD_DIM_V])
    return v


# FP8's block product P V (two-level) in parts of at most this many columns: at d256 a whole 64 x 256 fp32 product
# beside the accumulator took 256 registers a thread and spilled 352-592 bytes (sm_90 compile, triton 3.6)
FP8_PV_COLS = gl.constexpr(128)


@gluon.jit
def _add_part(acc, pv, part, PARTS: gl.constexpr):
    """acc [rows, PARTS * W] plus pv [rows, W] on columns [part * W, (part + 1) * W) (registers only: wgmma's
    accumulator layout holds a thread's columns of each W-wide part in order)."""
    if PARTS == 1:
        out = acc + pv
    else:
        gl.static_assert(PARTS == 2, "two parts")
        rows: gl.constexpr = acc.shape[0]
        w: gl.constexpr = pv.shape[1]
        lo, hi = gl.split(gl.permute(gl.reshape(acc, [rows, 2, w]), [0, 2, 1]))
        if part == 0:
            lo = lo + gl.convert_layout(pv, lo.type.layout, assert_trivial=True)
        else:
            hi = hi + gl.convert_layout(pv, hi.type.layout, assert_trivial=True)
        out = gl.convert_layout(gl.reshape(gl.permute(gl.join(lo, hi), [0, 2, 1]), [rows, 2 * w]), acc.type.layout,
                                assert_trivial=True)
    return out


@gluon.jit
def _pv_fp8(p, v_bufs, i, acc, pv_init, pv, BLOCK_N: gl.constexpr, HEAD_DIM_V: gl.constexpr, PARTS: gl.constexpr):
    """FP8's two-level P V of stage i once part 0's product pv (issued by the caller, from zero) is in flight:
    wait for it and add it into the fp32 acc, then each further part's (issued, waited, added)."""
    acc = _add_part(acc, warpgroup_mma_wait(0, deps=(pv,)), 0, PARTS)
    for part in gl.static_range(1, PARTS):
        pv = warpgroup_mma(p, _values(v_bufs, i, BLOCK_N, HEAD_DIM_V, True, part, PARTS), pv_init, use_acc=False,
                           is_async=True)
        acc = _add_part(acc, warpgroup_mma_wait(0, deps=(pv,)), part, PARTS)
    return acc


@gluon.jit
def _normaliser(m_i, l_i, sink2, HAS_SINK: gl.constexpr):
    """(m_i, l_i, the factor acc takes before 1 / l_i) with the sink sink2 folded in (log2 units, like m_i): the
    Triton kernel's _fold_sink. A row that saw no key gets m = sink, l = 1, factor 0 (out = 0, lse = sink)."""
    if HAS_SINK:
        m_new = gl.maximum(m_i, sink2)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a -inf sink on an unseen row: 0, not NaN
        alpha = gl.exp2(m_i - m_safe)
        return m_new, l_i * alpha + gl.exp2(sink2 - m_safe), alpha
    return m_i, l_i, gl.full_like(l_i, 1.0)


@gluon.jit
def _consumer(q_desc, o_desc, out_ptr, lse_ptr, q_smem, qt_smem, k_bufs, kt_bufs, v_bufs, p_bufs, q_bar, q_empty,
              k_ready, v_ready, k_empty, v_empty, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, m_tiles, num_heads_q,
              group_size, num_units, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, qk_scale, sink_ptr,
              q_scale_ptr, k_scale_ptr, v_scale_ptr, stride_qsc_b, stride_qsc_h, stride_ksc_b, stride_ksc_h,
              stride_vsc_b, stride_vsc_h, WG: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
              TAIL: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
              V_STAGES: gl.constexpr, Q_BUFS: gl.constexpr, PERSISTENT: gl.constexpr, VARLEN: gl.constexpr,
              HAS_SINK: gl.constexpr, FP8: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    out_dtype: gl.constexpr = out_ptr.dtype.element_ty
    K_INSTR: gl.constexpr = 32 if FP8 else 16  # wgmma's K: 256 bits of each operand
    P_SHIFT: gl.constexpr = 8.0 if FP8 else 0.0
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_INSTR])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM_V, K_INSTR])
    PV_PARTS: gl.constexpr = (HEAD_DIM_V + FP8_PV_COLS - 1) // FP8_PV_COLS if FP8 else 1
    pv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM_V // PV_PARTS, K_INSTR])
    # 16-bit P feeds the PV product from registers: S's accumulator layout maps onto wgmma's A fragments (FP8's P
    # goes through shared memory: _p_operand).
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_init = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)  # ignored (use_acc=False): only its layout counts
    pv_init = gl.zeros([WG_ROWS, HEAD_DIM_V // PV_PARTS], gl.float32, pv_layout)  # FP8's block P V, likewise
    p_buf = p_bufs.index(WG)  # FP8's P (unused otherwise)
    it = 0  # K/V blocks consumed so far: the position in both rings
    tiles_done = 0
    for step in range(_tile_count(num_units, PERSISTENT)):
        bd, h, hk, start_m, valid, q0, sq, k0, sk, seq = _tile(step, m_tiles, num_heads_q, group_size, cu_seqlens_q,
                                                               cu_seqlens_k, seqlen_q, seqlen_k, PERSISTENT, VARLEN)
        if valid:
            tile_scale = qk_scale
            v_unscale = 1.0  # (FP8 only)
            if FP8:  # FA3's descales of (sequence, KV head): scores q_descale k_descale (q8 k8^T), out v_descale
                tile_scale = qk_scale * gl.load(q_scale_ptr + seq * stride_qsc_b + hk * stride_qsc_h) \
                    * gl.load(k_scale_ptr + seq * stride_ksc_b + hk * stride_ksc_h)
                v_unscale = gl.load(v_scale_ptr + seq * stride_vsc_b + hk * stride_vsc_h)
            sink2 = 0.0
            if HAS_SINK:  # loaded at the tile's start: its latency hides behind the loop, not the epilogue's
                sink2 = gl.load(sink_ptr + h) * LOG2E
            full_hi, n_hi = _block_range(start_m, sq, sk, CAUSAL, BLOCK_N)
            row0 = start_m + WG * WG_ROWS
            m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([WG_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([WG_ROWS, HEAD_DIM_V], gl.float32, o_layout)
            qi = (tiles_done % Q_BUFS) * 2 + WG
            q = q_smem.index(qi).reshape([WG_ROWS, HEAD_DIM])
            qt = q  # q's TAIL columns, if any
            if TAIL:
                qt = qt_smem.index(qi).reshape([WG_ROWS, TAIL])
            mbarrier.wait(q_bar.index(qi), (tiles_done // Q_BUFS) & 1)
            if n_hi > 0:
                ks = it % K_STAGES
                mbarrier.wait(k_ready.index(ks), (it // K_STAGES) & 1)
                s = _scores(q, qt, k_bufs, kt_bufs, ks, s_init, HEAD_DIM, TAIL, BLOCK_N)
                s = warpgroup_mma_wait(0, deps=(s,))
                mbarrier.arrive(k_empty.index(ks), count=1)
                if full_hi == 0:
                    s = _masked(s, 0, row0, sq, sk, CAUSAL, BLOCK_N)
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, tile_scale, P_SHIFT)
                p = _p_operand(p.to(dtype), p_buf, p_layout, FP8)
                for j in range(1, n_hi):
                    ks = (it + j) % K_STAGES
                    prev = (it + j - 1) % V_STAGES
                    mbarrier.wait(k_ready.index(ks), ((it + j) // K_STAGES) & 1)
                    mbarrier.wait(v_ready.index(prev), ((it + j - 1) // V_STAGES) & 1)
                    s = _scores(q, qt, k_bufs, kt_bufs, ks, s_init, HEAD_DIM, TAIL, BLOCK_N)
                    if FP8:  # two-level: each block's product from zero, added into the fp32 acc below
                        pv = warpgroup_mma(p, _values(v_bufs, prev, BLOCK_N, HEAD_DIM_V, FP8, 0, PV_PARTS), pv_init,
                                           use_acc=False, is_async=True)
                    else:
                        acc = warpgroup_mma(p, _values(v_bufs, prev, BLOCK_N, HEAD_DIM_V, FP8), acc, is_async=True)
                    s = warpgroup_mma_wait(1, deps=(s,))  # products retire in order: S_j is done, PV_{j-1} may not be
                    mbarrier.arrive(k_empty.index(ks), count=1)
                    if j >= full_hi:
                        s = _masked(s, j, row0, sq, sk, CAUSAL, BLOCK_N)
                    p_next, m_i, l_i, alpha = _softmax(s, m_i, l_i, tile_scale, P_SHIFT)
                    if FP8:  # (P in shared memory: waiting for the product frees its buffer)
                        p_next = p_next.to(dtype)  # before the wait (run 243); after it: the same (run 310)
                        acc = _pv_fp8(p, v_bufs, prev, acc, pv_init, pv, BLOCK_N, HEAD_DIM_V, PV_PARTS)
                    else:
                        acc, p = warpgroup_mma_wait(0, deps=(acc, p))  # p stays live until its product read it
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                    p = _p_operand(p_next.to(dtype), p_buf, p_layout, FP8)
                if PERSISTENT:
                    mbarrier.arrive(q_empty.index(qi), count=1)  # every S product of this tile has retired
                last = (it + n_hi - 1) % V_STAGES
                mbarrier.wait(v_ready.index(last), ((it + n_hi - 1) // V_STAGES) & 1)
                if FP8:
                    pv = warpgroup_mma(p, _values(v_bufs, last, BLOCK_N, HEAD_DIM_V, FP8, 0, PV_PARTS), pv_init,
                                       use_acc=False, is_async=True)
                    acc = _pv_fp8(p, v_bufs, last, acc, pv_init, pv, BLOCK_N, HEAD_DIM_V, PV_PARTS)
                else:
                    acc = warpgroup_mma(p, _values(v_bufs, last, BLOCK_N, HEAD_DIM_V, FP8), acc, is_async=True)
                    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
                mbarrier.arrive(v_empty.index(last), count=1)
                it += n_hi
            elif PERSISTENT:
                mbarrier.arrive(q_empty.index(qi), count=1)

            # Epilogue: rows that saw no key give out = 0 and lse = -inf (with a sink: lse = sink).
            if FP8:  # l_i carries 2^P_SHIFT; out takes v's descale
                m_i = m_i - P_SHIFT
            m_i, l_i, acc_scale = _normaliser(m_i, l_i, sink2, HAS_SINK)
            if FP8:
                acc_scale = acc_scale * v_unscale
            seen = l_i > 0.0
            inv_l = gl.where(seen, acc_scale / gl.where(seen, l_i, 1.0), 0.0)
            o = (acc * gl.expand_dims(gl.convert_layout(inv_l, o_rows), 1)).to(out_dtype)
            lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
            rows = row0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
            gl.store(lse_ptr + bd.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q0 + rows, lse,
                     mask=rows < sq)
            if PERSISTENT or VARLEN or TAIL or HEAD_DIM_V != HEAD_DIM or FP8:
                # Stored from registers: Q's buffer already holds (or receives) the next tile's Q; packed rows
                # past a sequence's end belong to the next one, which a TMA store would overwrite; O's width or
                # dtype is not Q's buffer's.
                o_rows_i = gl.expand_dims(row0 + gl.arange(0, WG_ROWS, layout=o_rows), 1)
                cols = gl.expand_dims(gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout)), 0)
                ptrs = (out_ptr + bd.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
                        + (q0 + o_rows_i).to(gl.int64) * stride_os + cols)
                gl.store(ptrs, o, mask=o_rows_i < sq)
            else:
                # Through Q's buffer (every S product that read it has completed) and a TMA store, which drops
                # rows past Sq.
                q.store(o)
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [bd, row0, h, 0], q_smem.index(qi))
                tma.store_wait(0)
            tiles_done += 1


@gluon.jit
def attn_fwd_ws_kernel(q_desc, qt_desc, k_desc, kt_desc, v_desc, o_desc, out_ptr, lse_ptr, cu_seqlens_q, cu_seqlens_k,
                       seqlen_q, seqlen_k, m_tiles, num_heads_q, group_size, num_units, stride_ob, stride_os,
                       stride_oh, stride_lb, stride_lh, qk_scale, sink_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr,
                       stride_qsc_b, stride_qsc_h, stride_ksc_b, stride_ksc_h, stride_vsc_b, stride_vsc_h, vt_gap,
                       CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, TAIL: gl.constexpr, HEAD_DIM_V: gl.constexpr,
                       BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
                       PERSISTENT: gl.constexpr, VARLEN: gl.constexpr, HAS_SINK: gl.constexpr, FP8: gl.constexpr):
    """Grid: (m_tiles * B * Hq,) or, PERSISTENT, (min(num_units, SMs),); 4 warps (the first consumer warpgroup;
    the partitions add 5 more). VARLEN (not with PERSISTENT): B sequences packed in [1, total, H, D] tensors, their
    rows and keys from cu_seqlens_q/k (int32 [B + 1]), m_tiles from the longest; lse [1, Hq, total_q]. q and k
    are HEAD_DIM + TAIL wide (q_desc / k_desc: blocks of the first HEAD_DIM columns; qt_desc / kt_desc: of the next
    TAIL, or None with TAIL = 0), v and out HEAD_DIM_V. FP8 (e4m3 q, k): v_desc reads FP8 attention's V^T [Hkv, D,
    width] (launch/tensors.launch_values_t, sequences vt_gap columns apart) in [1, D, BLOCK_N] boxes; FA3's descales
    [B, Hkv] at q/k/v_scale_ptr with their strides; out is 16-bit."""
    gl.static_assert(not (PERSISTENT and VARLEN), "persistent CTAs walk tiles of equal-length sequences")
    gl.static_assert(PERSISTENT or Q_BUFS == 1, "one tile per CTA needs one Q buffer")
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, 1, WG_ROWS, 1, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [K_STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    if TAIL:
        qt_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, 1, WG_ROWS, 1, TAIL], qt_desc.layout)
        kt_bufs = gl.allocate_shared_memory(dtype, [K_STAGES, 1, BLOCK_N, 1, TAIL], kt_desc.layout)
    else:  # never read
        qt_smem = q_smem
        kt_bufs = k_bufs
    if FP8:
        v_bufs = gl.allocate_shared_memory(dtype, [V_STAGES, 1, HEAD_DIM_V, BLOCK_N], v_desc.layout)
        P_SWIZZLE: gl.constexpr = 128 if BLOCK_N >= 128 else BLOCK_N  # a row's bytes, at most 128
        p_bufs = gl.allocate_shared_memory(dtype, [2, WG_ROWS, BLOCK_N], gl.NVMMASharedLayout(
            swizzle_byte_width=P_SWIZZLE, element_bitwidth=8, rank=2))
    else:
        v_bufs = gl.allocate_shared_memory(dtype, [V_STAGES, 1, BLOCK_N, 1, HEAD_DIM_V], v_desc.layout)
        p_bufs = q_smem  # never read
    q_bar = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * Q_BUFS):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)  # released by its consumer warpgroup (persistent CTAs)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    # Integer arguments equal to 1 arrive as constexprs, which worker partitions cannot take: make them tensors.
    seqlen_q = gl.to_tensor(seqlen_q)
    seqlen_k = gl.to_tensor(seqlen_k)
    m_tiles = gl.to_tensor(m_tiles)
    num_heads_q = gl.to_tensor(num_heads_q)
    group_size = gl.to_tensor(group_size)
    num_units = gl.to_tensor(num_units)
    stride_ob = gl.to_tensor(stride_ob)
    stride_os = gl.to_tensor(stride_os)
    stride_oh = gl.to_tensor(stride_oh)
    stride_lb = gl.to_tensor(stride_lb)
    stride_lh = gl.to_tensor(stride_lh)
    stride_qsc_b = gl.to_tensor(stride_qsc_b)
    stride_qsc_h = gl.to_tensor(stride_qsc_h)
    stride_ksc_b = gl.to_tensor(stride_ksc_b)
    stride_ksc_h = gl.to_tensor(stride_ksc_h)
    stride_vsc_b = gl.to_tensor(stride_vsc_b)
    stride_vsc_h = gl.to_tensor(stride_vsc_h)
    vt_gap = gl.to_tensor(vt_gap)
    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    # (Argument tuples are written out: a tuple built with + loses the constexprs' type.)
    gl.warp_specialize([
        (_consumer, (q_desc, o_desc, out_ptr, lse_ptr, q_smem, qt_smem, k_bufs, kt_bufs, v_bufs, p_bufs, q_bar,
                     q_empty, k_ready, v_ready, k_empty, v_empty, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                     m_tiles, num_heads_q, group_size, num_units, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                     qk_scale, sink_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, stride_qsc_b, stride_qsc_h,
                     stride_ksc_b, stride_ksc_h, stride_vsc_b, stride_vsc_h, WG0, CAUSAL, HEAD_DIM, TAIL, HEAD_DIM_V,
                     BLOCK_N, K_STAGES, V_STAGES, Q_BUFS, PERSISTENT, VARLEN, HAS_SINK, FP8)),
        (_consumer, (q_desc, o_desc, out_ptr, lse_ptr, q_smem, qt_smem, k_bufs, kt_bufs, v_bufs, p_bufs, q_bar,
                     q_empty, k_ready, v_ready, k_empty, v_empty, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                     m_tiles, num_heads_q, group_size, num_units, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                     qk_scale, sink_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, stride_qsc_b, stride_qsc_h,
                     stride_ksc_b, stride_ksc_h, stride_vsc_b, stride_vsc_h, WG1, CAUSAL, HEAD_DIM, TAIL, HEAD_DIM_V,
                     BLOCK_N, K_STAGES, V_STAGES, Q_BUFS, PERSISTENT, VARLEN, HAS_SINK, FP8)),
        (_producer, (q_desc, qt_desc, k_desc, kt_desc, v_desc, q_smem, qt_smem, k_bufs, kt_bufs, v_bufs, q_bar,
                     q_empty, k_ready, v_ready, k_empty, v_empty, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                     m_tiles, num_heads_q, group_size, num_units, vt_gap, CAUSAL, HEAD_DIM, TAIL, BLOCK_N, K_STAGES,
                     V_STAGES, Q_BUFS, PERSISTENT, VARLEN, FP8)),
    ], [4, 1], [240, 24])


def m_tiles(seqlen_q: int) -> int:
    """Tiles per (batch, head): 128 query rows each."""
    return triton.cdiv(seqlen_q, 2 * ROWS_PER_WARPGROUP)


def units(m: int, batch_heads: int) -> int:
    """Work units of persistent CTAs: pairs of tiles of one head (see _tile)."""
    return batch_heads * ((m + 1) // 2)
