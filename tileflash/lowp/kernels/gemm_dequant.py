"""NVFP4 weight GEMM: c = a @ dequant(b)^T with b stored as NVFP4 (format: tileflash/lowp/formats.py), and a either
16-bit (W4A16) or NVFP4 too (W4A4: both operands quantized by nvfp4_quantize).

Notation: a [M, K] fp16/bf16, or a_data [M, K/2] uint8 with a_scales [M, K/16] and its global scale; b quantized
from [N, K]: b_data [N, K/2] uint8 (two e2m1 codes per byte), b_scales [N, K/16] e4m3 bits, g the float32 global
scale; c [M, N]. K is a multiple of 16, so the K tail of the last tile is a whole number of scale blocks (masked
to zero: code 0 and scale 0 are both +0).

Each program owns a [BLOCK_M, BLOCK_N] tile of c (and, for decode-sized M, one of SPLIT_K slices of K: N / BLOCK_N
tiles alone would leave most SMs idle; the caller sums the fp32 partials). Per K step it loads the packed nibbles
and scales of a [BLOCK_N, BLOCK_K] slice of b, decodes e2m1 * scale in registers with bit arithmetic on the 4-bit
codes (no table gather; scaled by 2^-14, see quant.nvfp4_unpack_tile), and feeds tl.dot in a's dtype (exact:
e2m1 * e4m3 has at most 6 significant bits) with an fp32 accumulator. g * 2^14 multiplies the accumulator once at
the end instead of every element of b. An NVFP4 a is decoded the same way (both operands fp16, exact), except on
targets with a native block-scaled MMA (NATIVE_FP4: sm_100's tcgen05 and sm_120's mma.sync kind::mxf4nvf4 with
e4m3 scales per 16 values), where tl.dot_scaled feeds the packed codes and scales to the tensor cores as stored.
"""
import triton
import triton.language as tl

from ...kernels.triton.cast import store_cast
from .quant import E2M1_UNIT, nvfp4_unpack_tile


