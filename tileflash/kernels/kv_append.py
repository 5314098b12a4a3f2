"""Append new tokens into a KV cache in place (contiguous or paged).

k_new, v_new: [B, Snew, Hkv, D]; token i of sequence b goes to cache position cache_seqlens[b] + i, which in a
paged cache is page block_table[b, pos // page_size], slot pos % page_size. One program per (b, i): all heads.
"""
import triton
import triton.language as tl


@triton.jit
def _append_one(src_ptr, dst_ptr, src_off, dst_off, offs_h, offs_d, stride_src_h, stride_dst_h, mask):
    x = tl.load(src_ptr + src_off + offs_h[:, None] * stride_src_h + offs_d[None, :], mask=mask)
    tl.store(dst_ptr + dst_off + offs_h[:, None] * stride_dst_h + offs_d[None, :], x, mask=mask)


@triton.jit
def kv_append_kernel(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, cache_seqlens_ptr, block_table_ptr,
                     stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     stride_bt, seqlen_new, page_size, num_heads_kv,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                     PAGED: tl.constexpr):
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
    mask = (offs_h[:, None] < num_heads_kv) & (offs_d[None, :] < HEAD_DIM)
    _append_one(k_new_ptr, k_cache_ptr, b * stride_knb + i * stride_kns, k_dst, offs_h, offs_d, stride_knh,
                stride_kch, mask)
    _append_one(v_new_ptr, v_cache_ptr, b * stride_vnb + i * stride_vns, v_dst, offs_h, offs_d, stride_vnh,
                stride_vch, mask)
