"""NVFP4 quantize / dequantize kernels (format and rounding rules: tileflash/lowp/formats.py).

Notation: rows of x viewed as [R, K] (leading dims flattened), K a multiple of 16; each program owns a
[BLOCK_R, BLOCK_K] tile (BLOCK_K a multiple of 16, so a 16-element scale block never straddles programs).
  x:      [R, K] fp32 / fp16 / bf16 (any strides)
  data:   [R, K/2] uint8, element 2i in the low nibble, 2i+1 in the high nibble
  scales: [R, K/16] e4m3fn, handled as raw uint8 bits
  g:      the global scale, a float32 scalar read from memory (no host sync)

e4m3 is encoded with integer arithmetic rather than `.to(tl.float8e4nv)`: the interpreter's fp8 cast rounds half-up,
truncates subnormals and reads 0x7F as 480 instead of NaN, so only explicit bit maths gives the same bits on the CPU
and the GPU. Decoding uses the hardware conversion on the GPU (GPU_ASM: inline PTX, sm_89+) and the same bit maths
in the interpreter; both give the same bits. Divisions are `div_rn` (IEEE): Triton's `/` on fp32 is an approximate
division on NVIDIA GPUs, which would move ties by an ulp away from the PyTorch reference.
"""
import os

import triton
import triton.language as tl

from ...kernels.triton.cast import store_cast
from ..formats import E2M1_MAX as _E2M1_MAX, E4M3 as _E4M3

E2M1_MAX = tl.constexpr(_E2M1_MAX)
E4M3_MAX = tl.constexpr(_E4M3.max)
E4M3_NAN = tl.constexpr(0x7F)
E2M1_UNIT = tl.constexpr(16384.0)  # nvfp4_unpack_tile returns e2m1 * scale / E2M1_UNIT
# KV_NVFP4 values of the attention kernel: block scales read as bytes, or as int32 words of four (aligned rows).
NVFP4_SCALE_BYTES = tl.constexpr(1)
NVFP4_SCALE_WORDS = tl.constexpr(2)
# Added to either: the tile decode's inline PTX is marked pure. Blackwell's pipeliner (sm_100) cannot predicate
# impure inline asm and stops compiling; on sm_90 the impure form measured faster (see nvfp4_unpack_tile). Alone
# (an e4m3 cache off sm_90), for the same reason: its values widen by Triton's own cast, not e4m3_fp16_pinned.
# NVFP4 caches: KV_NVFP4 neither 0 nor NVFP4_PURE_ASM (comparisons: a launch may pass a plain int 0).
NVFP4_PURE_ASM = tl.constexpr(4)
# Inline PTX where a GPU compiles the kernels; the interpreter (fixed before any @triton.jit runs) cannot run it.
GPU_ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def e4m3_encode(s):
    """float32 s >= 0 (or NaN) -> e4m3fn bits (int32): round to nearest even, saturated to 448, NaN -> 0x7F.

    The fp32 significand (with its implicit bit) is shifted right by 20 for e4m3 normals (keeping 3 mantissa bits),
    and by 1 more per octave below e4m3's smallest normal 2^-6 (subnormals: multiples of 2^-9); the rounding
    increment is half - 1 + the kept lowest bit (ties to even). A carry out of the mantissa moves into the exponent
    by the plain addition below."""
    s = tl.where(s > E4M3_MAX, E4M3_MAX, s)
    bits = s.to(tl.int32, bitcast=True)
    e = bits >> 23  # biased fp32 exponent (s >= 0: no sign bit)
    sig = (bits & 0x7FFFFF) | 0x800000
    shift = 20 + tl.minimum(tl.maximum(121 - e, 0), 5)  # e = 121 is 2^-6; 5 more shifts reach every value < 2^-10
    r = (sig + ((1 << (shift - 1)) - 1) + ((sig >> shift) & 1)) >> shift
    code = tl.where(e >= 121, ((e - 120) << 3) + r - 8, r)  # normals: r = 1mmm in [8, 16]; subnormals: r = s / 2^-9
    return tl.where(s != s, E4M3_NAN, code)


@triton.jit
def e4m3_decode(bits):
    """e4m3fn bits (int32, low 8 bits) -> float32; 0x7F / 0xFF are NaN."""
    e = (bits >> 3) & 0xF
    m = bits & 7
    normal = ((e + 120) << 23) | (m << 20)  # rebias 7 -> 127
    subnormal = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2^-9, exact
    mag = tl.where(e == 0, subnormal, normal)
    v = (mag | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x7F) == E4M3_NAN, float("nan"), v)


