"""Merging partial attention results: split-KV combine and merge_attn_states.

A part is (o, lse): o [rows, D] normalised over its own keys, lse [rows] natural log (-inf = the part saw no key).
Merged: lse = log(sum_i exp(lse_i)), o = sum_i exp(lse_i - lse) * o_i; when every part is empty, o = 0, lse = -inf.
Rows are (b, s, h) triples of an output laid out [B, S, H, D] with an lse laid out [B, H, S] (flash-attn's layout;
a 3-D [T, H, D] / [H, T] pair is the case B = 1).
"""
import triton
import triton.language as tl

from ._cast import store_cast


@triton.jit
def _merge_step(acc, m, l, o_part, lse_part):
    """Fold one part into the running (acc, m, l); m is the running max LSE and acc/l are scaled by exp(-m)."""
    m_new = tl.maximum(m, lse_part)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m - m_safe)
    w = tl.exp(lse_part - m_safe)
    return acc * a[:, None] + w[:, None] * o_part, m_new, l * a + w


@triton.jit
def _store_merged(acc, m, l, out_ptr, lse_ptr, b, s, h, row_ok, offs_d, stride_ob, stride_os, stride_oh,
                  stride_lb, stride_lh, stride_ls, HEAD_DIM: tl.constexpr, INTERPRETED: tl.constexpr):
    seen = l > 0.0
    o = acc * tl.where(seen, 1.0 / tl.where(seen, l, 1.0), 0.0)[:, None]
    o_ptrs = out_ptr + (b * stride_ob + s * stride_os + h * stride_oh)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, store_cast(o, out_ptr.dtype.element_ty, INTERPRETED),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + s * stride_ls, lse, mask=row_ok)


@triton.jit
def _rows(seqlen, num_heads, num_rows, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < num_rows
    r64 = r.to(tl.int64)
    return r64, r64 // (seqlen * num_heads), (r64 // num_heads) % seqlen, r64 % num_heads, row_ok


@triton.jit
def merge_split_rows(o_part_ptr, lse_part_ptr, rows, row_ok, num_splits, rows_per_split, offs_d,
                     HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """(o [R, len(offs_d)], lse [R]) of partial rows `rows` (int64 [R]) merged over num_splits splits of o_part
    [num_splits, rows_per_split, HEAD_DIM] / lse_part [num_splits, rows_per_split] (contiguous fp32). SPLIT_CHUNK
    splits are loaded as one tile, LSEs and outputs together: at batch 1 a merge is latency, not bandwidth, so the
    round trips are what it costs. Loads bypass L1 (.cg): the split-KV kernel's last program reads here what other
    programs stored during the same launch."""
    offs_s = tl.arange(0, SPLIT_CHUNK)
    d_ok = offs_d < HEAD_DIM
    acc = tl.zeros([rows.shape[0], offs_d.shape[0]], dtype=tl.float32)
    m = tl.full([rows.shape[0]], float("-inf"), dtype=tl.float32)  # running max LSE: every weight is exp(<= 0)
    l = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for c in range(0, num_splits, SPLIT_CHUNK):
        idx = (c + offs_s).to(tl.int64)[:, None] * rows_per_split + rows[None, :]  # [S, R]
        ok = (c + offs_s < num_splits)[:, None] & row_ok[None, :]
        lse_c = tl.load(lse_part_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o_c = tl.load(o_part_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse_c, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_c - m_safe[None, :])
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_c, 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    seen = l > 0.0
    o = acc * tl.where(seen, 1.0 / tl.where(seen, l, 1.0), 0.0)[:, None]
    return o, tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))


@triton.jit
def last_to_arrive(counter_ptr, arrivals, INTERPRETED: tl.constexpr):
    """Whether this program is the last of `arrivals` programs to arrive at counter_ptr (an int32 that is 0
    before the first arrival; the last program sets it back to 0 for the next launch). Each thread's earlier
    global stores are made visible device-wide first (a gpu-scope fence in every thread, the CTA barrier, then one
    acq_rel atomic), so the last program can read what the others stored (with .cg loads)."""
    if not INTERPRETED:  # the interpreter runs programs one after another
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [arrivals], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1
    tl.store(counter_ptr, 0, mask=last)
    return last


@triton.jit
def attn_combine_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, num_splits, seqlen, num_heads, num_rows,
                        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                        HEAD_DIM: tl.constexpr, D_CHUNK: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    """Grid (rows, HEAD_DIM / D_CHUNK): one program per row and D_CHUNK of its columns (merge_split_rows over one
    row; the program per whole row read its splits in two passes of 32: ~4 dependent round trips at batch 1)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // (seqlen * num_heads)
    s = (row // num_heads) % seqlen
    h = row % num_heads
    offs_d = tl.program_id(1) * D_CHUNK + tl.arange(0, D_CHUNK)
    rows = row + tl.zeros([1], dtype=tl.int64)
    o, lse = merge_split_rows(o_part_ptr, lse_part_ptr, rows, rows >= 0, num_splits, num_rows, offs_d, HEAD_DIM,
                              SPLIT_CHUNK)
    o_ptrs = out_ptr + (b * stride_ob + s * stride_os + h * stride_oh + offs_d)[None, :]
    tl.store(o_ptrs, store_cast(o, out_ptr.dtype.element_ty, INTERPRETED), mask=(offs_d < HEAD_DIM)[None, :])
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + b * stride_lb + h * stride_lh + s * stride_ls + tl.zeros([1], dtype=tl.int64), lse)


@triton.jit
def merge_states_kernel(oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_ptr, seqlen, num_heads, num_rows,
                        s_oab, s_oas, s_oah, s_lab, s_lah, s_las,
                        s_obb, s_obs, s_obh, s_lbb, s_lbh, s_lbs,
                        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    """Merge two parts with arbitrary strides (both [B, S, H, D] outputs with [B, H, S] LSEs)."""
    r, b, s, h, row_ok = _rows(seqlen, num_heads, num_rows, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    acc = tl.zeros([BLOCK_R, HEAD_DIM_PAD], dtype=tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)
    lse_a = tl.load(la_ptr + b * s_lab + h * s_lah + s * s_las, mask=row_ok, other=float("-inf"))
    o_a = tl.load(oa_ptr + (b * s_oab + s * s_oas + h * s_oah)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    acc, m, l = _merge_step(acc, m, l, o_a.to(tl.float32), lse_a)
    lse_b = tl.load(lb_ptr + b * s_lbb + h * s_lbh + s * s_lbs, mask=row_ok, other=float("-inf"))
    o_b = tl.load(ob_ptr + (b * s_obb + s * s_obs + h * s_obh)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    acc, m, l = _merge_step(acc, m, l, o_b.to(tl.float32), lse_b)
    _store_merged(acc, m, l, out_ptr, lse_ptr, b, s, h, row_ok, offs_d, stride_ob, stride_os, stride_oh,
                  stride_lb, stride_lh, stride_ls, HEAD_DIM, INTERPRETED)
