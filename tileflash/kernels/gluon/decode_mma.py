"""Decode over an NVFP4 KV cache on sm_90, written in Gluon: every cache byte goes from global memory straight into
the register of the thread that feeds it to the tensor cores.

Why a second decode kernel (the Triton one is attn_fwd.py): an NVFP4 cache is read at 0.5625 bytes per value, so at the
copy roofline an SM has ~4.5 issue slots per K/V value for the dequantisation, the products and the softmax. The Triton
kernel spends them on moving the widened tiles through shared memory into the MMA operand layouts (byte gathers: 202
shared-memory loads per 128-token FP8 step) and ran the NVFP4 cache at ~1.25 TB/s (30% of the copy ceiling, notebook run
40). Here (the fragment design of lowp/kernels/gemm_mma.py):

  * Each warp owns its own tokens: a program's 4 warps step through BN-token blocks of the split independently,
    each with its own online-softmax state, merged once at the end (reductions over the warp axis of 3-D tensors;
    mma.sync m16n8k16 with one warp per batch index). No barrier inside the loop.
  * S = q K^T: q (the Hq/Hkv x Sq rows of one KV head, zero-padded to 16) is the A operand, K the B operand
    [head dim, tokens]. A permuted contraction order (_mma_order: byte j = (R/4) t + 4 kb + 2 i1 + i0 of a row of R
    bytes is MMA index 16 kb + 8 i1 + 2 t + i0) gives thread (g, t) of a warp R/4 contiguous bytes of each of its
    token rows: 16-byte loads. q is permuted the same way once per program and re-read from shared memory at
    every step (registers go to the loads in flight). NVFP4: low and high nibbles are two products over D/2 (q's
    even and odd dims), as in the GEMM.
  * O += P V: P comes from S's accumulator registers (the accumulator -> A operand shortcut), V is the B operand
    [tokens, head dim] with a permuted head dim (MMA column 8 j + g is dim (D/8) g + j), so thread g holds D/8
    contiguous dims of each of its tokens {2t, 2t+1, 2t+8, 2t+9} (+16): one load per token; the two tokens of an
    MMA register pair are interleaved byte-wise (PRMT) before the widening. The output store undoes the order.
    PV_T (at most 8 rows, e.g. GQA 4 x 1 token): O^T [D, 8] += V^T P^T instead, V^T the A operand in the same
    dim order and P^T's B fragment S's accumulator rows 0..7 as held (half the products, a 32-register
    accumulator; the per-row rescale factors move to O^T's columns by two shuffles).
  * Widening: e2m1 -> e4m3 by bit placement
    (quant.e2m1_f16x2_ptx, e2m1 * 2^-6), then f16x2 multiplies by the e4m3 block scale (exact: at most 6 significant
    bits, never below 2^-16). The global scales fold into the logit scale and
    the final normalisation. q is fp16, scaled per row by a power of two (common.fp16_row_scale).

Serves flash_attn_with_kvcache for NVFP4 caches on sm_90 when plan/decode.py's quant_mma_config accepts the call
(rows <= 16, head dim 64/128, contiguous or power-of-two pages, 16-byte aligned rows). FP8 caches take the Triton
kernel: an FP8 path here (e4m3x2 -> f16x2 widening) measured slower and was removed (session 20, `python -m tileflash
sweep decode-quant`: b=1 ctx 32k 27.6 vs 26.2 us, b=64 ctx 4k 153.2 vs 138.9); other calls take the Triton kernel. What
bounds it: the ALU pipe (~2 instructions per NVFP4 value, the widening ~1.6 of them; Nsight Compute run 95).
Grid (B * Hkv, num_splits), WARPS warps; split s covers its share of the sequence's visible keys
in blocks of WARPS * BN tokens; split partials go to o_part / lse_part as attn_fwd's do (attn_combine merges them).
No CPU interpreter: tests/sm90_compile_check.py compiles it, tests/kernels/test_gluon_decode_mma.py runs it on the GPU.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mma_v2

from ..triton.masks import LOG2E
from .common import DECODE_UNIT, allow_dependents, barrier, fp16_row_scale
from ...lowp.kernels.quant import e2m1_f16x2_ptx

M_ROWS = gl.constexpr(16)  # mma.sync's M: query rows (heads x tokens of one KV head) per program
LN2 = gl.constexpr(0.6931471805599453)

_NVFP4_HEAD = """
        .reg .b32 l, h, t, r, s2, x, y;
        .reg .b16 l0, l1, h0, h1, sh, sx;"""

# Two words of one token's block (bytes 0-3, 4-7) and its scale byte -> 16 fp16: the low nibbles of bytes 0..7,
# then the high nibbles, each times the scale (e2m1 * scale * 2^-6).
_NVFP4_K_ASM = gl.constexpr("{" + _NVFP4_HEAD + """
        prmt.b32 t, $18, $18, 0x0;
        mov.b32 {sh, sx}, t;
        cvt.rn.f16x2.e4m3x2 s2, sh;"""
                            + e2m1_f16x2_ptx("$16", (("$0", "$1"), ("$2", "$3"), ("$8", "$9"), ("$10", "$11")), "s2")
                            + e2m1_f16x2_ptx("$17", (("$4", "$5"), ("$6", "$7"), ("$12", "$13"), ("$14", "$15")),
                                             "s2")
                            + "}")

# Words a, b of two tokens (same dims) and their scale bytes -> 16 fp16: for each of the word's 8 dims (byte k's
# low nibble is dim 2k, its high nibble 2k + 1), token a's then token b's value, each times its token's scale.
_NVFP4_V_ASM = gl.constexpr("{" + _NVFP4_HEAD + """
        prmt.b32 t, $18, $19, 0x40;
        mov.b32 {sh, sx}, t;
        cvt.rn.f16x2.e4m3x2 s2, sh;
        prmt.b32 x, $16, $17, 0x5140;
        prmt.b32 y, $16, $17, 0x7362;"""
                            + e2m1_f16x2_ptx("x", (("$0", "$1"), ("$4", "$5"), ("$2", "$3"), ("$6", "$7")), "s2")
                            + e2m1_f16x2_ptx("y", (("$8", "$9"), ("$12", "$13"), ("$10", "$11"), ("$14", "$15")), "s2")
                            + "}")


def _constraints(n_out: int, n_in: int) -> gl.constexpr:
    return gl.constexpr(",".join(["=h"] * n_out + ["r"] * n_in))


_NVFP4_K_IO = _constraints(16, 3)
_NVFP4_V_IO = _constraints(16, 4)


@gluon.jit
def _asm(asm: gl.constexpr, constraints: gl.constexpr, args, n_out: gl.constexpr):
    return gl.inline_asm_elementwise(asm=asm, constraints=constraints, args=args, dtype=(gl.float16,) * n_out,
                                     is_pure=True, pack=1)


@gluon.jit
def _stack4(x0, x1, x2, x3, A: gl.constexpr, B: gl.constexpr, C: gl.constexpr):
    """Four [A, B, C] tensors -> [A, B, C, 4] with x_i at index i of the new last dim."""
    return gl.reshape(gl.join(gl.join(x0, x2), gl.join(x1, x3)), [A, B, C, 4])


@gluon.jit
def _stack8(x0, x1, x2, x3, x4, x5, x6, x7, A: gl.constexpr, B: gl.constexpr, C: gl.constexpr):
    return gl.reshape(gl.join(_stack4(x0, x2, x4, x6, A, B, C), _stack4(x1, x3, x5, x7, A, B, C)), [A, B, C, 8])


@gluon.jit
def _stack16(xs, A: gl.constexpr, B: gl.constexpr, C: gl.constexpr):
    ev = _stack8(xs[0], xs[2], xs[4], xs[6], xs[8], xs[10], xs[12], xs[14], A, B, C)
    od = _stack8(xs[1], xs[3], xs[5], xs[7], xs[9], xs[11], xs[13], xs[15], A, B, C)
    return gl.reshape(gl.join(ev, od), [A, B, C, 16])


@gluon.jit
def _mma_order(x, A: gl.constexpr, B: gl.constexpr, J: gl.constexpr):
    """x [A, B, J] with row byte j = (J/4) t + 4 kb + 2 i1 + i0 along dim 2 -> the same values at MMA index
    kk = 16 kb + 8 i1 + 2 t + i0 (thread t's bytes of a row are contiguous)."""
    x = gl.reshape(x, [A, B, 4, J // 16, 2, 2])
    return gl.reshape(gl.permute(x, [0, 1, 3, 4, 2, 5]), [A, B, J])


@gluon.constexpr_function
def _mma_layout(warps):
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1, 1], instr_shape=[1, 16, 8])


@gluon.constexpr_function
def _warp_bases(warps):
    return [[1 << i, 0, 0] for i in range((warps).bit_length() - 1)]


@gluon.constexpr_function
def _k_layout(warps, bn, words):
    """Registers of K words [warps, bn tokens, words per row]: thread (g, t) holds tokens g + 8 i and a
    contiguous quarter of each row (one vector load per token)."""
    per = words // 4
    reg = [[0, 0, 1 << i] for i in range(per.bit_length() - 1)]
    reg += [[0, 8 << i, 0] for i in range((bn // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=reg, lane_bases=[[0, 0, per], [0, 0, 2 * per], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=_warp_bases(warps), block_bases=[], shape=[warps, bn, words])


@gluon.constexpr_function
def _v_layout(warps, bn, words):
    """Registers of V words [warps, bn tokens, words per row]: thread (g, t) holds tokens 2t + {0, 1} + {0, 8}
    (+16 i) and the g-th eighth of each row (contiguous words first: one vector load per token)."""
    per = words // 8
    reg = [[0, 0, 1 << i] for i in range(per.bit_length() - 1)] + [[0, 1, 0], [0, 8, 0]]
    reg += [[0, 16 << i, 0] for i in range((bn // 16).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=reg, lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, per], [0, 0, 2 * per], [0, 0, 4 * per]],
        warp_bases=_warp_bases(warps), block_bases=[], shape=[warps, bn, words])


@gluon.jit
def _row_offsets(tok, ok, bt_row, stride_page, stride_tok, stride_page_s, stride_tok_s, PAGE_SHIFT: gl.constexpr):
    """int64 offsets of tokens in a sequence's cache (and in its scales): contiguous, or pages of 2^PAGE_SHIFT
    tokens through the block table row bt_row."""
    if PAGE_SHIFT >= 0:
        page = gl.load(bt_row + (tok >> PAGE_SHIFT), mask=ok, other=0).to(gl.int64)
        row = (tok & ((1 << PAGE_SHIFT) - 1)).to(gl.int64)
        off = page * stride_page + row * stride_tok
        off_s = page * stride_page_s + row * stride_tok_s
    else:
        off = tok.to(gl.int64) * stride_tok
        off_s = tok.to(gl.int64) * stride_tok_s
    return off, off_s


@gluon.jit
def _load_words(base, t0, s_hi, bt_row, stride_page, stride_tok, stride_page_s, stride_tok_s, lay: gl.constexpr,
                WARPS: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr, PAGE_SHIFT: gl.constexpr):
    """Words [WARPS, BN, NW] of the rows of tokens t0 + BN w + n in registers `lay` (tokens from s_hi on load as 0),
    with the tokens' in-range mask and their offsets in the scale tensors."""
    w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, lay)))
    n = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, lay)))
    tok = t0 + gl.expand_dims(w, 1) * BN + gl.expand_dims(n, 0)
    ok = tok < s_hi
    off, off_s = _row_offsets(tok, ok, bt_row, stride_page, stride_tok, stride_page_s, stride_tok_s, PAGE_SHIFT)
    wi = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(1, lay))), 0), 1)
    ptr = (base + gl.expand_dims(off, 2)).to(gl.pointer_type(gl.int32)) + wi
    return gl.load(ptr, mask=gl.expand_dims(ok, 2), other=0), ok, off_s


