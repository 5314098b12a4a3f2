"""Merging partial attention results: split-KV combine and merge_attn_states.

A part is (o, lse): o [rows, D] normalised over its own keys, lse [rows] natural log (-inf = the part saw no key).
Merged: lse = log(sum_i exp(lse_i)), o = sum_i exp(lse_i - lse) * o_i; when every part is empty, o = 0, lse = -inf.
Rows are (b, s, h) triples of an output laid out [B, S, H, D] with an lse laid out [B, H, S] (flash-attn's layout;
a 3-D [T, H, D] / [H, T] pair is the case B = 1). The split combine can add a sink (FA4's learnable_sink, fp32
[H]): one more part with lse = sink[h] and o = 0, which the split partials leave out so that it counts once.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .cast import store_cast


@triton.jit
def allow_dependent_launch(PDL: tl.constexpr):
    """Let a kernel launched after this one with programmatic dependent launch (the split combine) start its
    programs once every program here has begun; they wait in gdc_wait until this grid has finished."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _merge_step(acc, m, l, o_part, lse_part):
    """Fold one part into the running (acc, m, l); m is the running max LSE and acc/l are scaled by exp(-m). A part
    of weight 0 (lse -inf: it saw no key) adds nothing, even where its out is not finite."""
    m_new = tl.maximum(m, lse_part)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m - m_safe)
    w = tl.exp(lse_part - m_safe)
    return acc * a[:, None] + tl.where(w[:, None] > 0.0, w[:, None] * o_part, 0.0), m_new, l * a + w