@triton.jit
def _scale_bits(s_ptr, r64, r_ok, stride_sr, stride_sk, k0, K, BLOCK_K: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """The e4m3 scale bits of rows r64, K values [k0, k0 + BLOCK_K): [rows, BLOCK_K / 16] bytes, or with
    SCALE_WORDS [rows, BLOCK_K / 64] int32 words of four (rows 4-byte aligned; loads through the copy pipeline)."""
    if SCALE_WORDS:
        offs_w = k0 // 64 + tl.arange(0, BLOCK_K // 64)
        bits = tl.load((s_ptr + r64[:, None] * stride_sr).to(tl.pointer_type(tl.int32)) + offs_w[None, :],
                       mask=r_ok[:, None] & (offs_w < K // 64)[None, :], other=0)
    else:
        offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        bits = tl.load(s_ptr + r64[:, None] * stride_sr + offs_s[None, :] * stride_sk,
                       mask=r_ok[:, None] & (offs_s < K // 16)[None, :], other=0)
    return bits  # one return: a static if with a return in each branch fails Triton's return-type check


@triton.jit
def _codes(d_ptr, r64, r_ok, stride_dr, stride_dk, k0, K, BLOCK_K: tl.constexpr):
    """The packed e2m1 codes of rows r64, K values [k0, k0 + BLOCK_K): [rows, BLOCK_K / 2] bytes."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    return tl.load(d_ptr + r64[:, None] * stride_dr + offs_b[None, :] * stride_dk,
                   mask=r_ok[:, None] & (offs_b < K // 2)[None, :], other=0)


@triton.jit
def nvfp4_matmul_kernel(a_ptr, as_ptr, ga_ptr, b_ptr, s_ptr, g_ptr, c_ptr, M, N, K, k_per_split,
                        stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk, stride_sn, stride_sk,
                        stride_cm, stride_cn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        UPCAST: tl.constexpr, SCALE_WORDS: tl.constexpr, SWAP_AB: tl.constexpr,
                        A_NVFP4: tl.constexpr, NATIVE_FP4: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of c over K range [split * k_per_split, ...) of program_id(2). SPLIT_K > 1:
    c_ptr is an fp32 workspace [SPLIT_K, M, N] (stride_cm, stride_cn for M, N; splits are M * N apart) that the
    caller sums in a fixed order, so results are bitwise reproducible. SCALE_WORDS: scale rows (of b, and of a when
    A_NVFP4) are 4-byte aligned and K, BLOCK_K multiples of 64, so the scales load as int32 words of four.
    SWAP_AB computes c^T = w a^T: for decode-sized M the weight tile fills the MMA's M side instead of a 16-row
    tile of a. A_NVFP4: a_ptr holds a's packed codes [M, K/2] (strides in bytes), as_ptr its scale bits, ga_ptr
    its global scale (unused otherwise). NATIVE_FP4 (with A_NVFP4): the block-scaled MMA on the stored codes.
    WEIGHTS_FIRST: each K step issues b's loads before a's (the order the software pipeliner keeps; GemmConfig
    says which order each tile was measured faster with)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = offs_m < M, offs_n < N
    m64, n64 = offs_m.to(tl.int64), offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if WEIGHTS_FIRST:
            packed = _codes(b_ptr, n64, n_ok, stride_bn, stride_bk, k0, K, BLOCK_K)
        if A_NVFP4:
            a = _codes(a_ptr, m64, m_ok, stride_am, stride_ak, k0, K, BLOCK_K)
        else:
            a = tl.load(a_ptr + m64[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                        mask=m_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        if not WEIGHTS_FIRST:
            packed = _codes(b_ptr, n64, n_ok, stride_bn, stride_bk, k0, K, BLOCK_K)
        if NATIVE_FP4:  # bytes of e4m3 scales, [rows, BLOCK_K / 16], as the block-scaled MMA reads them
            s_b = _scale_bits(s_ptr, n64, n_ok, stride_sn, stride_sk, k0, K, BLOCK_K, False)
            s_a = _scale_bits(as_ptr, m64, m_ok, stride_asm, stride_ask, k0, K, BLOCK_K, False)
            s_b = s_b.to(tl.float8e4nv, bitcast=True)
            s_a = s_a.to(tl.float8e4nv, bitcast=True)
            if SWAP_AB:
                acc = tl.dot_scaled(packed, s_b, "e2m1", tl.trans(a), s_a, "e2m1", acc)
            else:
                acc = tl.dot_scaled(a, s_a, "e2m1", tl.trans(packed), s_b, "e2m1", acc)
        else:
            s_bits = _scale_bits(s_ptr, n64, n_ok, stride_sn, stride_sk, k0, K, BLOCK_K, SCALE_WORDS)
            w = nvfp4_unpack_tile(packed, s_bits, BLOCK_N, BLOCK_K, True)  # pure PTX: see nvfp4_unpack_tile
            if A_NVFP4:
                a_bits = _scale_bits(as_ptr, m64, m_ok, stride_asm, stride_ask, k0, K, BLOCK_K, SCALE_WORDS)
                a = nvfp4_unpack_tile(a, a_bits, BLOCK_M, BLOCK_K, True)  # fp16, like w
            if UPCAST:  # interpreter: bf16 dots would run on raw bits, so both operands go to fp32
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            else:
                w = w.to(a.dtype)
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(w), acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    scale = tl.load(g_ptr)
    if A_NVFP4:
        scale *= tl.load(ga_ptr)
    if not NATIVE_FP4:  # the decoded tiles carry 2^-14 each
        scale *= E2M1_UNIT
        if A_NVFP4:
            scale *= E2M1_UNIT
    c = acc * scale
    c_off = m64[:, None] * stride_cm + n64[None, :] * stride_cn
    c_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        tl.store(c_ptr + split.to(tl.int64) * M * N + c_off, c, mask=c_ok)
    else:
        tl.store(c_ptr + c_off, store_cast(c, c_ptr.dtype.element_ty, UPCAST), mask=c_ok)