@gluon.jit
def _load_k(k_base, ks_base, t0, s_hi, bt_row, stride_page, stride_tok, stride_page_s, stride_tok_s,
            WARPS: gl.constexpr, BN: gl.constexpr, KW: gl.constexpr, PAGE_SHIFT: gl.constexpr):
    """K words [WARPS, BN, KW] of tokens t0 + BN w + n and the scale byte of each word pair (16 values), in the
    registers of the pairs _k_operands splits off."""
    words, ok, off_s = _load_words(k_base, t0, s_hi, bt_row, stride_page, stride_tok, stride_page_s, stride_tok_s,
                                   _k_layout(WARPS, BN, KW), WARPS, BN, KW, PAGE_SHIFT)
    s_lay: gl.constexpr = _k_layout(WARPS, BN, KW // 2)
    s_off = gl.convert_layout(off_s, gl.SliceLayout(2, s_lay))
    s_ok = gl.convert_layout(ok, gl.SliceLayout(2, s_lay))
    blk = gl.arange(0, KW // 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, s_lay)))
    sp = ks_base + gl.expand_dims(s_off, 2) + gl.expand_dims(gl.expand_dims(blk, 0), 1)
    return words, gl.load(sp, mask=gl.expand_dims(s_ok, 2), other=0).to(gl.int32)


@gluon.jit
def _load_v(v_base, vs_base, t0, s_hi, bt_row, stride_page, stride_tok, stride_page_s, stride_tok_s,
            WARPS: gl.constexpr, BN: gl.constexpr, VW: gl.constexpr, PAGE_SHIFT: gl.constexpr):
    """V words [WARPS, BN, VW] and each word's scale byte (a word holds 8 dims, a block 16)."""
    lay: gl.constexpr = _v_layout(WARPS, BN, VW)
    words, ok, off_s = _load_words(v_base, t0, s_hi, bt_row, stride_page, stride_tok, stride_page_s, stride_tok_s,
                                   lay, WARPS, BN, VW, PAGE_SHIFT)
    # the two words of a token's block load the same scale byte (the compiler merges the loads)
    blk = gl.arange(0, VW, layout=gl.SliceLayout(0, gl.SliceLayout(1, lay))) // 2
    sp = vs_base + gl.expand_dims(off_s, 2) + gl.expand_dims(gl.expand_dims(blk, 0), 1)
    return words, gl.load(sp, mask=gl.expand_dims(ok, 2), other=0).to(gl.int32)


@gluon.jit
def _k_operands(words, scales, WARPS: gl.constexpr, BN: gl.constexpr, KW: gl.constexpr):
    """K words -> the B operands [WARPS, row values, BN] in MMA order (low nibbles, high nibbles)."""
    mma: gl.constexpr = _mma_layout(WARPS)
    b_dot: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    we, wo = gl.split(gl.reshape(words, [WARPS, BN, KW // 2, 2]))
    xs = _asm(_NVFP4_K_ASM, _NVFP4_K_IO, [we, wo, gl.convert_layout(scales, we.type.layout)], 16)
    lo = _stack8(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], WARPS, BN, KW // 2)
    hi = _stack8(xs[8], xs[9], xs[10], xs[11], xs[12], xs[13], xs[14], xs[15], WARPS, BN, KW // 2)
    lo = gl.permute(_mma_order(gl.reshape(lo, [WARPS, BN, KW * 4]), WARPS, BN, KW * 4), [0, 2, 1])
    hi = gl.permute(_mma_order(gl.reshape(hi, [WARPS, BN, KW * 4]), WARPS, BN, KW * 4), [0, 2, 1])
    return gl.convert_layout(lo, b_dot, assert_trivial=True), gl.convert_layout(hi, b_dot, assert_trivial=True)


@gluon.jit
def _v_operand(words, scales, WARPS: gl.constexpr, BN: gl.constexpr, VW: gl.constexpr, D: gl.constexpr,
               PV_T: gl.constexpr):
    """V words -> the B operand [WARPS, BN, D] with the head dim in MMA order (column 8 j + g = dim (D/8) g + j);
    PV_T: the A operand [WARPS, D, BN] of O^T += V^T P^T, the head dim in the same order."""
    mma: gl.constexpr = _mma_layout(WARPS)
    b_dot: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    wa, wb = gl.split(gl.permute(gl.reshape(words, [WARPS, BN // 2, 2, VW]), [0, 1, 3, 2]))
    sa, sb = gl.split(gl.permute(gl.reshape(scales, [WARPS, BN // 2, 2, VW]), [0, 1, 3, 2]))
    xs = _asm(_NVFP4_V_ASM, _NVFP4_V_IO, [wa, wb, sa, sb], 16)
    v = gl.reshape(_stack16(xs, WARPS, BN // 2, VW), [WARPS, BN // 2, VW, 8, 2])
    v = gl.reshape(gl.permute(v, [0, 1, 4, 2, 3]), [WARPS, BN, D])  # token 2p + i, dim (values per word) w + k
    v = gl.reshape(gl.permute(gl.reshape(v, [WARPS, BN, 8, D // 8]), [0, 1, 3, 2]), [WARPS, BN, D])
    if PV_T:  # V^T as the A operand [WARPS, D, BN]: row 16 i + 8 h + g of an m16 tile is the same dim order
        v_op = gl.convert_layout(gl.permute(v, [0, 2, 1]),
                                 gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2), assert_trivial=True)
    else:
        v_op = gl.convert_layout(v, b_dot, assert_trivial=True)
    return v_op


@gluon.jit
def _q_operands(q_ptr, q_row, row_ok, WARPS: gl.constexpr, D: gl.constexpr):
    """q rows [16, D] (row offsets q_row) -> A operands [WARPS, 16, D / 2] in MMA order (every warp a copy), fp16
    scaled per row by 2^k, and 2^-k per row: even dims, odd dims."""
    mma: gl.constexpr = _mma_layout(WARPS)
    a_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    lay: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [WARPS, 1, 1], [2, 1, 0])
    rows: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, lay))
    row3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(q_row, rows), 0), 2)
    ok3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(row_ok, rows), 0), 2)
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, lay))), 0), 1)
    w3 = gl.expand_dims(gl.expand_dims(gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, lay))), 1), 2)
    x = gl.load(q_ptr + (row3 + d3 + w3 * 0), mask=ok3, other=0.0).to(gl.float32)  # every warp loads all rows
    ax = gl.abs(x)
    up, down = fp16_row_scale(gl.max(gl.where(ax < float("inf"), ax, 0.0), 2))
    x = (x * gl.expand_dims(up, 2)).to(gl.float16)
    ev, od = gl.split(gl.reshape(x, [WARPS, M_ROWS, D // 2, 2]))
    q_a = gl.convert_layout(_mma_order(ev, WARPS, M_ROWS, D // 2), a_dot)
    q_b = gl.convert_layout(_mma_order(od, WARPS, M_ROWS, D // 2), a_dot)
    return q_a, q_b, gl.max(down, 0)


@gluon.jit
def _rows8(x, WARPS: gl.constexpr, C: gl.constexpr):
    """x [WARPS, 16, C] -> its rows 0..7 [WARPS, 8, C] (row bit 3 is a register of the MMA layouts: no movement)."""
    lo, hi = gl.split(gl.permute(gl.reshape(x, [WARPS, 2, 8, C]), [0, 2, 3, 1]))
    return lo


@gluon.jit
def _cols8(x, WARPS: gl.constexpr):
    """Per-row values [WARPS, 16] (rows as S's accumulator holds them) -> rows 0..7 as the columns of O^T's
    accumulator [WARPS, 8] (a shuffle within each warp)."""
    mma: gl.constexpr = _mma_layout(WARPS)
    lo, hi = gl.split(gl.permute(gl.reshape(x, [WARPS, 2, 8]), [0, 2, 1]))
    return gl.convert_layout(lo, gl.SliceLayout(1, mma))


@gluon.jit
def _tanh(y):
    """As inner.tanh: 1 - 2 / (exp(2y) + 1), and y - y^3/3 below |y| = 2^-6."""
    return gl.where(gl.abs(y) < 0.015625, y - y * y * y * 0.3333333333333333, 1.0 - 2.0 / (gl.exp(2.0 * y) + 1.0))


@gluon.jit
def decode_quant_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kfac_ptr, vfac_ptr, out_ptr, lse_ptr, o_part_ptr, lse_part_ptr,
        seqlens_ptr, bt_ptr,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, stride_bt,
        seqlen_q, capacity, seqlen_k_add, num_heads_kv, group, rows_per_split,
        softmax_scale, softcap, window_left, window_right,
        D: gl.constexpr, BN: gl.constexpr, WARPS: gl.constexpr, PAGE_SHIFT: gl.constexpr,
        HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, SPLIT: gl.constexpr,
        PV_T: gl.constexpr, PDL: gl.constexpr = False):
    """NVFP4 caches (uint8, ks/vs the e4m3 block scales as bytes, kfac/vfac the global scales [1]). K and V share
    strides (stride_k*; the scales stride_s*); paged: stride_kb/stride_sb are the page strides, PAGE_SHIFT >= 0."""
    mma: gl.constexpr = _mma_layout(WARPS)
    a_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    RB: gl.constexpr = D // 2  # bytes per K/V row
    NW: gl.constexpr = RB // 4  # words per row
    STEP: gl.constexpr = WARPS * BN
    pid = gl.program_id(0)
    split = gl.program_id(1)
    if PDL:  # the split combine after it is a programmatic dependent launch (launch/forward.launch_combine)
        allow_dependents(pid)
    b = pid // num_heads_kv
    h = pid % num_heads_kv
    seqlen_k = gl.minimum(gl.load(seqlens_ptr + b) + seqlen_k_add, capacity)
    diag = seqlen_k - seqlen_q

    # Rows r = token * group + head-in-group (pack-GQA, as attn_fwd).
    rows_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, mma))
    r = gl.arange(0, M_ROWS, layout=rows_l)
    row_ok = r < seqlen_q * group
    tok_q = r // group
    head_q = h * group + r % group
    q_row = b.to(gl.int64) * stride_qb + tok_q.to(gl.int64) * stride_qs + head_q.to(gl.int64) * stride_qh
    q_ev, q_od, q_down = _q_operands(q_ptr, q_row, row_ok, WARPS, D)
    # q is re-read from shared memory at every step (ldmatrix), not held: registers for the loads in flight
    # (run 93: b=64 ctx 4k 143.0 us vs 147.7 with q in registers).
    KD: gl.constexpr = D // 2
    q_lay: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])
    q_ev_s = gl.allocate_shared_memory(gl.float16, [WARPS, M_ROWS, KD], q_lay, q_ev)
    q_od_s = gl.allocate_shared_memory(gl.float16, [WARPS, M_ROWS, KD], q_lay, q_od)
    barrier()

    kfac = gl.load(kfac_ptr) * DECODE_UNIT
    vfac = gl.load(vfac_ptr) * DECODE_UNIT
    row_scale = gl.convert_layout(q_down, rows_l) * (softmax_scale * kfac)
    if SOFTCAP:
        logit_scale = row_scale / softcap
    else:
        logit_scale = row_scale * LOG2E
    q_pos = gl.expand_dims(gl.expand_dims(tok_q + diag, 0), 2)  # [1, 16, 1]

    # Visible keys of all rows, this split's share in STEP-token blocks.
    n_lo = 0
    n_hi = seqlen_k
    if HAS_LEFT:
        n_lo = gl.maximum(diag - window_left, 0)
    n_hi = gl.maximum(n_hi, n_lo)
    per_split = gl.cdiv(gl.cdiv(n_hi - n_lo, STEP), gl.num_programs(1)) * STEP
    s_lo = n_lo + split * per_split
    s_hi = gl.minimum(s_lo + per_split, n_hi)
    n_iter = gl.cdiv(gl.maximum(s_hi - s_lo, 0), STEP)

    if PAGE_SHIFT >= 0:
        k_base = k_ptr + h.to(gl.int64) * stride_kh
        v_base = v_ptr + h.to(gl.int64) * stride_kh
        ks_base = ks_ptr + h.to(gl.int64) * stride_sh
        vs_base = vs_ptr + h.to(gl.int64) * stride_sh
        bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    else:
        k_base = k_ptr + b.to(gl.int64) * stride_kb + h.to(gl.int64) * stride_kh
        v_base = v_ptr + b.to(gl.int64) * stride_kb + h.to(gl.int64) * stride_kh
        ks_base = ks_ptr + b.to(gl.int64) * stride_sb + h.to(gl.int64) * stride_sh
        vs_base = vs_ptr + b.to(gl.int64) * stride_sb + h.to(gl.int64) * stride_sh
        bt_row = bt_ptr

    wi = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
    ni = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
    key_off = gl.expand_dims(gl.expand_dims(wi, 1), 2) * BN + gl.expand_dims(gl.expand_dims(ni, 0), 1)  # [W, 1, BN]
    scale3 = gl.expand_dims(gl.expand_dims(logit_scale, 0), 2)

    m_i = gl.full([WARPS, M_ROWS], float("-inf"), gl.float32, gl.SliceLayout(2, mma))
    l_i = gl.zeros([WARPS, M_ROWS], gl.float32, gl.SliceLayout(2, mma))
    if PV_T:  # at most 8 rows: O^T [D, 8] = V^T P^T, P^T straight from S's accumulator rows 0..7
        acc = gl.zeros([WARPS, D, 8], gl.float32, mma)
    else:
        acc = gl.zeros([WARPS, M_ROWS, D], gl.float32, mma)
    kw, ksc = _load_k(k_base, ks_base, s_lo, s_hi, bt_row, stride_kb, stride_ks, stride_sb, stride_ss,
                      WARPS, BN, NW, PAGE_SHIFT)
    vw, vsc = _load_v(v_base, vs_base, s_lo, s_hi, bt_row, stride_kb, stride_ks, stride_sb, stride_ss,
                      WARPS, BN, NW, PAGE_SHIFT)
    for it in range(n_iter):
        t0 = s_lo + it * STEP
        # The next block's bytes are in flight while this one is decoded and multiplied.
        kw_n, ksc_n = _load_k(k_base, ks_base, t0 + STEP, s_hi, bt_row, stride_kb, stride_ks, stride_sb, stride_ss,
                              WARPS, BN, NW, PAGE_SHIFT)
        vw_n, vsc_n = _load_v(v_base, vs_base, t0 + STEP, s_hi, bt_row, stride_kb, stride_ks, stride_sb,
                              stride_ss, WARPS, BN, NW, PAGE_SHIFT)
        k_a, k_b = _k_operands(kw, ksc, WARPS, BN, NW)
        s = gl.zeros([WARPS, M_ROWS, BN], gl.float32, mma)
        s = mma_v2(q_ev_s.load(a_dot), k_a, s)
        s = mma_v2(q_od_s.load(a_dot), k_b, s)
        if SOFTCAP:
            s = (softcap * LOG2E) * _tanh(s * scale3)
        else:
            s = s * scale3
        k_pos = t0 + key_off
        ok = k_pos < s_hi
        if HAS_RIGHT:
            ok = ok & (k_pos <= q_pos + window_right)
        if HAS_LEFT:
            ok = ok & (k_pos >= q_pos - window_left)
        s = gl.where(ok, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 2))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 2))
        l_i = l_i * alpha + gl.sum(p, 2)
        v_op = _v_operand(vw, vsc, WARPS, BN, NW, D, PV_T)
        if PV_T:
            p8 = _rows8(p.to(gl.float16), WARPS, BN)
            p_t = gl.convert_layout(gl.permute(p8, [0, 2, 1]), gl.DotOperandLayout(operand_index=1, parent=mma,
                                                                                     k_width=2))
            acc = acc * gl.expand_dims(_cols8(alpha, WARPS), 1)
            acc = mma_v2(v_op, p_t, acc)
        else:
            acc = acc * gl.expand_dims(alpha, 2)
            acc = mma_v2(gl.convert_layout(p.to(gl.float16), a_dot), v_op, acc)
        m_i = m_new
        kw, ksc, vw, vsc = kw_n, ksc_n, vw_n, vsc_n

    # Merge the warps' states (each saw its own tokens), normalise, store; rows that saw no key: o = 0, lse = -inf.
    m_all = gl.max(m_i, 0)
    m_use = gl.where(m_all == float("-inf"), 0.0, m_all)
    f = gl.exp2(m_i - gl.expand_dims(m_use, 0))
    l_all = gl.sum(l_i * f, 0)
    seen = l_all > 0.0
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_all, 1.0), 0.0) * vfac
    lse = gl.where(seen, (m_all + gl.log2(gl.where(seen, l_all, 1.0))) * LN2, float("-inf"))
    if PV_T:
        o = gl.permute(gl.sum(acc * gl.expand_dims(_cols8(f, WARPS), 1), 0), [1, 0])  # [8, D]
        inv_rows = _rows8(gl.expand_dims(inv_l, 0), 1, 1)
        OR: gl.constexpr = 8
    else:
        o = gl.sum(acc * gl.expand_dims(f, 2), 0)  # [16, D], columns in MMA order
        inv_rows = inv_l
        OR: gl.constexpr = M_ROWS
    out_l: gl.constexpr = o.type.layout
    o = o * gl.expand_dims(gl.convert_layout(gl.reshape(inv_rows, [OR]), gl.SliceLayout(1, out_l)), 1)
    n = gl.arange(0, D, layout=gl.SliceLayout(0, out_l))
    dim = (n % 8) * (D // 8) + n // 8
    ro = gl.arange(0, OR, layout=gl.SliceLayout(1, out_l))
    o_ok = gl.expand_dims(ro < seqlen_q * group, 1) & gl.expand_dims(n < D, 0)
    tq = ro // group
    hq = h * group + ro % group
    if SPLIT:
        part = split.to(gl.int64) * rows_per_split + ((b * seqlen_q + tq) * (num_heads_kv * group) + hq).to(gl.int64)
        gl.store(o_part_ptr + gl.expand_dims(part * D, 1) + gl.expand_dims(dim, 0), o, mask=o_ok)
        l_part = split.to(gl.int64) * rows_per_split + ((b * seqlen_q + tok_q) * (num_heads_kv * group)
                                                         + head_q).to(gl.int64)
        gl.store(lse_part_ptr + l_part, lse, mask=row_ok)
    else:
        o_row = b.to(gl.int64) * stride_ob + tq.to(gl.int64) * stride_os + hq.to(gl.int64) * stride_oh
        gl.store(out_ptr + gl.expand_dims(o_row, 1) + gl.expand_dims(dim, 0), o.to(out_ptr.dtype.element_ty),
                 mask=o_ok)
        l_off = b.to(gl.int64) * stride_lb + head_q.to(gl.int64) * stride_lh + tok_q.to(gl.int64) * stride_ls
        gl.store(lse_ptr + l_off, lse, mask=row_ok)
