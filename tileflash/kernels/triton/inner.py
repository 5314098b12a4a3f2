"""The one QK^T -> online softmax -> PV inner loop, shared by prefill, varlen and decode.

Notation (per program): a tile of BLOCK_M query rows and the KV tokens [lo, hi) of one KV head.
  q:      [BLOCK_M, DP]  (DP = head dim padded to a power of two; padding is masked, never stored in memory)
  k, v:   [BLOCK_N, DP]  loaded per step, from a contiguous cache or gathered through a page table
  s:      [BLOCK_M, BLOCK_N] scores in log2 units (scaled by softmax_scale * log2(e)) so the softmax uses exp2
  m_i:    running row max of s (log2 units), l_i: running row sum of exp2(s - m_i), acc: unnormalised output (fp32)
Each row r carries its query position q_pos[r] in key coordinates (bottom-right aligned: i + seqlen_k - seqlen_q),
so one mask helper serves plain prefill rows and pack-GQA decode rows (several heads sharing a position), and the
ALiBi bias -slope * |q_pos - key| (flash-attn's alibi_slopes) needs no other coordinates.
"""
import triton
import triton.language as tl

from .masks import alibi_distance, visible
from .cast import round_e4m3
from .dropout import dropout_keep
from ...lowp.kernels.quant import NVFP4_PURE_ASM, NVFP4_SCALE_WORDS, e4m3_fp16_pinned, nvfp4_unpack_tile

P_FP8_LOG2: tl.constexpr = tl.constexpr(8.0)  # FP8 attention's P tiles span [0, 2^8] (e4m3's max is 448)
# FP8 attention's V operand (attn_inner's P_FP8): FP8 MMAs read both operands K-major, i.e. V^T with tokens
# contiguous. FP8_V_ROWS: V tiles [tokens, D] as stored (paged pools), whose P V runs in fp16 instead (e4m3 widens
# exactly; the e4m3 product made Triton transpose each tile through shared memory byte by byte: 1.8-5.9x slower,
# run 172); FP8_V_T: V^T [Hkv, D, width] written by launch/tensors.launch_values_t (every sequence
# from a 16-byte aligned column), read by pointers, or FP8_V_T_DESC: through a TMA descriptor (its tile offsets
# along tokens must be 16-byte aligned; pointers where no descriptor fits, e.g. head dims not a power of two).
# FP8_V_T_ZEROS: FP8_V_T_DESC over a V^T whose columns past each sequence are zeros through its last key block
# (launch/tensors.values_t_column's wide gap): that block's V^T tile needs no mask, which took it from shared memory
# into registers byte by byte (FP8 d128 at 4088 keys: the masked step 1203 -> 658 SASS instructions, 530 unmasked).
FP8_V_ROWS: tl.constexpr = tl.constexpr(1)
FP8_V_T: tl.constexpr = tl.constexpr(2)
FP8_V_T_DESC: tl.constexpr = tl.constexpr(3)
FP8_V_T_ZEROS: tl.constexpr = tl.constexpr(4)
# TRANS (attn_inner) is 0 (plain products), 1 (transposed) or TRANS_PERM_K: transposed, with K's and q^T's head
# dims permuted alike (perm_head_dim; the dot is unchanged). For 8-bit caches read through TMA: K's tile feeds
# wgmma's 16-bit register operand, whose fragment holds head-dim columns 2c, 2c+1, 2c+8, 2c+9 of each 16; read
# from bytes 4c..4c+3 instead, a thread takes its 4 bytes with ldmatrix, not as two 2-byte loads (FP8 decode,
# b=64 ctx 4k: the step's LDS 202 -> 138, 753 -> 690 SASS instructions).
TRANS_PERM_K: tl.constexpr = tl.constexpr(2)


