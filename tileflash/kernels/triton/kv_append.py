"""Append new tokens into a KV cache in place (contiguous or paged; bf16/fp16, FP8 or NVFP4).

k_new, v_new: [B, Snew, Hkv, D] (v: HEAD_DIM_V wide, MLA's latent next to its rotary keys); token i of sequence b
goes to cache position cache_seqlens[b] + i of cache row b (cache_batch_idx[b] with HAS_KV_BATCH), which in a paged
cache is page block_table[b, pos // page_size], slot pos % page_size. One program per (b, i): all heads. ROTARY_DIM >
0: k is rotated at that position first (kernels/_rotary.py; flash-attn's rotary_cos / rotary_sin). VARLEN_NEW (FA3's
cu_seqlens_k_new): k_new, v_new are packed [total_new, Hkv, D] and program t appends packed token t to the sequence
whose [cu[b], cu[b + 1]) holds it. Positions at or past the capacity are dropped (never written out of bounds;
validate=True reports them). FORMAT 0 copies; 1 (FP8) stores x / scale (per tensor or per KV head) saturated to e4m3,
rounded to nearest even; 2 (NVFP4) quantizes each head vector with the cache's global scale exactly as nvfp4_quantize
does: packed e2m1 pairs into the cache [.., D/2] and one e4m3 scale per 16 elements into the block-scale tensor [..,
D/16].
"""
import triton
import triton.language as tl

from .cast import store_cast
from .rotary import rotate_rows
from ...lowp.kernels.quant import e4m3_encode, nvfp4_quantize_tile


