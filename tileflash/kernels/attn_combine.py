"""Merging partial attention results: merge_attn_states, the split-KV combine, and the helpers attn_fwd's fused
split-KV merge shares with them.

A part is (o, lse): o [rows, D] normalised over its own keys, lse [rows] natural log (-inf = the part saw no key).
Merged: lse = log(sum_i exp(lse_i)), o = sum_i exp(lse_i - lse) * o_i; when every part is empty, o = 0, lse = -inf.
Rows are (b, s, h) triples of an output laid out [B, S, H, D] with an lse laid out [B, H, S] (flash-attn's layout;
a 3-D [T, H, D] / [H, T] pair is the case B = 1).
"""
import triton
import triton.language as tl


@triton.jit
def _merge_step(acc, m, l, o_part, lse_part, l_part):
    """Fold a part into the running (acc, m, l): m is the largest LSE so far and acc, l are scaled by exp(-m), so
    every weight is exp(<= 0) and empty parts weigh 0. A part is one (o, lse) with l_part = 1, or a chunk of parts
    summed the same way (o_part = sum_i exp(lse_i - lse_part) o_i, l_part = sum_i exp(lse_i - lse_part))."""
    m_new = tl.maximum(m, lse_part)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m - m_safe)
    w = tl.exp(lse_part - m_safe)
    return acc * a[:, None] + w[:, None] * o_part, m_new, l * a + w * l_part


@triton.jit
def _finish(acc, m, l):
    """(o, lse) of merged rows; a row no part saw gives o = 0, lse = -inf."""
    seen = l > 0.0
    o = acc * tl.where(seen, 1.0 / tl.where(seen, l, 1.0), 0.0)[:, None]
    return o, tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))


@triton.jit
def merge_parts(o_part_ptr, lse_part_ptr, rows, row_ok, num_parts, num_rows, offs_d, HEAD_DIM: tl.constexpr,
                CHUNK: tl.constexpr):
    """(o, lse) of `rows` [R] (int64) merged over o_part [num_parts, num_rows, HEAD_DIM] and lse_part
    [num_parts, num_rows] (contiguous fp32), CHUNK parts per memory round trip (one loop step per part was
    latency-bound: ~17 us for 32 splits at batch 1). Loads bypass L1 (.cg): in attn_fwd's fused merge the parts were
    written by other SMs during the same kernel."""
    offs_c = tl.arange(0, CHUNK)
    d_ok = offs_d < HEAD_DIM
    acc = tl.zeros([rows.shape[0], offs_d.shape[0]], dtype=tl.float32)
    m = tl.full([rows.shape[0]], float("-inf"), dtype=tl.float32)
    l = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for c in range(0, num_parts, CHUNK):
        idx = (c + offs_c).to(tl.int64)[:, None] * num_rows + rows[None, :]
        ok = ((c + offs_c) < num_parts)[:, None] & row_ok[None, :]
        lse_c = tl.load(lse_part_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o_c = tl.load(o_part_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
        m_c = tl.max(lse_c, 0)
        w = tl.exp(lse_c - tl.where(m_c == float("-inf"), 0.0, m_c)[None, :])
        acc, m, l = _merge_step(acc, m, l, tl.sum(w[:, :, None] * o_c, 0), m_c, tl.sum(w, 0))
    return _finish(acc, m, l)


@triton.jit
def store_rows(o, lse, out_ptr, lse_ptr, b, s, h, row_ok, offs_d, stride_ob, stride_os, stride_oh,
               stride_lb, stride_lh, stride_ls, HEAD_DIM: tl.constexpr):
    """Write rows (b, s, h) (int64; b may be a scalar) of out (in its dtype) and lse."""
    o_ptrs = out_ptr + (b * stride_ob + s * stride_os + h * stride_oh)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + s * stride_ls, lse, mask=row_ok)


@triton.jit
def _rows(seqlen, num_heads, num_rows, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < num_rows
    r64 = r.to(tl.int64)
    return r64, r64 // (seqlen * num_heads), (r64 // num_heads) % seqlen, r64 % num_heads, row_ok


@triton.jit
def attn_combine_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, num_splits, seqlen, num_heads, num_rows,
                        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                        SPLIT_CHUNK: tl.constexpr):
    """Merge o_part [num_splits, num_rows, HEAD_DIM], lse_part [num_splits, num_rows] (contiguous fp32) into out /
    lse, BLOCK_R rows per program (context-parallel decode's merge of the ranks' results)."""
    r, b, s, h, row_ok = _rows(seqlen, num_heads, num_rows, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o, lse = merge_parts(o_part_ptr, lse_part_ptr, r, row_ok, num_splits, num_rows, offs_d, HEAD_DIM, SPLIT_CHUNK)
    store_rows(o, lse, out_ptr, lse_ptr, b, s, h, row_ok, offs_d, stride_ob, stride_os, stride_oh,
               stride_lb, stride_lh, stride_ls, HEAD_DIM)


@triton.jit
def merge_states_kernel(oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_ptr, seqlen, num_heads, num_rows,
                        s_oab, s_oas, s_oah, s_lab, s_lah, s_las,
                        s_obb, s_obs, s_obh, s_lbb, s_lbh, s_lbs,
                        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """Merge two parts with arbitrary strides (both [B, S, H, D] outputs with [B, H, S] LSEs)."""
    r, b, s, h, row_ok = _rows(seqlen, num_heads, num_rows, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    acc = tl.zeros([BLOCK_R, HEAD_DIM_PAD], dtype=tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)
    lse_a = tl.load(la_ptr + b * s_lab + h * s_lah + s * s_las, mask=row_ok, other=float("-inf"))
    o_a = tl.load(oa_ptr + (b * s_oab + s * s_oas + h * s_oah)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    acc, m, l = _merge_step(acc, m, l, o_a.to(tl.float32), lse_a, 1.0)
    lse_b = tl.load(lb_ptr + b * s_lbb + h * s_lbh + s * s_lbs, mask=row_ok, other=float("-inf"))
    o_b = tl.load(ob_ptr + (b * s_obb + s * s_obs + h * s_obh)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    acc, m, l = _merge_step(acc, m, l, o_b.to(tl.float32), lse_b, 1.0)
    o, lse = _finish(acc, m, l)
    store_rows(o, lse, out_ptr, lse_ptr, b, s, h, row_ok, offs_d, stride_ob, stride_os, stride_oh,
               stride_lb, stride_lh, stride_ls, HEAD_DIM)