@triton.jit
def block_pages(bt_ptr, start_n, seqlen_k, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, USE_DESC: tl.constexpr,
                MASK_N: tl.constexpr, shift=0):
    """The block table entries of KV tokens start_n .. start_n + BLOCK_N (a paged cache; 0 for a contiguous one):
    one page (a scalar) when a TMA descriptor reads the block, whose page holds whole blocks, else each token's
    page ([BLOCK_N], tokens at or past seqlen_k on page 0 when MASK_N). The loop loads a block's pages one step
    ahead of its K and V loads, which wait on them. shift: the cache position of token 0 (a left pad over pages;
    pointer loads only)."""
    pages = 0
    if PAGE_SIZE > 0:  # (one return: the compiler types every return statement, taken or not)
        if USE_DESC:
            pages = tl.load(bt_ptr + start_n // PAGE_SIZE)
        else:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            if MASK_N:
                pages = tl.load(bt_ptr + (offs_n + shift) // PAGE_SIZE, mask=offs_n < seqlen_k, other=0)
            else:
                pages = tl.load(bt_ptr + (offs_n + shift) // PAGE_SIZE)
    return pages


@triton.jit
def _kv_row_offsets(offs_n, pages, stride_page, stride_tok, PAGE_SIZE: tl.constexpr, shift=0):
    """Element offsets (int64) of KV tokens offs_n: contiguous rows (PAGE_SIZE 0), or rows in the tokens' pages
    (block_pages, with its shift; any page size). PAGE_SIZE is a compile-time constant: the per-token // and % by a
    run-time page size cost more ALU time than the loads they feed (paged decode ran up to 1.4x slower than
    contiguous with it)."""
    if PAGE_SIZE > 0:
        return pages.to(tl.int64) * stride_page + ((offs_n + shift) % PAGE_SIZE).to(tl.int64) * stride_tok
    else:
        return offs_n.to(tl.int64) * stride_tok


@triton.jit
def _pin_widening(t, VALUES: tl.constexpr, TILE_DTYPE: tl.constexpr, PURE: tl.constexpr):
    """Value tiles of e4m3 caches widen to fp16 in the layout they were loaded in (quant.e4m3_fp16_pinned). Left to
    Triton, the widening moved past the layout change into wgmma's register operand (V^T in the transposed
    products), which then gathered the bytes one at a time with a multiply-add to pair them: FP8 decode's step,
    sm_90 SASS, b=64 ctx 4k 690 -> 542 instructions per 128 tokens, pages of 16 (gathers) 802 -> 537 per 64.
    PURE (off sm_90, quant.NVFP4_PURE_ASM): Triton's cast, since sm_100's pipeliner rejects the impure PTX."""
    if VALUES and TILE_DTYPE == tl.float16 and t.dtype == tl.float8e4nv and not PURE:
        t = e4m3_fp16_pinned(t)
    return t


@triton.jit
def _kv_tile(base, sbase, start_n, seqlen_k, pages, stride_page, stride_tok, sstride_page, sstride_tok, desc_row0,
             head_kv, offs_d, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
             USE_DESC: tl.constexpr, KV_NVFP4: tl.constexpr, MASK_N: tl.constexpr, TILE_DTYPE: tl.constexpr,
             VALUES: tl.constexpr = True, BOX_IN_SEQ: tl.constexpr = False, shift=0):
    """The [BLOCK_N, DP] K or V tile of tokens start_n.. : through a TMA tensor descriptor (base is a descriptor over
    [rows, Hkv, D], contiguous or a page pool whose pages hold whole tiles; columns past D arrive as zeros), or by
    pointers (contiguous or paged, any page size); pages: the block's block_pages. Rows at or past seqlen_k
    are zero when MASK_N (with a descriptor they belong to the next sequence: never let them reach P @ V). Keys
    (VALUES=False) through a descriptor stay as loaded: their scores are masked to -inf, whatever the rows hold, and
    the select would take the tile from shared memory into registers and back (FP8 d128, 4088 keys: the masked
    step 1607 -> 1203 SASS instructions, 530 unmasked). BOX_IN_SEQ (masked blocks through a contiguous cache's
    descriptor, seqlen_k >= BLOCK_N, no key written by another program in this launch): a block reaching past
    seqlen_k is read from BLOCK_N keys before seqlen_k instead, its keys before start_n (the previous block's) get
    position seqlen_k so their scores are masked, and V needs no mask either (the 16-bit decode step:
    425 -> 267 SASS instructions, 248 unmasked).
    KV_NVFP4 (NVFP4_SCALE_BYTES or _WORDS, plus NVFP4_PURE_ASM off sm_90; NVFP4_PURE_ASM alone: an e4m3 cache off
    sm_90, see _pin_widening): base holds packed e2m1 pairs [.., D/2]
    and sbase the e4m3 scale of each 16 elements [.., D/16] (strides sstride_*); the tile is decoded in registers
    (e2m1 x e4m3 is exact in fp16/bf16) and the per-tensor global scale is folded in by the caller.
    shift: as block_pages' (rows of a paged cache by pointers)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    pure: tl.constexpr = KV_NVFP4 >= NVFP4_PURE_ASM  # side effects: see nvfp4_unpack_tile, _pin_widening
    if KV_NVFP4 != 0 and KV_NVFP4 != NVFP4_PURE_ASM:
        row_ok = offs_n[:, None] < seqlen_k
        row_off = _kv_row_offsets(offs_n, pages, stride_page, stride_tok, PAGE_SIZE, shift)
        offs_b = tl.arange(0, HEAD_DIM // 2)
        s_off = _kv_row_offsets(offs_n, pages, sstride_page, sstride_tok, PAGE_SIZE, shift)
        scale_words: tl.constexpr = KV_NVFP4 % NVFP4_PURE_ASM == NVFP4_SCALE_WORDS
        if scale_words:  # rows of scales 4-byte aligned: four scales per int32
            s_ptrs = (sbase + s_off[:, None]).to(tl.pointer_type(tl.int32)) + tl.arange(0, HEAD_DIM // 64)[None, :]
        else:
            s_ptrs = sbase + s_off[:, None] + tl.arange(0, HEAD_DIM // 16)[None, :]
        if MASK_N:
            packed = tl.load(base + row_off[:, None] + offs_b[None, :], mask=row_ok, other=0)
            s_bits = tl.load(s_ptrs, mask=row_ok, other=0)
        else:
            packed = tl.load(base + row_off[:, None] + offs_b[None, :])
            s_bits = tl.load(s_ptrs)
        t = nvfp4_unpack_tile(packed, s_bits, BLOCK_N, HEAD_DIM, pure)
    elif USE_DESC:
        if PAGE_SIZE > 0:  # the launcher takes descriptors only when a page holds whole tiles
            row = pages * PAGE_SIZE + start_n % PAGE_SIZE
        else:
            row = desc_row0 + start_n
        if BOX_IN_SEQ and MASK_N:
            tl.static_assert(PAGE_SIZE == 0, "a page's box cannot move into another page")
            back = tl.maximum(start_n + BLOCK_N - seqlen_k, 0)
            row -= back
            offs_n = tl.where(offs_n - back < start_n, seqlen_k, offs_n - back)
        t = base.load([row, head_kv, 0]).reshape(BLOCK_N, offs_d.shape[0])
        t = _pin_widening(t, VALUES, TILE_DTYPE, pure)  # before the mask: a select of fp16 pairs, not of bytes
        if MASK_N and VALUES and not BOX_IN_SEQ:
            t = tl.where(offs_n[:, None] < seqlen_k, t, 0.0)
    else:
        row_off = _kv_row_offsets(offs_n, pages, stride_page, stride_tok, PAGE_SIZE, shift)
        ptrs = base + row_off[:, None] + offs_d[None, :]
        if MASK_N:
            t = tl.load(ptrs, mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif HEAD_DIM == offs_d.shape[0]:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        t = _pin_widening(t, VALUES, TILE_DTYPE, pure)
    # TILE_DTYPE: q's dtype on the GPU (fp8 caches widen here, exactly), fp32 in the interpreter (its bf16 is wrong).
    return t.to(TILE_DTYPE), offs_n


@triton.jit
def _vt_tile(base, start_n, seqlen_k, stride_d, vt_col0, head_kv, offs_dv, HEAD_DIM_V: tl.constexpr,
             BLOCK_N: tl.constexpr, VT_DESC: tl.constexpr, MASK_N: tl.constexpr, TILE_DTYPE: tl.constexpr):
    """The [DP, BLOCK_N] tile of V^T for tokens start_n.. (FP8_V_T): V^T is [Hkv, D, width] with each sequence's
    tokens from column vt_col0 (launch/tensors.values_t_column), which a descriptor (box [1, DP, BLOCK_N]) reads;
    by pointers, base is this head's and sequence's first token and stride_d D's stride. Columns at or past
    seqlen_k are zero when MASK_N (with a descriptor they are the zero padding or the next sequence's)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if VT_DESC:
        t = base.load([head_kv, 0, vt_col0 + start_n]).reshape(offs_dv.shape[0], BLOCK_N)
        if MASK_N:
            t = tl.where(offs_n[None, :] < seqlen_k, t, 0.0)
    else:
        ptrs = base + offs_dv[:, None] * stride_d + offs_n[None, :]
        if MASK_N:
            t = tl.load(ptrs, mask=(offs_n[None, :] < seqlen_k) & (offs_dv[:, None] < HEAD_DIM_V), other=0.0)
        elif HEAD_DIM_V == offs_dv.shape[0]:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=offs_dv[:, None] < HEAD_DIM_V, other=0.0)
    return t.to(TILE_DTYPE)


@triton.jit
def _v_tile(v_base, v_sbase, start_n, seqlen_k, pages, stride_v_page, stride_v_tok, sstride_page, sstride_tok,
            v_row0, head_kv, offs_dv, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
            USE_DESC: tl.constexpr, KV_NVFP4: tl.constexpr, MASK: tl.constexpr, TILE_DTYPE: tl.constexpr,
            P_FP8: tl.constexpr, BOX_IN_SEQ: tl.constexpr = False, shift=0):
    """The V tile the PV product takes: [BLOCK_N, DP] (_kv_tile), or [DP, BLOCK_N] of V^T with FP8_V_T(_DESC)
    (then stride_v_tok is D's stride). v_row0: the sequence's first row (V^T: column) in V's descriptor."""
    if P_FP8 >= FP8_V_T:
        tl.static_assert(not BOX_IN_SEQ, "V^T's boxes do not move with the keys'")
        v = _vt_tile(v_base, start_n, seqlen_k, stride_v_tok, v_row0, head_kv, offs_dv, HEAD_DIM_V, BLOCK_N,
                     P_FP8 >= FP8_V_T_DESC, MASK and P_FP8 != FP8_V_T_ZEROS, TILE_DTYPE)
    else:
        v, _ = _kv_tile(v_base, v_sbase, start_n, seqlen_k, pages, stride_v_page, stride_v_tok, sstride_page,
                        sstride_tok, v_row0, head_kv, offs_dv, HEAD_DIM_V, BLOCK_N, PAGE_SIZE, USE_DESC, KV_NVFP4,
                        MASK, TILE_DTYPE, BOX_IN_SEQ=BOX_IN_SEQ, shift=shift)
    return v


@triton.jit
def perm_head_dim(t, AXIS: tl.constexpr):
    """t [N, D] (AXIS 1: K's tile) or [D, M] (AXIS 0: q^T) with head-dim entry 16g + 8h + 2c + e taken from
    16g + 4c + 2h + e (TRANS_PERM_K)."""
    if AXIS == 1:
        return t.reshape(t.shape[0], t.shape[1] // 16, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(t.shape[0], t.shape[1])
    else:
        return t.reshape(t.shape[0] // 16, 4, 2, 2, t.shape[1]).permute(0, 2, 1, 3, 4).reshape(t.shape[0], t.shape[1])


@triton.jit
def tanh(y):
    """tanh(y) = 1 - 2 / (exp(2y) + 1): exact at +-inf (no inf/inf), and the interpreter has no libdevice. Below
    |y| = 2^-6 that difference cancels (a softcap of 1e7 gave logits off by 0.4), so y - y^3/3 takes over there:
    its error, 2y^5/15, is under fp32 rounding."""
    return tl.where(tl.abs(y) < 0.015625, y - y * y * y * 0.3333333333333333, 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


@triton.jit
def _per_row(x, TRANS: tl.constexpr):
    """A per-row vector broadcast against scores: [M, 1], or [1, M] when the tiles are transposed."""
    if TRANS:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _per_key(x, TRANS: tl.constexpr):
    """A per-key vector broadcast against scores: [1, N], or [N, 1] when the tiles are transposed."""
    return _per_row(x, not TRANS)


@triton.jit
def _scores(q, k, qk_scale, softcap_scale, q_pos, offs_n, seqlen_k, window_left, window_right, alibi_slope,
            SOFTCAP: tl.constexpr, MASK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
            TRANS: tl.constexpr, RAW_SCORES: tl.constexpr, ALIBI: tl.constexpr, qv=None, v=None,
            HAS_QV: tl.constexpr = False, chunk=0, CHUNK: tl.constexpr = False):
    """s = mask(softcap(q k^T * scale) + alibi) in log2 units; TRANS: q holds q^T and s comes out as s^T [N, M].
    RAW_SCORES (a positive scale known on the host, no softcap, no ALiBi; not with quantized caches, whose scales
    live on the device): s stays q k^T and _softmax_pv applies the scale inside exp2's argument.
    ALIBI: alibi_slope holds each row's slope times log2(e) ([M]); the bias is a bias, not a mask, so unmasked
    blocks add it too. HAS_QV (MLA): the values are keys too, s = q k^T + qv v^T."""
    if TRANS:
        if TRANS == TRANS_PERM_K:
            k = perm_head_dim(k, 1)
        s = tl.dot(k, q)
        if HAS_QV:
            s = tl.dot(v, qv, s)
    else:
        s = tl.dot(q, tl.trans(k))
        if HAS_QV:
            s = tl.dot(qv, tl.trans(v), s)
    if SOFTCAP:
        # softcap * tanh(x / softcap); qk_scale already holds softcap * log2(e).
        s = qk_scale * tanh(s * softcap_scale)
    elif not RAW_SCORES:
        s = s * qk_scale
    if ALIBI:
        s = s - _per_row(alibi_slope, TRANS) * alibi_distance(_per_row(q_pos, TRANS), _per_key(offs_n, TRANS))
    if MASK:
        ok = visible(_per_row(q_pos, TRANS), _per_key(offs_n, TRANS), seqlen_k, window_left, window_right, HAS_LEFT,
                     HAS_RIGHT, chunk, CHUNK)
        s = tl.where(ok, s, float("-inf"))
    return s


@triton.jit
def _softmax_pv(acc, m_i, l_i, s, v, qk_scale, TRANS: tl.constexpr, RAW_SCORES: tl.constexpr,
                P_FP8: tl.constexpr = False, start_n=0, rng_ptr=None, drop_rows=None, drop_bh=0, drop_thr=0,
                DROPOUT: tl.constexpr = False):
    """Online-softmax update with one block of scores s and values v (TRANS: s^T and acc^T [DP, M]).
    RAW_SCORES: s is unscaled and qk_scale > 0, so the row max scales after the reduction and the scale and the
    max subtraction are one FMA per score (FA's exp2(s * scale - m)) instead of a multiply and a subtract.
    P_FP8 (e4m3 values, FP8_V_ROWS or FP8_V_T: v's layout): P is computed as exp2(s - m + P_FP8_LOG2) so it spans
    [0, 2^8] and stays clear of e4m3's subnormals (l_i carries the same 2^8: m_i - P_FP8_LOG2 and l_i are the row's
    usual pair, see fp8_row_max). With V^T it is rounded to e4m3 for the PV product, each block's product starts
    from zero and is added into the fp32 acc, so the tensor cores' reduced-precision FP8 accumulation never runs
    over the whole row (vLLM's long-context trap); with V rows (paged pools) P and V multiply in fp16.
    DROPOUT (prefill rows of one head, keys start_n..): the probabilities dropout.dropout_keep drops leave the PV
    product, not l_i (the caller scales the output by 1 / (1 - p))."""
    key_axis: tl.constexpr = 0 if TRANS else 1
    if RAW_SCORES:
        m_new = tl.maximum(m_i, tl.max(s, key_axis) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, key_axis))
    # A row that has seen only masked keys keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    m_sub = m_safe - P_FP8_LOG2 if P_FP8 else m_safe
    if RAW_SCORES:
        p = tl.math.exp2(tl.fma(s, qk_scale, -_per_row(m_sub, TRANS)))
    else:
        p = tl.math.exp2(s - _per_row(m_sub, TRANS))
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, key_axis)
    acc = acc * _per_row(alpha, TRANS)
    if DROPOUT:
        tl.static_assert(not TRANS and not P_FP8, "dropout: untransposed 16-bit products only")
        p = p * tl.where(dropout_keep(rng_ptr, drop_rows, drop_bh, start_n, drop_thr, p.shape[1]), 1.0, 0.0)
    if P_FP8:
        tl.static_assert(not TRANS, "FP8 values take the untransposed products")
        if P_FP8 >= FP8_V_T:  # v holds V^T [DP, N]
            if v.dtype == tl.float32:  # the interpreter's tiles: P rounded as the GPU's cast rounds it
                p8 = round_e4m3(p)
            else:
                p8 = p.to(v.dtype)
            acc = acc + tl.dot(p8, tl.trans(v))
        else:  # V rows as stored: in fp16 (e4m3 widens exactly), not e4m3 with each tile's bytes transposed
            acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
    elif TRANS:
        acc = tl.dot(tl.trans(v), p.to(v.dtype), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def fp8_row_max(m_i, P_FP8: tl.constexpr):
    """The row max that pairs with l_i after the loop: P_FP8's P and l_i carry a factor 2^P_FP8_LOG2."""
    if P_FP8:
        m_i = m_i - P_FP8_LOG2
    return m_i


@triton.jit
def attn_inner(acc, m_i, l_i, q, q_pos, k_base, v_base, k_sbase, v_sbase, bt_ptr, stride_k_page, stride_k_tok,
               stride_v_page, stride_v_tok, sstride_page, sstride_tok, desc_row0, v_row0, head_kv, offs_d, seqlen_k,
               lo, hi, qk_scale, softcap_scale, window_left, window_right, alibi_slope, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr, MASK: tl.constexpr, PAGE_SIZE: tl.constexpr, USE_DESC: tl.constexpr,
               KV_NVFP4: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
               SP_OVERLAP: tl.constexpr, TILE_DTYPE: tl.constexpr, TRANS: tl.constexpr,
               RAW_SCORES: tl.constexpr, ALIBI: tl.constexpr, qv, offs_dv, HEAD_DIM_V: tl.constexpr,
               HAS_QV: tl.constexpr, P_FP8: tl.constexpr = False, BOX_IN_SEQ: tl.constexpr = False, rng_ptr=None,
               drop_rows=None, drop_bh=0, drop_thr=0, DROPOUT: tl.constexpr = False, chunk=0,
               CHUNK: tl.constexpr = False, shift=0):
    """Accumulate KV tokens [lo, hi) (lo, hi multiples of BLOCK_N) into (acc, m_i, l_i).

    MASK=False is the fast path for blocks that are fully visible to every row (no per-element masks).
    SP_OVERLAP=True issues QK^T of block j+1 before the softmax of block j (FA4's S/P ping-pong), so the MMA
    and the next loads overlap the exp2 work; False is the plain loop (Triton's warp specialisation of it measured
    no gain on sm_90 and was removed: the sm_90 prefill's producer/consumer split is the Gluon kernel's).
    TRANS computes the transposed products s^T = K q^T and acc^T += V^T P^T (q holds q^T [DP, M], acc holds
    acc^T): with decode's few query rows the KV tokens and the head dim fill the MMA's M side instead of padding;
    TRANS_PERM_K also permutes K's head dim (q^T's alike, by the caller).
    V tiles are HEAD_DIM_V wide (offs_dv); HAS_QV (MLA) adds qv v^T to the scores (the plain loop only).
    P_FP8: e4m3 V tiles (FP8_V_ROWS: as stored; FP8_V_T(_DESC): V^T, stride_v_tok D's stride), P's product as
    _softmax_pv says.
    BOX_IN_SEQ: masked blocks read K and V boxes that end at or before seqlen_k (_kv_tile; seqlen_k >= BLOCK_N).
    DROPOUT: attention dropout of rows drop_rows of head row drop_bh (_softmax_pv; seed at rng_ptr).
    CHUNK: masked blocks also hide keys outside each row's attention chunk of `chunk` keys (masks.visible).
    shift: the cache position of key 0 in a paged cache read by pointers (cache_leftpad; block_pages).
    """
    if SP_OVERLAP:
        tl.static_assert(not HAS_QV, "MLA (qv) takes the plain loop")
        if lo < hi:
            pages = block_pages(bt_ptr, lo, seqlen_k, BLOCK_N, PAGE_SIZE, USE_DESC, MASK, shift)
            k, offs_n = _kv_tile(k_base, k_sbase, lo, seqlen_k, pages, stride_k_page, stride_k_tok, sstride_page,
                                 sstride_tok, desc_row0, head_kv, offs_d, HEAD_DIM, BLOCK_N, PAGE_SIZE, USE_DESC,
                                 KV_NVFP4, MASK, TILE_DTYPE, False, BOX_IN_SEQ, shift)
            s = _scores(q, k, qk_scale, softcap_scale, q_pos, offs_n, seqlen_k, window_left, window_right,
                        alibi_slope, SOFTCAP, MASK, HAS_LEFT, HAS_RIGHT, TRANS, RAW_SCORES, ALIBI, chunk=chunk,
                        CHUNK=CHUNK)
            for start_n in range(lo, hi, BLOCK_N):
                v = _v_tile(v_base, v_sbase, start_n, seqlen_k, pages, stride_v_page, stride_v_tok, sstride_page,
                            sstride_tok, v_row0, head_kv, offs_dv, HEAD_DIM_V, BLOCK_N, PAGE_SIZE, USE_DESC,
                            KV_NVFP4, MASK, TILE_DTYPE, P_FP8, BOX_IN_SEQ, shift)
                # Next block's scores first (clamped to the last block on the final step; the result is unused).
                next_start = tl.minimum(start_n + BLOCK_N, hi - BLOCK_N)
                pages = block_pages(bt_ptr, next_start, seqlen_k, BLOCK_N, PAGE_SIZE, USE_DESC, MASK, shift)
                k_next, next_n = _kv_tile(k_base, k_sbase, next_start, seqlen_k, pages, stride_k_page,
                                          stride_k_tok, sstride_page, sstride_tok, desc_row0, head_kv, offs_d,
                                          HEAD_DIM, BLOCK_N, PAGE_SIZE, USE_DESC, KV_NVFP4, MASK, TILE_DTYPE, False,
                                          BOX_IN_SEQ, shift)
                s_next = _scores(q, k_next, qk_scale, softcap_scale, q_pos, next_n, seqlen_k, window_left,
                                 window_right, alibi_slope, SOFTCAP, MASK, HAS_LEFT, HAS_RIGHT, TRANS, RAW_SCORES,
                                 ALIBI, chunk=chunk, CHUNK=CHUNK)
                acc, m_i, l_i = _softmax_pv(acc, m_i, l_i, s, v, qk_scale, TRANS, RAW_SCORES, P_FP8, start_n, rng_ptr,
                                            drop_rows, drop_bh, drop_thr, DROPOUT)
                s = s_next
    elif lo < hi:  # (no table entry is read for an empty range: lo may be past the table's end)
        pages = block_pages(bt_ptr, lo, seqlen_k, BLOCK_N, PAGE_SIZE, USE_DESC, MASK, shift)
        for start_n in range(lo, hi, BLOCK_N):
            # The next block's pages a step ahead (the last step reloads its own): a paged cache's K and V loads
            # wait on them.
            next_pages = block_pages(bt_ptr, tl.minimum(start_n + BLOCK_N, hi - BLOCK_N), seqlen_k, BLOCK_N,
                                     PAGE_SIZE, USE_DESC, MASK, shift)
            acc, m_i, l_i = _plain_step(acc, m_i, l_i, q, q_pos, k_base, v_base, k_sbase, v_sbase, pages,
                                        stride_k_page, stride_k_tok, stride_v_page, stride_v_tok, sstride_page,
                                        sstride_tok, desc_row0, v_row0, head_kv, offs_d, seqlen_k, start_n,
                                        qk_scale, softcap_scale, window_left, window_right, alibi_slope, HEAD_DIM,
                                        BLOCK_N, MASK, PAGE_SIZE, USE_DESC, KV_NVFP4, HAS_LEFT, HAS_RIGHT,
                                        SOFTCAP, TILE_DTYPE, TRANS, RAW_SCORES, ALIBI, qv, offs_dv, HEAD_DIM_V,
                                        HAS_QV, P_FP8, BOX_IN_SEQ, rng_ptr, drop_rows, drop_bh, drop_thr, DROPOUT,
                                        chunk, CHUNK, shift)
            pages = next_pages
    return acc, m_i, l_i


@triton.jit
def _plain_step(acc, m_i, l_i, q, q_pos, k_base, v_base, k_sbase, v_sbase, pages, stride_k_page, stride_k_tok,
                stride_v_page, stride_v_tok, sstride_page, sstride_tok, desc_row0, v_row0, head_kv, offs_d, seqlen_k,
                start_n, qk_scale, softcap_scale, window_left, window_right, alibi_slope, HEAD_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr, MASK: tl.constexpr, PAGE_SIZE: tl.constexpr, USE_DESC: tl.constexpr,
                KV_NVFP4: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                TILE_DTYPE: tl.constexpr, TRANS: tl.constexpr, RAW_SCORES: tl.constexpr, ALIBI: tl.constexpr, qv,
                offs_dv, HEAD_DIM_V: tl.constexpr, HAS_QV: tl.constexpr, P_FP8: tl.constexpr,
                BOX_IN_SEQ: tl.constexpr, rng_ptr, drop_rows, drop_bh, drop_thr, DROPOUT: tl.constexpr, chunk,
                CHUNK: tl.constexpr, shift):
    """One block of the plain loop: load K, scores, load V, online softmax and PV (MLA: V before the scores)."""
    k, offs_n = _kv_tile(k_base, k_sbase, start_n, seqlen_k, pages, stride_k_page, stride_k_tok, sstride_page,
                         sstride_tok, desc_row0, head_kv, offs_d, HEAD_DIM, BLOCK_N, PAGE_SIZE, USE_DESC, KV_NVFP4,
                         MASK, TILE_DTYPE, False, BOX_IN_SEQ, shift)
    if HAS_QV:
        tl.static_assert(not BOX_IN_SEQ, "MLA reads its latents by pointers")
        v, _ = _kv_tile(v_base, v_sbase, start_n, seqlen_k, pages, stride_v_page, stride_v_tok, sstride_page,
                        sstride_tok, v_row0, head_kv, offs_dv, HEAD_DIM_V, BLOCK_N, PAGE_SIZE, USE_DESC, KV_NVFP4,
                        MASK, TILE_DTYPE, shift=shift)
        s = _scores(q, k, qk_scale, softcap_scale, q_pos, offs_n, seqlen_k, window_left, window_right, alibi_slope,
                    SOFTCAP, MASK, HAS_LEFT, HAS_RIGHT, TRANS, RAW_SCORES, ALIBI, qv, v, True, chunk, CHUNK)
    else:
        s = _scores(q, k, qk_scale, softcap_scale, q_pos, offs_n, seqlen_k, window_left, window_right, alibi_slope,
                    SOFTCAP, MASK, HAS_LEFT, HAS_RIGHT, TRANS, RAW_SCORES, ALIBI, chunk=chunk, CHUNK=CHUNK)
        v = _v_tile(v_base, v_sbase, start_n, seqlen_k, pages, stride_v_page, stride_v_tok, sstride_page, sstride_tok,
                    v_row0, head_kv, offs_dv, HEAD_DIM_V, BLOCK_N, PAGE_SIZE, USE_DESC, KV_NVFP4, MASK, TILE_DTYPE,
                    P_FP8, BOX_IN_SEQ, shift)
    return _softmax_pv(acc, m_i, l_i, s, v, qk_scale, TRANS, RAW_SCORES, P_FP8, start_n, rng_ptr, drop_rows, drop_bh,
                       drop_thr, DROPOUT)