@triton.jit
def e2m1_encode(v, negative):
    """Nearest e2m1 code (int32) of |v|, ties to the even code, saturating at 6; sign bit from `negative`; NaN -> 0.
    Each comparison adds one code step: strict at a tie whose lower code is even (0.25, 1.25, 2.5, 5), >= where the
    upper code is the even one (0.75, 1.75, 3.5)."""
    a = tl.abs(v)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return tl.where(v != v, 0, mag | (negative.to(tl.int32) << 3))


@triton.jit
def _rows(R, BLOCK_R: tl.constexpr):
    """This program's row indices as int64 (row offsets can pass 2^31 elements) and their in-range mask."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    return offs_r.to(tl.int64), offs_r < R


@triton.jit
def nvfp4_quantize_tile(x, g, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x [ROWS, COLS] (COLS a multiple of 16), global scale g -> (packed [ROWS, COLS/2] uint8, scale bits
    [ROWS, COLS/16] uint8), exactly as formats.nvfp4_quantize_ref. Shared by the quantize kernel and the NVFP4
    KV-cache append."""
    x = x.to(tl.float32).reshape(ROWS, COLS // 16, 16)
    # tl.max may drop NaN (GPU max.f32 returns the other operand): mark NaN blocks explicitly.
    has_nan = tl.max((x != x).to(tl.int32), 2) > 0
    amax = tl.where(has_nan, float("nan"), tl.max(tl.abs(x), 2))
    s_bits = e4m3_encode(tl.math.div_rn(tl.math.div_rn(amax, E2M1_MAX), g))
    denom = (e4m3_decode(s_bits) * g)[:, :, None]
    v = tl.where(denom == 0.0, 0.0, tl.math.div_rn(x, tl.where(denom == 0.0, 1.0, denom)))
    negative = (x.to(tl.int32, bitcast=True) >> 31) & 1  # the sign bit, so -0.0 keeps its sign
    lo, hi = tl.split(e2m1_encode(v, negative).reshape(ROWS, COLS // 2, 2))
    return (lo | (hi << 4)).to(tl.uint8), s_bits.to(tl.uint8)


@triton.jit
def nvfp4_quantize_kernel(x_ptr, data_ptr, scales_ptr, g_ptr, R, K, stride_xr, stride_xk, stride_dr, stride_sr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [R, K] -> data [R, K/2] (row stride stride_dr), scales [R, K/16] (row stride stride_sr)."""
    r64, row_ok = _rows(R, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (offs_k[None, :] < K)
    x = tl.load(x_ptr + r64[:, None] * stride_xr + offs_k[None, :].to(tl.int64) * stride_xk, mask=mask, other=0.0)
    packed, s_bits = nvfp4_quantize_tile(x, tl.load(g_ptr), BLOCK_R, BLOCK_K)

    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    tl.store(data_ptr + r64[:, None] * stride_dr + offs_b[None, :], packed,
             mask=row_ok[:, None] & (offs_b[None, :] < K // 2))
    offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    tl.store(scales_ptr + r64[:, None] * stride_sr + offs_s[None, :], s_bits,
             mask=row_ok[:, None] & (offs_s[None, :] < K // 16))


def e2m1_to_e4m3_ptx(src: str) -> str:
    """PTX: the four bytes of register src -> l, h (.b32, declared by the caller with a scratch t): the e4m3 bits
    of each byte's low / high nibble, a code s|e1 e0|m placed as sign bit 7 and e1 e0 m in bits 4..2, which is
    exactly e2m1 * 2^-6 (the 0.5 code an e4m3 subnormal)."""
    return """shl.b32 l, {src}, 2;
        and.b32 l, l, 0x1C1C1C1C;
        shl.b32 t, {src}, 4;
        and.b32 t, t, 0x80808080;
        or.b32 l, l, t;
        shr.b32 h, {src}, 2;
        and.b32 h, h, 0x1C1C1C1C;
        and.b32 t, {src}, 0x80808080;
        or.b32 h, h, t;""".format(src=src)


def e2m1_f16x2_ptx(src: str, outs, scale: str = "") -> str:
    """PTX: the e2m1 bytes of register src -> 8 fp16 in four f16x2 pairs (low nibbles of bytes 0-1, 2-3, high
    nibbles of bytes 0-1, 2-3), each optionally times the f16x2 register `scale`, moved to the destination pairs
    outs. The caller declares .b32 l, h, t, r and .b16 l0, l1, h0, h1. Shared by lowp/kernels/gemm_mma.py and
    kernels/gluon/decode_mma.py."""
    code = e2m1_to_e4m3_ptx(src) + """
        mov.b32 {l0, l1}, l;
        mov.b32 {h0, h1}, h;"""
    for (lo, hi), half in zip(outs, ("l0", "l1", "h0", "h1")):
        code += f"""
        cvt.rn.f16x2.e4m3x2 r, {half};"""
        if scale:
            code += f"""
        mul.rn.f16x2 r, r, {scale};"""
        code += f"""
        mov.b32 {{{lo}, {hi}}}, r;"""
    return code


_PAIRS_ASM = tl.constexpr("""{
        .reg .b32 l, h, t;
        .reg .b16 l0, l1, h0, h1;
        """ + e2m1_to_e4m3_ptx("$4") + """
        mov.b32 {l0, l1}, l;
        mov.b32 {h0, h1}, h;
        cvt.rn.f16x2.e4m3x2 $0, l0;
        cvt.rn.f16x2.e4m3x2 $1, l1;
        cvt.rn.f16x2.e4m3x2 $2, h0;
        cvt.rn.f16x2.e4m3x2 $3, h1;
        }""")


@triton.jit
def _e2m1_pairs_fp16(packed, PURE: tl.constexpr):
    """GPU only. packed uint8 -> (low-nibble values, high-nibble values) as fp16 holding e2m1 * 2^-6.
    PURE: see nvfp4_unpack_tile.

    Four bytes share a 32-bit register (pack=4), so each instruction handles 8 codes: a code s|e1 e0|m moves into
    e4m3 bits (sign to bit 7, e1 e0 m to bits 4..2: exactly e2m1 * 2^-6, the 0.5 code as an e4m3 subnormal) and the
    hardware e4m3x2 -> f16x2 conversion finishes: ~13 instructions per 8 values, against ~12 per value when Triton
    handles each byte in its own register."""
    return tl.inline_asm_elementwise(
        asm=_PAIRS_ASM,
        constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.float16, tl.float16), is_pure=PURE, pack=4)


E4M3X4_FP16_PTX = """{
        .reg .b16 lo, hi;
        .reg .b32 a, b;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        }"""  # an int32 word of 4 e4m3 bytes -> 4 fp16 (byte 0 first); shared with kernels/gluon/decode_mma.py
_E4M3X4_FP16 = tl.constexpr(E4M3X4_FP16_PTX)


_E4M3_FP16_PINNED = tl.constexpr("""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""")


@triton.jit
def e4m3_fp16_pinned(t):
    """An e4m3 tile -> fp16 (exact). On the GPU by the hardware's e4m3x2 -> f16x2 conversion in the layout the tile
    was loaded in: the PTX is marked impure, so Triton cannot sink the widening past the layout change that feeds an
    MMA's register operand, where it would gather the bytes one or two at a time (kernels/triton/inner._kv_tile).
    The interpreter (no inline PTX) casts."""
    if GPU_ASM:
        return tl.inline_asm_elementwise(asm=_E4M3_FP16_PINNED, constraints="=r,=r,r",
                                         args=[t.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return t.to(tl.float16)


@triton.jit
def _e4m3x4_fp16(words, PURE: tl.constexpr):
    """GPU only. int32 words holding 4 e4m3 bytes -> the 4 values as fp16 (byte 0 first), two hardware
    e4m3x2 -> f16x2 conversions per word."""
    return tl.inline_asm_elementwise(
        asm=_E4M3X4_FP16,
        constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16,) * 4, is_pure=PURE, pack=1)


@triton.jit
def nvfp4_block_scales(s, ROWS: tl.constexpr, COLS: tl.constexpr, PURE: tl.constexpr):
    """Block scales of a [ROWS, COLS] tile as fp16 [ROWS, COLS/16] ([ROWS] when COLS == 16), from e4m3 bytes
    (uint8 [ROWS, COLS/16]) or from int32 words of 4 scales each ([ROWS, COLS/64]): four scales per load let the
    loads go through the asynchronous-copy pipeline (byte loads stayed synchronous in the NVFP4 decode loop)."""
    if s.dtype == tl.int32:
        if GPU_ASM:
            b0, b1, b2, b3 = _e4m3x4_fp16(s, PURE)
        else:
            b0 = e4m3_decode(s & 0xFF).to(tl.float16)
            b1 = e4m3_decode((s >> 8) & 0xFF).to(tl.float16)
            b2 = e4m3_decode((s >> 16) & 0xFF).to(tl.float16)
            b3 = e4m3_decode((s >> 24) & 0xFF).to(tl.float16)
        return tl.join(tl.join(b0, b2), tl.join(b1, b3)).reshape(ROWS, COLS // 16)  # [.., j, i] = b(2j + i)
    elif GPU_ASM:
        return s.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        return e4m3_decode(s.to(tl.int32)).to(tl.float16)


@triton.jit
def nvfp4_unpack_tile(packed, s_bits, ROWS: tl.constexpr, COLS: tl.constexpr, PURE: tl.constexpr):
    """packed [ROWS, COLS/2] bytes and block scales s_bits (see nvfp4_block_scales: bytes or int32 words) ->
    [ROWS, COLS] float16 holding e2m1 * scale / E2M1_UNIT; callers fold E2M1_UNIT into the global scale.

    GPU: _e2m1_pairs_fp16 (e2m1 / 2^6) times the hardware-decoded scale / 2^8. Interpreter (no inline PTX): each
    4-bit code s|e1 e0|m is placed straight into fp16 bits (sign at bit 15, e1 e0 in the exponent field's low bits,
    m in the top mantissa bit), exactly the e2m1 value / 2^14, subnormal codes included. Either way the product
    with an e4m3 scale is a multiple of 2^-24 with at most 6 significant bits: exact in fp16 (and in bf16 and fp32
    after a cast), so both paths give the same bits. COLS >= 32 (NVFP4 caches refuse head dim 16, ops/kvcache.py).
    PURE marks the inline PTX side-effect free, so the compiler may move, merge and re-layout around it. Measured
    both ways on the H200 (run 21, graph replay): the GEMM at M <= 16 gains (N=K=8192 36.8 vs 40.4 us, 4096 18.4
    vs 19.6), the decode loop loses (b=8 ctx 32k 265 vs 240 us; its SASS step grows, 772 vs 661 instructions in
    session 3's 64-token loop), so the GEMM passes True and decode False."""
    scale = nvfp4_block_scales(s_bits, ROWS, COLS, PURE)
    if GPU_ASM:
        lo, hi = _e2m1_pairs_fp16(packed, PURE)
        vals = tl.join(lo, hi)
        scale = scale * 0.00390625  # / 2^8 (exact): the pairs are e2m1 / 2^6
    else:
        p = packed.to(tl.int32)
        lo = ((p << 9) & 0x0E00) | ((p << 12) & 0x8000)
        hi = ((p << 5) & 0x0E00) | ((p << 8) & 0x8000)
        vals = tl.join(lo, hi).to(tl.int16).to(tl.float16, bitcast=True)
    return (vals.reshape(ROWS, COLS // 16, 16) * scale[:, :, None]).reshape(ROWS, COLS)


@triton.jit
def nvfp4_dequantize_kernel(data_ptr, scales_ptr, g_ptr, out_ptr, R, K, stride_dr, stride_dk, stride_sr, stride_sk,
                            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """data [R, K/2], scales [R, K/16] (any strides) -> out [R, K] contiguous: (e2m1 * s) * g in fp32, stored in
    out's dtype (fp32, or fp16 / bf16 rounded once: the large-M GEMM's decoded weight). UPCAST: the interpreter runs
    it (its bf16 cast truncates)."""
    r64, row_ok = _rows(R, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(data_ptr + r64[:, None] * stride_dr + offs_b[None, :].to(tl.int64) * stride_dk,
                     mask=row_ok[:, None] & (offs_b[None, :] < K // 2), other=0)
    offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    s_bits = tl.load(scales_ptr + r64[:, None] * stride_sr + offs_s[None, :].to(tl.int64) * stride_sk,
                     mask=row_ok[:, None] & (offs_s[None, :] < K // 16), other=0)
    out = nvfp4_unpack_tile(packed, s_bits, BLOCK_R, BLOCK_K, False).to(tl.float32) * E2M1_UNIT * tl.load(g_ptr)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + r64[:, None] * K + offs_k[None, :], store_cast(out, out_ptr.dtype.element_ty, UPCAST),
             mask=row_ok[:, None] & (offs_k[None, :] < K))
