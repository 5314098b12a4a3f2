"""NVFP4 weight GEMM: c = a @ dequant(b)^T with b stored as NVFP4 (format: tileflash/lowp/formats.py).

Notation: a [M, K] fp16/bf16; b quantized from [N, K]: b_data [N, K/2] uint8 (two e2m1 codes per byte), b_scales
[N, K/16] e4m3 bits, g the float32 global scale; c [M, N] in a's dtype. K is a multiple of 16, so the K tail of
the last tile is a whole number of scale blocks (masked to zero).

Each program owns a [BLOCK_M, BLOCK_N] tile of c (and, for decode-sized M, one of SPLIT_K slices of K: N / BLOCK_N
tiles alone would leave most SMs idle; the caller sums the fp32 partials). Per K step it loads the packed nibbles
and scales of a [BLOCK_N, BLOCK_K] slice of b, decodes e2m1 * scale in registers with bit arithmetic on the 4-bit
codes (no table gather; scaled by 2^-14, see quant.nvfp4_unpack_tile), and feeds tl.dot in a's dtype (exact:
e2m1 * e4m3 has at most 6 significant bits) with an fp32 accumulator. g * 2^14 multiplies the accumulator once at
the end instead of every element of b.
"""
import triton
import triton.language as tl

from ...kernels.triton.cast import store_cast
from .quant import E2M1_UNIT, nvfp4_unpack_tile


@triton.jit
def nvfp4_matmul_kernel(a_ptr, b_ptr, s_ptr, g_ptr, c_ptr, M, N, K, k_per_split,
                        stride_am, stride_ak, stride_bn, stride_bk, stride_sn, stride_sk, stride_cm, stride_cn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        UPCAST: tl.constexpr, SCALE_WORDS: tl.constexpr, SWAP_AB: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of c over K range [split * k_per_split, ...) of program_id(2). SPLIT_K > 1:
    c_ptr is an fp32 workspace [SPLIT_K, M, N] (stride_cm, stride_cn for M, N; splits are M * N apart) that the
    caller sums in a fixed order, so results are bitwise reproducible. SCALE_WORDS: scale rows are 4-byte aligned
    and K, BLOCK_K multiples of 64, so the scales load as int32 words of four (through the copy pipeline).
    SWAP_AB computes c^T = w a^T: for decode-sized M the dequantized weight tile fills the MMA's M side (wgmma with
    the weights as its register operand) instead of a 16-row tile of a."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = offs_m < M, offs_n < N
    m64, n64 = offs_m.to(tl.int64), offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_s = tl.arange(0, BLOCK_K // 16)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a = tl.load(a_ptr + m64[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                    mask=m_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        packed = tl.load(b_ptr + n64[:, None] * stride_bn + (k0 // 2 + offs_b)[None, :] * stride_bk,
                         mask=n_ok[:, None] & (k0 // 2 + offs_b < K // 2)[None, :], other=0)
        if SCALE_WORDS:
            offs_w = k0 // 64 + tl.arange(0, BLOCK_K // 64)
            s_bits = tl.load((s_ptr + n64[:, None] * stride_sn).to(tl.pointer_type(tl.int32)) + offs_w[None, :],
                             mask=n_ok[:, None] & (offs_w < K // 64)[None, :], other=0)
        else:
            s_bits = tl.load(s_ptr + n64[:, None] * stride_sn + (k0 // 16 + offs_s)[None, :] * stride_sk,
                             mask=n_ok[:, None] & (k0 // 16 + offs_s < K // 16)[None, :], other=0)
        w = nvfp4_unpack_tile(packed, s_bits, BLOCK_N, BLOCK_K, True)  # pure PTX: see nvfp4_unpack_tile
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
    c = acc * (tl.load(g_ptr) * E2M1_UNIT)
    c_off = m64[:, None] * stride_cm + n64[None, :] * stride_cn
    c_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        tl.store(c_ptr + split.to(tl.int64) * M * N + c_off, c, mask=c_ok)
    else:
        tl.store(c_ptr + c_off, store_cast(c, c_ptr.dtype.element_ty, UPCAST), mask=c_ok)
