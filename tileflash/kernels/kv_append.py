"""Append new tokens into a KV cache in place (contiguous or paged).

k_new, v_new: [B, Snew, Hkv, D]; token i of sequence b goes to cache position cache_seqlens[b] + i, which in a
paged cache is page block_table[b, pos // page_size], slot pos % page_size. One program per (b, i): all heads.
An FP8 cache (QUANT) stores x / scale saturated to the e4m3 range, rounded to nearest even.
"""
import triton
import triton.language as tl

from .quant import e4m3_encode


@triton.jit
def e4m3_bits(y):
    """fp32 -> float8_e4m3fn bits (uint8), the shared bit-exact encoder (kernels/quant.py; the interpreter's own
    fp8 cast rounds wrongly) plus the sign bit, so -0.0 and negatives that round to zero keep their sign."""
    return (e4m3_encode(tl.abs(y)) | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _append_one(src_ptr, dst_ptr, src_off, dst_off, offs_h, offs_d, stride_src_h, stride_dst_h, head_ok, mask,
                scale_ptr, stride_scale, QUANT: tl.constexpr):
    x = tl.load(src_ptr + src_off + offs_h[:, None] * stride_src_h + offs_d[None, :], mask=mask)
    if QUANT:  # FP8 cache: x / scale (per tensor or per KV head), saturated to +-448, rounded to nearest even
        scale = tl.load(scale_ptr + offs_h * stride_scale, mask=head_ok, other=1.0)
        # IEEE division (Triton's fp32 `/` is approximate on the GPU and would move ties); dst is viewed as uint8.
        x = e4m3_bits(tl.math.div_rn(x.to(tl.float32), scale[:, None]))
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
