"""Casts for stores of fp32 results into 16-bit outputs, identical on the GPU and in Triton's interpreter; FP8
attention's transposed values (values_t_kernel).

The interpreter holds bf16 as raw 16-bit patterns and its fp32 -> bf16 cast truncates (up to one bf16 ulp off,
where the GPU rounds to nearest even). The tests compare outputs to references within rounding, and the backward
reads the forward's bf16 output (delta = rowsum(dO * O)), so a truncated output turned into a tenfold dQ error on
near one-hot rows in a CPU fuzz run; rounding first makes the interpreter's bf16 outputs the GPU's.
"""
import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """float32 -> the nearest bf16 value (ties to even), still float32; inf and NaN pass through."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(x):
    """float32 x >= 0 (at most 448) -> the nearest e4m3fn value (ties to even), still float32: the GPU's
    cvt.rn.satfinite for FP8 attention's P tiles, which the interpreter's own cast truncates. Normals keep 3
    mantissa bits; below 2^-6 values round to a multiple of the subnormal step 2^-9 (adding and subtracting 2^14
    rounds x to a multiple of 2^-9 in fp32: its ulp there is 2^-9)."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (x + 16384.0) - 16384.0
    return tl.where(x < 0.015625, subnormal, tl.minimum(normal, 448.0))


@triton.jit
def store_cast(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """x (fp32) as dtype for a store. INTERPRETED: the interpreter runs the kernel, whose bf16 cast truncates."""
    if INTERPRETED and dtype == tl.bfloat16:
        x = round_bf16(x)
    return x.to(dtype)


@triton.jit
def sum_cast_kernel(src_ptr, dst_ptr, numel, slices, slice_stride, scale, BLOCK: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """dst[i] = scale * sum_s src[s * slice_stride + i], summed in slice order in fp32, stored in dst's dtype; src
    fp32 slices and dst contiguous [numel]. One launch for what two torch ops did with their own host time each:
    nvfp4_matmul's split-K sum (scale 1) and the backward's dQ = softmax_scale * its fp32 accumulator."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(src_ptr + offs, mask=ok, other=0.0)
    for s in range(1, slices):
        acc += tl.load(src_ptr + s * slice_stride + offs, mask=ok, other=0.0)
    tl.store(dst_ptr + offs, store_cast(acc * scale, dst_ptr.dtype.element_ty, INTERPRETED), mask=ok)


@triton.jit
def values_t_column(start, seq, GAP: tl.constexpr):
    """V^T's first column of sequence seq, whose first key is merged row `start` (launch/tensors.values_t_column)."""
    return (start + 15) // 16 * 16 + GAP * seq


@triton.jit
def values_t_kernel(v_ptr, vt_ptr, cu_ptr, seqlen, stride_vb, stride_vs, stride_vh, stride_th, stride_td,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_T: tl.constexpr, VARLEN: tl.constexpr,
                    GAP: tl.constexpr):
    """FP8 attention's V^T (bytes): program (sequence, part, KV head) copies its sequence's tokens t = part *
    BLOCK_T + i * num_programs(1) * BLOCK_T .. into V^T [Hkv, D, width] from column values_t_column (launch/
    tensors.py, GAP columns per sequence), zeros up to the next sequence's first column (which the last block's
    loads read).
    v: [B, seqlen, Hkv, D] (sequence b = batch b), or VARLEN packed [total, Hkv, D] with cu_ptr [B + 1] int32."""
    seq, part, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if VARLEN:
        start = tl.load(cu_ptr + seq)
        length = tl.load(cu_ptr + seq + 1) - start
        src = v_ptr + start.to(tl.int64) * stride_vs + h * stride_vh
    else:
        start = seq * seqlen
        length = seqlen
        src = v_ptr + seq.to(tl.int64) * stride_vb + h * stride_vh
    col0 = values_t_column(start, seq, GAP)
    dst = vt_ptr + h.to(tl.int64) * stride_th + col0
    d = tl.arange(0, HEAD_DIM_PAD)
    # Columns up to the sequence's length rounded up to 16 (zeros past its end): stores along tokens under a mask
    # of whole 16-column groups stay 16-byte vectors (a byte-granular mask made them byte stores: 11x slower).
    length16 = (length + 15) // 16 * 16
    for t0 in range(part * BLOCK_T, length16, tl.num_programs(1) * BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        x = tl.load(src + t[:, None].to(tl.int64) * stride_vs + d[None, :],
                    mask=(t[:, None] < length) & (d[None, :] < HEAD_DIM), other=0)
        tl.store(dst + d[None, :] * stride_td + t[:, None], x,
                 mask=(t[:, None] < length16) & (d[None, :] < HEAD_DIM))
    end = values_t_column(start + length, seq + 1, GAP) - col0  # the next sequence's first column
    for g0 in range(length16 + part * 16, end, tl.num_programs(1) * 16):  # zeros up to it, 16 columns a store
        gap = g0 + tl.arange(0, 16)
        ok = (gap[:, None] < end) & (d[None, :] < HEAD_DIM)
        tl.store(dst + d[None, :] * stride_td + gap[:, None], tl.zeros([16, HEAD_DIM_PAD], tl.uint8), mask=ok)