@triton.jit
def _merge_chunk(acc, m, l, o_c, lse_c):
    """Fold a chunk of parts (axis 0 of lse_c and o_c; the running m, l are lse_c's other axes, acc o_c's) into
    the running (acc, m, l) as _merge_step does one part: the split combine (one row) and the fused merge (rows)."""
    m_new = tl.maximum(m, tl.max(lse_c, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse_c - tl.expand_dims(m_safe, 0))
    acc = acc * tl.expand_dims(alpha, -1) + tl.sum(tl.expand_dims(w, -1) * o_c, 0)
    return acc, m_new, l * alpha + tl.sum(w, 0)


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
def attn_combine_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, num_splits, seqlen, num_heads, num_rows,
                        stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, sink_ptr,
                        HEAD_DIM: tl.constexpr, D_CHUNK: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
                        INTERPRETED: tl.constexpr, PDL: tl.constexpr = False, HAS_SINK: tl.constexpr = False,
                        LET_NEXT: tl.constexpr = False):
    """Grid (rows, HEAD_DIM / D_CHUNK): one program per row and D_CHUNK of its columns. o_part [num_splits,
    num_rows, HEAD_DIM], lse_part [num_splits, num_rows], contiguous fp32. SPLIT_CHUNK splits are read as one tile
    and their LSEs and outputs are loaded together, so with up to SPLIT_CHUNK splits a program makes one memory
    round trip (the program per whole row read its splits in two passes of 32: ~4 dependent round trips at batch 1,
    where the combine is latency, not bandwidth). PDL: launched as a programmatic dependent of the attention
    kernel, so its launch overlaps that kernel's tail; nothing is read before the attention grid has finished."""
    if PDL:
        gdc_wait()
    allow_dependent_launch(LET_NEXT)  # the next call's decode kernel (launched after_prior) may start its programs
    row = tl.program_id(0).to(tl.int64)
    b = row // (seqlen * num_heads)
    s = (row // num_heads) % seqlen
    h = row % num_heads
    offs_s = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.program_id(1) * D_CHUNK + tl.arange(0, D_CHUNK)
    d_ok = offs_d < HEAD_DIM
    acc = tl.zeros([D_CHUNK], dtype=tl.float32)
    m = tl.full([], float("-inf"), dtype=tl.float32)  # running max LSE: every weight is exp(<= 0)
    l = tl.zeros([], dtype=tl.float32)
    for c in range(0, num_splits, SPLIT_CHUNK):
        split_ok = c + offs_s < num_splits
        lse_c = tl.load(lse_part_ptr + (c + offs_s) * num_rows + row, mask=split_ok, other=float("-inf"))
        o_c = tl.load(o_part_ptr + ((c + offs_s) * num_rows + row)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=split_ok[:, None] & d_ok[None, :], other=0.0)
        acc, m, l = _merge_chunk(acc, m, l, o_c, lse_c)
    if HAS_SINK:  # the sink as one more part with o = 0: only m and l take it
        sink = tl.load(sink_ptr + h)
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        acc = acc * alpha
        l = l * alpha + tl.exp(sink - m_safe)
        m = m_new
    seen = l > 0.0
    o = acc * tl.where(seen, 1.0 / tl.where(seen, l, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + s * stride_os + h * stride_oh + offs_d,
             store_cast(o, out_ptr.dtype.element_ty, INTERPRETED), mask=d_ok)
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + b * stride_lb + h * stride_lh + s * stride_ls,
                 tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf")))


@triton.jit
def merge_tile_splits(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, sink_ptr, counter_ptr, tile, num_splits,
                      rows_per_split, row_lo, row_hi, b, head, group_size, seqlen_q, num_heads_q,
                      stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MERGE_ROWS: tl.constexpr,
                      MERGE_SPLITS: tl.constexpr, PACK_GQA: tl.constexpr, HAS_SINK: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """The split combine inside the split decode kernel, so a split call is one launch: after writing its partials,
    each split of an attention tile counts itself in at counter[tile]; the last to arrive merges the tile's rows
    [row_lo, row_hi) over every split (MERGE_SPLITS splits x MERGE_ROWS rows per load, one memory round trip each),
    writes out and lse, adds the sink once, and zeroes its counter for the next call (the counters start at zero:
    direct.COUNTERS). Rows as the attention tile numbers them: r = token * group_size + g (PACK_GQA) or the token."""
    tl.debug_barrier()  # every thread's partial stores precede the release below
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        tl.store(counter_ptr + tile, 0)
        offs_s = tl.arange(0, MERGE_SPLITS)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = offs_d < HEAD_DIM
        for r0 in range(row_lo, row_hi, MERGE_ROWS):
            r = r0 + tl.arange(0, MERGE_ROWS)
            row_ok = r < row_hi
            if PACK_GQA:
                tok = r // group_size
                head_q = head * group_size + r % group_size
            else:
                tok = r
                head_q = head + tl.zeros([MERGE_ROWS], dtype=tl.int32)
            tok, head_q = tok.to(tl.int64), head_q.to(tl.int64)
            part = (b * seqlen_q + tok) * num_heads_q + head_q
            acc = tl.zeros([MERGE_ROWS, HEAD_DIM_PAD], dtype=tl.float32)
            m = tl.full([MERGE_ROWS], float("-inf"), dtype=tl.float32)  # running max LSE
            l = tl.zeros([MERGE_ROWS], dtype=tl.float32)
            for s0 in range(0, num_splits, MERGE_SPLITS):
                idx = (s0 + offs_s).to(tl.int64)[:, None] * rows_per_split + part[None, :]
                ok = (s0 + offs_s < num_splits)[:, None] & row_ok[None, :]
                # .cg: the other splits' partials come from L2 (this SM's L1 may hold none of them)
                lse_c = tl.load(lse_part_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
                o_c = tl.load(o_part_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                              mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
                acc, m, l = _merge_chunk(acc, m, l, o_c, lse_c)
            if HAS_SINK:  # the sink as one more part with o = 0
                acc, m, l = _merge_step(acc, m, l, tl.zeros_like(acc), tl.load(sink_ptr + head_q, mask=row_ok))
            _store_merged(acc, m, l, out_ptr, lse_ptr, b, tok, head_q, row_ok, offs_d, stride_ob, stride_os,
                          stride_oh, stride_lb, stride_lh, stride_ls, HEAD_DIM, INTERPRETED)


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
    # flash-attn 2.x writes +inf for a row that saw no key, tileflash and FA3 -inf: both contribute nothing
    lse_a = tl.load(la_ptr + b * s_lab + h * s_lah + s * s_las, mask=row_ok, other=float("-inf"))
    lse_a = tl.where(lse_a == float("inf"), float("-inf"), lse_a)
    o_a = tl.load(oa_ptr + (b * s_oab + s * s_oas + h * s_oah)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    acc, m, l = _merge_step(acc, m, l, o_a.to(tl.float32), lse_a)
    lse_b = tl.load(lb_ptr + b * s_lbb + h * s_lbh + s * s_lbs, mask=row_ok, other=float("-inf"))
    lse_b = tl.where(lse_b == float("inf"), float("-inf"), lse_b)
    o_b = tl.load(ob_ptr + (b * s_obb + s * s_obs + h * s_obh)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    acc, m, l = _merge_step(acc, m, l, o_b.to(tl.float32), lse_b)
    _store_merged(acc, m, l, out_ptr, lse_ptr, b, s, h, row_ok, offs_d, stride_ob, stride_os, stride_oh,
                  stride_lb, stride_lh, stride_ls, HEAD_DIM, INTERPRETED)
