"""Append new tokens into a KV cache in place (contiguous or paged).

k_new, v_new: [B, Snew, Hkv, D]; token i of sequence b goes to cache position cache_seqlens[b] + i, which in a
paged cache is page block_table[b, pos // page_size], slot pos % page_size. One program per (b, i): all heads.
An FP8 cache (QUANT) stores x / scale saturated to the e4m3 range, rounded to nearest even.
"""
import triton
import triton.language as tl


FP8_E4M3_MAX = tl.constexpr(448.0)
RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds 0 <= x < 2**22 to an integer, ties even


@triton.jit
def e4m3_bits(y):
    """fp32 -> float8_e4m3fn bit pattern (uint8): round to nearest even, saturate at +-448, keep the sign of zero,
    NaN -> NaN.
    Built from integer fields instead of a float cast because Triton's interpreter casts wrongly when rounding
    carries into the next binade (-31.6 became -16) and drops the sign of zero; cvt.rn on the GPU agrees with this.
    """
    bits = y.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(y), FP8_E4M3_MAX)
    exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, -6) - 3  # 3 mantissa bits; below 2**-6 the subnormal step 2**-9
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / ulp + RINT_MAGIC) - RINT_MAGIC) * ulp  # exactly an e4m3 value now
    r_bits = r.to(tl.int32, bitcast=True)
    r_exp = (r_bits >> 23) & 0xFF
    normal = r_exp >= 121  # r >= 2**-6
    field = tl.where(normal, ((r_exp - 120) << 3) | ((r_bits >> 20) & 0x7), (r * 512.0).to(tl.int32))
    field = tl.where(y != y, 0x7F, field)  # NaN stays NaN (e4m3fn has no inf: +-inf saturates to +-448)
    return (field | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _append_one(src_ptr, dst_ptr, src_off, dst_off, offs_h, offs_d, stride_src_h, stride_dst_h, head_ok, mask,
                scale_ptr, stride_scale, QUANT: tl.constexpr):
    x = tl.load(src_ptr + src_off + offs_h[:, None] * stride_src_h + offs_d[None, :], mask=mask)
    if QUANT:  # FP8 cache: x / scale (per tensor or per KV head), saturated to +-448, rounded to nearest even
        scale = tl.load(scale_ptr + offs_h * stride_scale, mask=head_ok, other=1.0)
        x = e4m3_bits(x.to(tl.float32) / scale[:, None])  # dst is the cache viewed as uint8
    tl.store(dst_ptr + dst_off + offs_h[:, None] * stride_dst_h + offs_d[None, :], x, mask=mask)


@triton.jit
def kv_append_kernel(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, cache_seqlens_ptr, block_table_ptr,
                     k_scale_ptr, v_scale_ptr, stride_scale,
                     stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     stride_bt, seqlen_new, page_size, num_heads_kv,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                     PAGED: tl.constexpr, QUANT: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // seqlen_new).to(tl.int64)
    i = pid % seqlen_new
    pos = tl.load(cache_seqlens_ptr + b) + i
    if PAGED:
        page = tl.load(block_table_ptr + b * stride_bt + pos // page_size).to(tl.int64)
        slot = (pos % page_size).to(tl.int64)
        k_dst = page * stride_kcb + slot * stride_kcs
        v_dst = page * stride_vcb + slot * stride_vcs
    else:
        k_dst = b * stride_kcb + pos.to(tl.int64) * stride_kcs
        v_dst = b * stride_vcb + pos.to(tl.int64) * stride_vcs
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head_ok = offs_h < num_heads_kv
    mask = head_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    _append_one(k_new_ptr, k_cache_ptr, b * stride_knb + i * stride_kns, k_dst, offs_h, offs_d, stride_knh,
                stride_kch, head_ok, mask, k_scale_ptr, stride_scale, QUANT)
    _append_one(v_new_ptr, v_cache_ptr, b * stride_vnb + i * stride_vns, v_dst, offs_h, offs_d, stride_vnh,
                stride_vch, head_ok, mask, v_scale_ptr, stride_scale, QUANT)