@triton.jit
def e4m3_bits(y):
    """fp32 -> float8_e4m3fn bits (uint8), the shared bit-exact encoder (lowp/kernels/quant.py; the interpreter's own
    fp8 cast rounds wrongly) plus the sign bit, so -0.0 and negatives that round to zero keep their sign."""
    return (e4m3_encode(tl.abs(y)) | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _quantized(x, scale, FP8: tl.constexpr):
    """x as the cache stores it: unchanged, or (FP8, the cache viewed as uint8) the e4m3 bits of x / scale, rounded
    to nearest even with IEEE division (Triton's fp32 `/` is approximate on the GPU and would move ties)."""
    if FP8:
        x = e4m3_bits(tl.math.div_rn(x.to(tl.float32), scale))
    return x


@triton.jit
def _append_one(src_ptr, dst_ptr, bs_ptr, scale_ptr, src_off, dst_off, bs_off, offs_h, offs_d, stride_src_h,
                stride_dst_h, stride_bs_h, stride_scale, head_ok, pos, cos_ptr, sin_ptr, stride_ro, seqlen_ro,
                HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, FORMAT: tl.constexpr, ROTARY_DIM: tl.constexpr,
                INTERLEAVED: tl.constexpr, INTERPRETED: tl.constexpr):
    mask = head_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = src_ptr + src_off + offs_h * stride_src_h
    x = tl.load(rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    if ROTARY_DIM > 0:  # rounded to the source dtype, as flash-attn stores the rotated key
        x = rotate_rows(x, rows, pos + tl.zeros_like(offs_h), head_ok, offs_d, cos_ptr, sin_ptr, stride_ro,
                        seqlen_ro, ROTARY_DIM, INTERLEAVED)
        x = store_cast(x, src_ptr.dtype.element_ty, INTERPRETED)
    h_off = offs_h[:, None].to(tl.int64) * stride_dst_h
    if FORMAT == 2:  # NVFP4: D is a power of two here (checked before launch), so the tile has no padding
        packed, s_bits = nvfp4_quantize_tile(x, tl.load(scale_ptr), HEADS_PAD, HEAD_DIM)
        offs_b = tl.arange(0, HEAD_DIM // 2)
        tl.store(dst_ptr + dst_off + h_off + offs_b[None, :], packed, mask=head_ok[:, None])
        offs_s = tl.arange(0, HEAD_DIM // 16)
        tl.store(bs_ptr + bs_off + offs_h[:, None].to(tl.int64) * stride_bs_h + offs_s[None, :], s_bits,
                 mask=head_ok[:, None])
    else:
        if FORMAT == 1:  # FP8: dst is the cache viewed as uint8
            x = _quantized(x, tl.load(scale_ptr + offs_h * stride_scale, mask=head_ok, other=1.0)[:, None], True)
        tl.store(dst_ptr + dst_off + h_off + offs_d[None, :], x, mask=mask)


@triton.jit
def kv_append_kernel(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, k_bs_ptr, v_bs_ptr, k_scale_ptr, v_scale_ptr,
                     cache_seqlens_ptr, block_table_ptr, kv_batch_ptr, cos_ptr, sin_ptr, stride_ro, seqlen_ro,
                     cu_new_ptr, num_batches, stride_scale,
                     stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     stride_bsb, stride_bss, stride_bsh,
                     stride_bt, seqlen_new, page_size, num_heads_kv, capacity,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                     PAGED: tl.constexpr, FORMAT: tl.constexpr, HAS_KV_BATCH: tl.constexpr,
                     ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, INTERPRETED: tl.constexpr,
                     VARLEN_NEW: tl.constexpr = False, BATCH_PAD: tl.constexpr = 1, HEAD_DIM_V: tl.constexpr = 0,
                     HEAD_DIM_V_PAD: tl.constexpr = 0):
    pid = tl.program_id(0)
    if VARLEN_NEW:  # the sequence holding packed token pid: how many sequences end at or before it
        offs_b = tl.arange(0, BATCH_PAD)
        ends = tl.load(cu_new_ptr + 1 + offs_b, mask=offs_b < num_batches, other=2147483647)
        b = tl.minimum(tl.sum((ends <= pid).to(tl.int32), 0), num_batches - 1).to(tl.int64)
        i = pid - tl.load(cu_new_ptr + b)
        seq_end = tl.load(cu_new_ptr + b + 1)  # tokens past cu[B] belong to no sequence
        src_b = 0
        src_i = pid
    else:
        b = (pid // seqlen_new).to(tl.int64)
        i = pid % seqlen_new
        seq_end = pid + 1
        src_b = b
        src_i = i
    pos = tl.load(cache_seqlens_ptr + b) + i
    # cache_seqlens + Snew past the cache (validate=True reports it): never write out of bounds
    if (pos >= capacity) | (pid >= seq_end):
        return
    if PAGED:
        row = tl.load(block_table_ptr + b * stride_bt + pos // page_size).to(tl.int64)  # the page
        slot = (pos % page_size).to(tl.int64)
    elif HAS_KV_BATCH:
        row = tl.load(kv_batch_ptr + b).to(tl.int64)
        slot = pos.to(tl.int64)
    else:
        row = b
        slot = pos.to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head_ok = offs_h < num_heads_kv
    bs_off = row * stride_bsb + slot * stride_bss  # NVFP4 block scales (k and v share strides)
    _append_one(k_new_ptr, k_cache_ptr, k_bs_ptr, k_scale_ptr, src_b * stride_knb + src_i * stride_kns,
                row * stride_kcb + slot * stride_kcs, bs_off, offs_h, offs_d, stride_knh, stride_kch, stride_bsh,
                stride_scale, head_ok, pos, cos_ptr, sin_ptr, stride_ro, seqlen_ro, HEAD_DIM, HEADS_PAD, FORMAT,
                ROTARY_DIM, INTERLEAVED, INTERPRETED)
    _append_one(v_new_ptr, v_cache_ptr, v_bs_ptr, v_scale_ptr, src_b * stride_vnb + src_i * stride_vns,
                row * stride_vcb + slot * stride_vcs, bs_off, offs_h, tl.arange(0, HEAD_DIM_V_PAD), stride_vnh,
                stride_vch, stride_bsh, stride_scale, head_ok, pos, cos_ptr, sin_ptr, stride_ro, seqlen_ro,
                HEAD_DIM_V, HEADS_PAD, FORMAT, 0, INTERLEAVED, INTERPRETED)


@triton.jit
def append_in_range(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, b, cache_row, head_kv, old_len, s_new, pos_lo,
                    pos_hi, capacity, stride_nb, stride_ns, stride_nh, stride_kb, stride_ks, stride_kh, stride_vb,
                    stride_vs, stride_vh, bt_ptr, k_scale, v_scale, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
                    S_NEW_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, ASYNC_READS: tl.constexpr, FP8: tl.constexpr):
    """The append inside the decode launch (16-bit or FP8 caches, one program per KV head and split): the program
    writes the new tokens of its own KV head whose cache positions old_len + i fall in its key range [pos_lo,
    pos_hi) (and inside the capacity) before it reads that range, so no other program reads what it writes.
    bt_ptr: sequence b's block-table row (PAGE_SIZE > 0); else the contiguous cache's row cache_row
    (cache_batch_idx[b] or b). FP8: the caches viewed as uint8, the new tokens quantized with this KV head's
    k_scale / v_scale (fp32 values) as kv_append_kernel does. ASYNC_READS: the range is read through TMA (the async
    proxy), which sees these generic-proxy stores only after a proxy fence."""
    i = tl.arange(0, S_NEW_PAD)
    pos = old_len + i
    ok = (i < s_new) & (pos >= pos_lo) & (pos < pos_hi) & (pos < capacity)
    if PAGE_SIZE > 0:
        page = tl.load(bt_ptr + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot = (pos % PAGE_SIZE).to(tl.int64)
    else:
        page = cache_row.to(tl.int64) + tl.zeros([S_NEW_PAD], dtype=tl.int64)
        slot = pos.to(tl.int64)
    src = b.to(tl.int64) * stride_nb + i.to(tl.int64) * stride_ns + head_kv.to(tl.int64) * stride_nh
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = _quantized(tl.load(k_new_ptr + src[:, None] + offs_d[None, :], mask=mask), k_scale, FP8)
    tl.store(k_cache_ptr + (page * stride_kb + slot * stride_ks + head_kv.to(tl.int64) * stride_kh)[:, None]
             + offs_d[None, :], k, mask=mask)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    mask = ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    v = _quantized(tl.load(v_new_ptr + src[:, None] + offs_dv[None, :], mask=mask), v_scale, FP8)
    tl.store(v_cache_ptr + (page * stride_vb + slot * stride_vs + head_kv.to(tl.int64) * stride_vh)[:, None]
             + offs_dv[None, :], v, mask=mask)
    if ASYNC_READS:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [s_new], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.debug_barrier()
