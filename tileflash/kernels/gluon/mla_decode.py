"""MLA decode for sm_90 (DeepSeek-V2/V3 through FA3's qv), warp-specialised in Gluon: FlashMLA's seesaw schedule.

Why a second MLA kernel (the Triton decode kernel serves qv too): the 64-row tile's O is [64, 512] fp32, two
warpgroups' worth of registers, and Triton runs both products and the softmax of every step in one instruction
stream over pointer loads, which left H=128 at 223-274 TFLOP/s (issue 28 asks 550). The Gluon kernel before this one
(sessions 24-25) computed S on one warpgroup in 32-token steps, 36 m64n32k16 wgmmas re-reading q (72 KB) from shared
memory each step, and that warpgroup's softmax gated both P V halves (run 149: H=128 b=32 ctx 16k 459 TFLOP/s,
tensor pipe 42%). Here (FlashMLA's 2025-04 kernel, its deep-dive write-up):

  * 64-token blocks, two buffers (a block's rotary keys and latent: 72 KB each); S = q k^T over N = 64 halves the q
    re-reads per FLOP. q's rotary part stays in registers (the A operand of its wgmma), which frees its 8 KB of shared
    memory for P1: q latent 64 KB + two blocks 144 KB + P0 8 KB + P1 8 KB fits the 227 KB.
  * Blocks alternate between the warpgroups: warpgroup 0 computes S of even blocks, warpgroup 1 of odd ones. Each
    warpgroup keeps half of O (64 x 256 fp32). For a pair (K0, K1), with m the running row max:
      [0] m0 = max(m, rowmax S0), scale0 = exp(m - m0), P0 = exp(S0 - m0) -> shared memory;
          O_L = O_L scale0 + P0 V0_L (P0 from registers)
      [1] m1 = max(m0, rowmax S1), scale1 = exp(m0 - m1), P1 = exp(S1 - m1) -> shared memory (over q's rotary
          part); O_R = (O_R scale0 + P0 V0_R) scale1 + P1 V1_R (P1 from registers)
      [0] O_L = O_L scale1 + P1 V1_L
    so one warpgroup's softmax runs under the other's products (a "ping-pong" over a single O). Row sums: each
    warpgroup sums its own blocks' P in the common frame; they add up in the epilogue.
  * No producer warp: a 1-warp partition takes 40-56 registers of each warpgroup's budget, and with it every
    layout spilled. Each block is loaded in two parts, A (rotary keys and the latent's left half, 40 KB) and B (the
    right half, 32 KB), each completing on its own barrier, by the warpgroup that last reads that part of the
    buffer, as soon as its product retires: 0A by warpgroup 0 after P0 V0_L, 0B by warpgroup 1 after P0 V0_R, 1B by
    warpgroup 1 after P1 V1_R, 1A by warpgroup 0 after P1 V1_L (the first two blocks: warpgroup 0, after q's loads).
    Both warpgroups issue S over part A first: it lands first (run 299, probe/mla_waits.py).
    The sequence's partial last block loads like any other; each warpgroup zeroes the latent
    rows past the end in its half before its P V (P is 0 there, but 0 * (NaN or inf) would not be).
  * Registers: 255 per thread over 8 warps, no spill, once the loop addresses its buffers through an opaque zero
    (attn_bwd.py's remedy: else ptxas hoists the ~80 wgmma descriptors out of the loop and spills them).

Rows: r = token * H + head of one sequence (pack-GQA over the single latent head), 64 per CTA (wgmma's M); rows
past Sq * H read zeros and are not stored. Grid (cdiv(Sq * H, 64) * B, num_splits). Split s covers its share of
the sequence's blocks (attn_fwd's rule), partials as attn_fwd's (o_part [splits, B * Sq * H, 512], lse_part
[splits, B * Sq * H]) for attn_combine. Causal (several query tokens): token t sees keys < seqlen_k - Sq + t + 1.

Scope (plan/decode.mla_gluon_config decides, else the Triton kernel runs): sm_90, 16-bit q and caches (e4m3 caches
only on the narrow kernel, mla_decode_narrow.py), a 64-wide rotary key and a 512-wide latent, contiguous caches or
pages of 8..32 or a multiple of BN tokens, TMA-aligned rows; no window, softcap, sink, ALiBi, rotary or
cache_batch_idx / cache_leftpad. No CPU interpreter: the CPU suite compiles it (tests/sm90_compile_check.py),
tests/kernels/test_gluon_mla.py runs it on the GPU.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .attn_fwd import LN2, _softmax
from .common import allow_dependents, barrier, grid_dependency_wait, opaque_zero

ROWS = 64  # query rows per CTA: wgmma's M
ROPE_DIM = 64
LATENT_DIM = 512
HALF_DIM = LATENT_DIM // 2  # each consumer's share of O's columns, and the latent's TMA box width
M_ROWS = gl.constexpr(ROWS)
ROPE = gl.constexpr(ROPE_DIM)
HALF = gl.constexpr(HALF_DIM)
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_DIM, 16]))
O_ROWS = gl.constexpr(gl.SliceLayout(1, O_LAYOUT))  # one value per row of either consumer's half of O
BLOCK_TOKENS = 64
BLOCK = gl.constexpr(BLOCK_TOKENS)  # tokens per block
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_TOKENS, 16]))
S_ROWS = gl.constexpr(gl.SliceLayout(1, S_LAYOUT))
Q_ROPE_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT, k_width=2))
P_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))
# rows of `vecs` (fp32 [4, 64]): the running max, scale0, scale1, the row sums / 1 / l in the epilogue
VM, VS0, VS1, VL = (gl.constexpr(i) for i in range(4))
# barriers of `bars`: S0 / S1 softmax published, P0 / P1 in shared memory, P0 / P1 read, q loaded, l1 given,
# 1 / l given
B_S0, B_S1, B_P0, B_P1, B_P0_FREE, B_P1_FREE, B_Q, B_L, B_F = (gl.constexpr(i) for i in range(9))
N_BARS = gl.constexpr(9)


@gluon.jit
def _sequence(cache_seqlens, seqlen_k_add, b, num_splits, split, seqlen_q, BN: gl.constexpr,
              CAUSAL: gl.constexpr):
    """(keys of sequence b, its first block past this split's, the split's first block, blocks without a mask):
    splits divide the sequence's own blocks (attn_fwd's rule)."""
    seqlen_k = gl.load(cache_seqlens + b) + seqlen_k_add
    n_hi = (seqlen_k + BN - 1) // BN
    per_split = (n_hi + num_splits - 1) // num_splits
    s_lo = split * per_split
    s_hi = gl.minimum(s_lo + per_split, n_hi)
    full_hi = seqlen_k // BN
    if CAUSAL:  # the tile's first token sees the fewest keys
        full_hi = gl.maximum(seqlen_k - seqlen_q + 1, 0) // BN
    return seqlen_k, gl.maximum(s_hi, s_lo), s_lo, full_hi


@gluon.jit
def _unit(cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, BN: gl.constexpr, CAUSAL: gl.constexpr,
          ROWS_PER_CTA: gl.constexpr, AFTER_PRIOR: gl.constexpr, SPLIT: gl.constexpr):
    """(sequence, first query row, split, then _sequence's four) of this CTA. AFTER_PRIOR: launched as a
    programmatic dependent of the kernel before it, so every thread waits for that grid here, before any read.
    SPLIT: the split combine follows; where it is a programmatic dependent launch (plan.decode.combine_pdl) its
    programs may start now and wait for this grid (as the Triton decode kernel's; a no-op for a plain launch)."""
    b = gl.program_id(0) // m_tiles
    split = gl.program_id(1)
    if SPLIT:
        allow_dependents(split)
    if AFTER_PRIOR:
        grid_dependency_wait(split)
    seqlen_k, s_hi, s_lo, full_hi = _sequence(cache_seqlens, seqlen_k_add, b, gl.num_programs(1), split, seqlen_q,
                                              BN, CAUSAL)
    return b, (gl.program_id(0) % m_tiles) * ROWS_PER_CTA, split, seqlen_k, s_hi, s_lo, full_hi


@gluon.jit
def _masked(s, jb, seqlen_k, seqlen_q, row0, num_heads, full_hi, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """Scores of block jb's keys past the sequence's end (or past a row's token, causal) set to -inf; blocks below
    full_hi need no mask."""
    if jb < full_hi:
        return s
    cols = jb * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
    ok = gl.expand_dims(cols < seqlen_k, 0)
    if CAUSAL:
        tok = (row0 + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s.type.layout))) // num_heads
        ok = ok & (gl.expand_dims(cols, 0) < gl.expand_dims(seqlen_k - seqlen_q + 1 + tok, 1))
    return gl.where(ok, s, float("-inf"))


@gluon.jit
def _store_half(acc, inv_l, out_ptr, o_part_ptr, b, row0, rows_q, num_heads, split, rows_per_split, stride_ob,
                stride_os, stride_oh, col0, SPLIT: gl.constexpr):
    """Rows of this CTA times inv_l into out [B, Sq, H, 512] (q's dtype) or the split's fp32 partial."""
    lay: gl.constexpr = acc.type.layout
    r = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, lay))
    cols = gl.expand_dims(col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, lay)), 0)
    ok = gl.expand_dims(r < rows_q, 1)
    o = acc * gl.expand_dims(inv_l, 1)
    if SPLIT:
        part = split.to(gl.int64) * rows_per_split + b.to(gl.int64) * rows_q + r
        gl.store(o_part_ptr + gl.expand_dims(part, 1) * (2 * HALF) + cols, o, mask=ok)
    else:
        tok = r // num_heads
        off = b.to(gl.int64) * stride_ob + tok.to(gl.int64) * stride_os + (r % num_heads).to(gl.int64) * stride_oh
        gl.store(out_ptr + gl.expand_dims(off, 1) + cols, o.to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _store_lse(m_i, l_i, seen, row0, lse_ptr, lse_part_ptr, b, rows_q, num_heads, split, rows_per_split, stride_lb,
               stride_lh, stride_ls, SPLIT: gl.constexpr):
    """The rows' lse (natural log; -inf where no key was seen) into lse [B, H, Sq] or the split's partial."""
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    r = row0 + gl.arange(0, m_i.shape[0], layout=m_i.type.layout)
    if SPLIT:
        gl.store(lse_part_ptr + split.to(gl.int64) * rows_per_split + b.to(gl.int64) * rows_q + r, lse,
                 mask=r < rows_q)
    else:
        off = b.to(gl.int64) * stride_lb + (r % num_heads).to(gl.int64) * stride_lh + (r // num_heads) * stride_ls
        gl.store(lse_ptr + off, lse, mask=r < rows_q)


Q_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # 16-byte loads along a row of q
OUT_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]))  # 16-byte stores along a row of O
# O's halves staged as fp32 rows in the block buffers: 32-byte chunks swizzled over four rows, so a warp's store of
# wgmma's accumulator fragments (eight rows of 32 bytes) takes two wavefronts, not eight
STAGE_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0]))


@gluon.jit
def _store_staged(acc, inv_l, c_bufs, WG: gl.constexpr, out_ptr, o_part_ptr, b, row0, rows_q, num_heads, split,
                  rows_per_split, stride_ob, stride_os, stride_oh, SPLIT: gl.constexpr):
    """Warpgroup WG's half of O (acc [64, 256] in wgmma's layout) times inv_l (S_ROWS) into out or the split's
    partial, through shared memory: the block buffers (both loops are over once a warpgroup is past the epilogue's
    handshake) as fp32 [2, 64, 256], read back as rows for 16-byte stores. Stored from the accumulator's layout (8-byte
    stores, 32 bytes a row a warp) a half took 2.5-4.7 us (run 285, probe/mla_timeline.py)."""
    stage = c_bufs._reinterpret(gl.float32, [2, M_ROWS, HALF], STAGE_LAYOUT).index(WG)
    stage.store(acc)
    barrier()  # the warpgroup's half is in shared memory
    _store_half(stage.load(OUT_LAYOUT), gl.convert_layout(inv_l, gl.SliceLayout(1, OUT_LAYOUT)), out_ptr, o_part_ptr,
                b, row0, rows_q, num_heads, split, rows_per_split, stride_ob, stride_os, stride_oh, WG * HALF, SPLIT)


@gluon.jit
def _q_rows(ptr, row0, rows_q, num_heads, stride_b, stride_s, stride_h, b, col0, R: gl.constexpr,
            COLS: gl.constexpr):
    """Rows [row0, row0 + R) of q or qv (row r = token r // H, head r % H of sequence b), columns [col0, col0 +
    COLS), in Q_LAYOUT; rows past Sq * H as zeros."""
    r = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, Q_LAYOUT))
    off = b.to(gl.int64) * stride_b + (r // num_heads).to(gl.int64) * stride_s + (r % num_heads).to(gl.int64) * stride_h
    cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, Q_LAYOUT))
    return gl.load(ptr + gl.expand_dims(off, 1) + gl.expand_dims(cols, 0), mask=gl.expand_dims(r < rows_q, 1),
                   other=0.0)


@gluon.jit
def _q_tile(q_ptr, qv_ptr, row0, rows_q, num_heads, stride_qb, stride_qs, stride_qh, stride_qvb, stride_qvs,
            stride_qvh, b, R: gl.constexpr):
    """(q, qv's left half, its right half): the tile's R rows, loads issued. Both MLA kernels issue them before the
    first blocks' copies: behind every CTA's 72 KB blocks in the memory queues, q took until 3.3 us (H200, b=1 ctx
    32k) and 5-7 us (b=32 ctx 4k) to arrive, the start's critical path (run 285, probe/mla_timeline.py). Run 295
    (H100, `bench decode --only mla-h128`, graph replay, us): b=1 ctx 4k 18.3 -> 16.9, ctx 32k 37.7 -> 36.6, b=32
    ctx 4k 92.2 -> 90.5, b=128 ctx 1k 96.9 -> 91.4, page 64 91.2 -> 90.4; b=128 ctx 4k ~2% slower (run 298,
    interleaved: 304.7 / 298.5 -> 306.9 / 308.8). The narrow kernel: equal or faster (run 296, H=16 e4m3 b=8 ctx
    32k 86.0 -> 82.6)."""
    return (_q_rows(q_ptr, row0, rows_q, num_heads, stride_qb, stride_qs, stride_qh, b, 0, R, ROPE),
            _q_rows(qv_ptr, row0, rows_q, num_heads, stride_qvb, stride_qvs, stride_qvh, b, 0, R, HALF),
            _q_rows(qv_ptr, row0, rows_q, num_heads, stride_qvb, stride_qvs, stride_qvh, b, HALF, R, HALF))


@gluon.jit
def _store_queries(q_rope, q_lat, q, lat0, lat1):
    """_q_tile's tensors into shared memory (q_rope, q_lat's halves), visible to wgmma and every thread of the
    partition."""
    q_rope.store(q)
    q_lat.index(0).store(lat0)
    q_lat.index(1).store(lat1)
    fence_async_shared()
    barrier()


@gluon.jit
def _copy(desc, buf, bar, t0, b, seqlen_k, block_table, stride_bt, max_pages, cache_rows, col, PAGE: gl.constexpr,
          CHUNK: gl.constexpr):
    """Rows [t0, t0 + 64) of one cache (columns [col, col + box)) into buf, on bar."""
    for i in gl.static_range(BLOCK // CHUNK):
        t = t0 + i * CHUNK
        if PAGE == 0:
            row = b * cache_rows + t
        else:
            page = gl.load(block_table + b.to(gl.int64) * stride_bt + gl.minimum(t // PAGE, max_pages - 1))
            row = gl.where(t < seqlen_k, page * PAGE + t % PAGE, -BLOCK)  # past the end: zeros, no read
        tma.async_copy_global_to_shared(desc, [row, col], bar, buf.slice(i * CHUNK, CHUNK))


@gluon.jit
def _load(PART: gl.constexpr, x, j, n, k_desc, c_desc, k_bufs, c_bufs, ready, b, s_lo, seqlen_k, block_table,
          stride_bt, max_pages, cache_rows, PAGE: gl.constexpr):
    """Part PART (0: rotary keys and the latent's left half; 1: its right half) of the split's block j into buffer x,
    completing on ready[x]; nothing when j >= n. Issued by the warpgroup that last read that part of the buffer."""
    CHUNK: gl.constexpr = BLOCK if PAGE == 0 or PAGE >= BLOCK else PAGE
    if j < n:
        t0 = (s_lo + j) * BLOCK
        bar = ready.index(x)
        if PART == 0:
            mbarrier.expect(bar, BLOCK // CHUNK * (k_desc.block_type.nbytes + c_desc.block_type.nbytes))
            _copy(k_desc, k_bufs.index(x), bar, t0, b, seqlen_k, block_table, stride_bt, max_pages, cache_rows, 0,
                  PAGE, CHUNK)
        else:
            mbarrier.expect(bar, BLOCK // CHUNK * c_desc.block_type.nbytes)
        _copy(c_desc, c_bufs.index(2 * x + PART), bar, t0, b, seqlen_k, block_table, stride_bt, max_pages, cache_rows,
              PART * HALF, PAGE, CHUNK)


@gluon.jit
def _load_block(x, j, n, k_desc, c_desc, k_bufs, c_bufs, ready_a, ready_b, b, s_lo, seqlen_k, block_table, stride_bt,
                max_pages, cache_rows, PAGE: gl.constexpr):
    """Both parts of the split's block j into buffer x (part A on ready_a[x], then part B on ready_b[x])."""
    for part in gl.static_range(2):
        _load(part, x, j, n, k_desc, c_desc, k_bufs, c_bufs, ready_b if part else ready_a, b, s_lo, seqlen_k,
              block_table, stride_bt, max_pages, cache_rows, PAGE)


@gluon.jit
def _zero_past_end(buf, t0, seqlen_k):
    """A block half [64, 256] of keys t0.. with its rows past the sequence's end set to zero, 8 rows at a time by the
    calling warpgroup, before its P V reads it: P is 0 there, but 0 * (NaN or inf) from an unwritten cache row would
    not be. A no-op for a whole block."""
    valid = seqlen_k - t0
    if valid < BLOCK:
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        rows = gl.arange(0, 8, layout=gl.SliceLayout(1, lay))
        for c in gl.static_range(BLOCK // 8):
            if c * 8 + 8 > valid:
                chunk = buf.slice(c * 8, 8)
                x = chunk.load(lay)
                chunk.store(gl.where(gl.expand_dims(c * 8 + rows < valid, 1), x, gl.zeros_like(x)))
        fence_async_shared()
        barrier()


# ------------------------------------------------------------------------------------------------------ consumers


@gluon.jit
def _s_part_a(q_r, q_lat, k_bufs, c_bufs, x, z, s):
    """S = q_rope k^T (q's rotary part from registers) + q_L c_L^T of buffer x, issued into the spent S's registers
    (use_acc=False). z: an opaque 0 (see _wg0)."""
    s = warpgroup_mma(q_r, k_bufs.index(x + z).permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q_lat.index(z), c_bufs.index(2 * x + z).permute((1, 0)), s, is_async=True)


@gluon.jit
def _s_part_b(q_lat, c_bufs, x, z, s):
    """S += q_R c_R^T of buffer x, issued."""
    return warpgroup_mma(q_lat.index(1 + z), c_bufs.index(2 * x + 1 + z).permute((1, 0)), s, is_async=True)


@gluon.jit
def _scores(q_r, q_lat, k_bufs, c_bufs, ready_a, ready_b, x, ph, z, s):
    """S of buffer x, retired: part A as soon as it lands (it lands first: run 299, probe/mla_waits.py), then part B."""
    mbarrier.wait(ready_a.index(x), ph)
    s = _s_part_a(q_r, q_lat, k_bufs, c_bufs, x, z, s)
    mbarrier.wait(ready_b.index(x), ph)
    return warpgroup_mma_wait(0, deps=(_s_part_b(q_lat, c_bufs, x, z, s),))


@gluon.jit
def _rescale(acc, scale):
    """acc * scale per row, with no wgmma in flight (ptxas would serialise every wgmma otherwise: C7514 / C7515)."""
    return acc * gl.expand_dims(gl.convert_layout(scale, O_ROWS), 1)


@gluon.jit
def _publish(vecs, i: gl.constexpr, x, bar):
    """Row vector x into vecs[i] for the other warpgroup, then bar."""
    vecs.index(i).store(x)
    barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _wg0(q_ptr, qv_ptr, stride_qb, stride_qs, stride_qh, stride_qvb, stride_qvs, stride_qvh, q_rope, q_lat, k_bufs,
         c_bufs, p0_smem, vecs, ready_a, ready_b, bars, k_desc, c_desc, block_table, stride_bt, max_pages, cache_rows,
         out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, num_heads,
         rows_per_split, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale,
         PAGE: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr, AFTER_PRIOR: gl.constexpr):
    """Even blocks' S and softmax, O[:, :256]; loads q (both warpgroups read it) and the first two blocks, writes
    lse."""
    dtype: gl.constexpr = q_lat.dtype
    b, row0, split, seqlen_k, s_hi, s_lo, full_hi = _unit(cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, BLOCK,
                                                          CAUSAL, M_ROWS, AFTER_PRIOR, SPLIT)
    n = s_hi - s_lo
    rows_q = seqlen_q * num_heads
    q, lat0, lat1 = _q_tile(q_ptr, qv_ptr, row0, rows_q, num_heads, stride_qb, stride_qs, stride_qh, stride_qvb,
                            stride_qvs, stride_qvh, b, M_ROWS)
    for x in gl.static_range(2):  # in flight while q arrives
        _load_block(x, x, n, k_desc, c_desc, k_bufs, c_bufs, ready_a, ready_b, b, s_lo, seqlen_k, block_table,
                    stride_bt, max_pages, cache_rows, PAGE)
    _store_queries(q_rope, q_lat, q, lat0, lat1)
    q_r = q_rope.load(Q_ROPE_A)  # before warpgroup 1 may write P1 over it (after B_S0 of pair 0)
    mbarrier.arrive(bars.index(B_Q), count=1)
    s = gl.zeros([M_ROWS, BLOCK], gl.float32, S_LAYOUT)  # ignored by the first S (use_acc=False): its registers
    m_i = gl.full([M_ROWS], float("-inf"), gl.float32, S_ROWS)
    l_i = gl.zeros([M_ROWS], gl.float32, S_ROWS)
    acc = gl.zeros([M_ROWS, HALF], gl.float32, O_LAYOUT)
    if n > 0:
        s = _scores(q_r, q_lat, k_bufs, c_bufs, ready_a, ready_b, 0, 0, 0, s)
    for u in range((n + 1) // 2):
        ph = u & 1
        has1 = 2 * u + 1 < n
        # Buffers addressed through a zero the compiler cannot see: otherwise it hoists the ~80 wgmma descriptors
        # (one per 16-wide slice) out of the loop and spills them (attn_bwd.py's remedy).
        z = opaque_zero(u)
        p, m0, l_i, scale0 = _softmax(_masked(s, s_lo + 2 * u, seqlen_k, seqlen_q, row0, num_heads, full_hi, BLOCK,
                                              CAUSAL), m_i, l_i, qk_scale)
        vecs.index(VM).store(m0)
        _publish(vecs, VS0, scale0, bars.index(B_S0))
        p_b = p.to(dtype)
        mbarrier.wait(bars.index(B_P0_FREE), ph ^ 1)  # warpgroup 1 has read the last P0
        p0_smem.store(p_b)
        fence_async_shared()
        barrier()
        mbarrier.arrive(bars.index(B_P0), count=1)
        # O_L = O_L scale0 + P0 V0_L, P0 from registers; then this warpgroup was the last reader of buffer 0's part A.
        t0 = (s_lo + 2 * u) * BLOCK
        _zero_past_end(c_bufs.index(0), t0, seqlen_k)
        acc = warpgroup_mma_init(_rescale(acc, scale0))
        p_a = gl.convert_layout(p_b, P_A, assert_trivial=True)
        acc = warpgroup_mma(p_a, c_bufs.index(z), acc, is_async=True)
        acc, p_a = warpgroup_mma_wait(0, deps=(acc, p_a))
        _load(0, 0, 2 * u + 2, n, k_desc, c_desc, k_bufs, c_bufs, ready_a, b, s_lo, seqlen_k, block_table, stride_bt,
              max_pages, cache_rows, PAGE)
        # Warpgroup 1's softmax of S1: O_L and l0 move to its frame, then O_L += P1 V1_L.
        mbarrier.wait(bars.index(B_S1), ph)
        scale1 = vecs.index(VS1).load(S_ROWS)
        m_i = vecs.index(VM).load(S_ROWS)
        l_i = l_i * scale1
        acc = warpgroup_mma_init(_rescale(acc, scale1))
        if has1:  # P1 from shared memory (where q's rotary part was)
            _zero_past_end(c_bufs.index(2), t0 + BLOCK, seqlen_k)
            mbarrier.wait(bars.index(B_P1), ph)
            acc = warpgroup_mma(q_rope, c_bufs.index(2 + z), acc, is_async=True)
        if 2 * u + 2 < n:  # the next pair's S0, part A first (loaded first)
            mbarrier.wait(ready_a.index(0), ph ^ 1)
            s = _s_part_a(q_r, q_lat, k_bufs, c_bufs, 0, z, s)
            if has1:
                acc = warpgroup_mma_init(warpgroup_mma_wait(2, deps=(acc,)))  # P1 V1_L retired, S0's part A not
                mbarrier.arrive(bars.index(B_P1_FREE), count=1)
                _load(0, 1, 2 * u + 3, n, k_desc, c_desc, k_bufs, c_bufs, ready_a, b, s_lo, seqlen_k, block_table,
                      stride_bt, max_pages, cache_rows, PAGE)
            mbarrier.wait(ready_b.index(0), ph ^ 1)
            s = _s_part_b(q_lat, c_bufs, 0, z, s)
            o, s = warpgroup_mma_wait(0, deps=(acc, s))
        else:
            o = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(bars.index(B_P1_FREE), count=1, pred=has1)
        acc = o

    # Epilogue: l = l0 + l1 (warpgroup 1's sum arrives through vecs[VL]); rows that saw no key give out = 0 and
    # lse = -inf.
    mbarrier.wait(bars.index(B_L), 0)
    l_i = l_i + vecs.index(VL).load(S_ROWS)
    barrier()  # every thread has read l1 before 1 / l overwrites it (a row's 4 threads need not run in step)
    seen = l_i > 0.0
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    _publish(vecs, VL, inv_l, bars.index(B_F))
    _store_lse(m_i, l_i, seen, row0, lse_ptr, lse_part_ptr, b, rows_q, num_heads, split, rows_per_split, stride_lb,
               stride_lh, stride_ls, SPLIT)
    _store_staged(acc, inv_l, c_bufs, 0, out_ptr, o_part_ptr, b, row0, rows_q, num_heads, split, rows_per_split,
                  stride_ob, stride_os, stride_oh, SPLIT)


@gluon.jit
def _wg1(q_rope, q_lat, k_bufs, c_bufs, p0_smem, vecs, ready_a, ready_b, bars, k_desc, c_desc, block_table,
         stride_bt, max_pages, cache_rows, out_ptr, o_part_ptr, cache_seqlens, seqlen_k_add, seqlen_q, m_tiles,
         num_heads, rows_per_split, stride_ob, stride_os, stride_oh, qk_scale, PAGE: gl.constexpr,
         CAUSAL: gl.constexpr, SPLIT: gl.constexpr, AFTER_PRIOR: gl.constexpr):
    """Odd blocks' S and softmax, O[:, 256:]."""
    dtype: gl.constexpr = q_lat.dtype
    b, row0, split, seqlen_k, s_hi, s_lo, full_hi = _unit(cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, BLOCK,
                                                          CAUSAL, M_ROWS, AFTER_PRIOR, SPLIT)
    n = s_hi - s_lo
    mbarrier.wait(bars.index(B_Q), 0)
    q_r = q_rope.load(Q_ROPE_A)
    s = gl.zeros([M_ROWS, BLOCK], gl.float32, S_LAYOUT)
    l_i = gl.zeros([M_ROWS], gl.float32, S_ROWS)
    acc = gl.zeros([M_ROWS, HALF], gl.float32, O_LAYOUT)
    if n > 1:
        s = _scores(q_r, q_lat, k_bufs, c_bufs, ready_a, ready_b, 1, 0, 0, s)
    for u in range((n + 1) // 2):
        ph = u & 1
        has1 = 2 * u + 1 < n
        z = opaque_zero(u)  # see _wg0
        mbarrier.wait(bars.index(B_S0), ph)
        m0 = vecs.index(VM).load(S_ROWS)
        scale0 = vecs.index(VS0).load(S_ROWS)
        if has1:
            p, m1, l_i, scale1 = _softmax(_masked(s, s_lo + 2 * u + 1, seqlen_k, seqlen_q, row0, num_heads, full_hi,
                                                  BLOCK, CAUSAL), m0, l_i * scale0, qk_scale)
        else:  # no odd block: the frame stays warpgroup 0's (p unused)
            p = s
            m1 = m0
            l_i = l_i * scale0
            scale1 = gl.full_like(scale0, 1.0)
        vecs.index(VM).store(m1)
        _publish(vecs, VS1, scale1, bars.index(B_S1))
        p_b = p.to(dtype)
        if has1:  # P1 to shared memory for warpgroup 0
            mbarrier.wait(bars.index(B_P1_FREE), ph ^ 1)
            q_rope.store(p_b)
            fence_async_shared()
            barrier()
            mbarrier.arrive(bars.index(B_P1), count=1)
        # O_R = (O_R scale0 + P0 V0_R) scale1 + P1 V1_R: P0 (warpgroup 0's frame) from shared memory, P1 from
        # registers; this warpgroup is the last reader of both buffers' right halves.
        t0 = (s_lo + 2 * u) * BLOCK
        _zero_past_end(c_bufs.index(1), t0, seqlen_k)
        acc = warpgroup_mma_init(_rescale(acc, scale0))
        mbarrier.wait(bars.index(B_P0), ph)
        acc = warpgroup_mma(p0_smem, c_bufs.index(1 + z), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(bars.index(B_P0_FREE), count=1)
        _load(1, 0, 2 * u + 2, n, k_desc, c_desc, k_bufs, c_bufs, ready_b, b, s_lo, seqlen_k, block_table, stride_bt,
              max_pages, cache_rows, PAGE)
        acc = _rescale(acc, scale1)
        if has1:
            _zero_past_end(c_bufs.index(3), t0 + BLOCK, seqlen_k)
            p_a = gl.convert_layout(p_b, P_A, assert_trivial=True)
            acc, p_a = warpgroup_mma_wait(0, deps=(warpgroup_mma(p_a, c_bufs.index(3 + z), warpgroup_mma_init(acc),
                                                                 is_async=True), p_a))
            _load(1, 1, 2 * u + 3, n, k_desc, c_desc, k_bufs, c_bufs, ready_b, b, s_lo, seqlen_k, block_table,
                  stride_bt, max_pages, cache_rows, PAGE)
        if 2 * u + 3 < n:  # the next pair's S1 (part A was asked first: warpgroup 0's P1 V1_L retires first)
            s = _scores(q_r, q_lat, k_bufs, c_bufs, ready_a, ready_b, 1, ph ^ 1, z, s)

    _publish(vecs, VL, l_i, bars.index(B_L))
    mbarrier.wait(bars.index(B_F), 0)
    _store_staged(acc, vecs.index(VL).load(S_ROWS), c_bufs, 1, out_ptr, o_part_ptr, b, row0, seqlen_q * num_heads,
                  num_heads, split, rows_per_split, stride_ob, stride_os, stride_oh, SPLIT)


@gluon.jit
def _shared_buffers(dtype: gl.constexpr, ROWS: gl.constexpr, k_desc, c_desc):
    """(q's rotary part [ROWS, 64], qv's two halves [2, ROWS, 256], in dtype; two blocks' rotary keys [2, 64, 64] and
    latent halves [4, 64, 256], in the caches' dtype) in shared memory: what both MLA kernels hold."""
    q_rope = gl.allocate_shared_memory(dtype, [ROWS, ROPE], gl.NVMMASharedLayout.get_default_for([ROWS, ROPE], dtype))
    q_lat = gl.allocate_shared_memory(dtype, [2, ROWS, HALF], gl.NVMMASharedLayout.get_default_for([ROWS, HALF], dtype))
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK, ROPE], k_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [4, BLOCK, HALF], c_desc.layout)
    return q_rope, q_lat, k_bufs, c_bufs


@gluon.jit
def mla_decode_kernel(q_ptr, qv_ptr, k_desc, c_desc, out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, cache_seqlens,
                      block_table, stride_bt, max_pages, cache_rows, seqlen_k_add, seqlen_q, m_tiles, num_heads,
                      rows_per_split, stride_qb, stride_qs, stride_qh, stride_qvb, stride_qvs, stride_qvh,
                      stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale,
                      BN: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr,
                      SPLIT: gl.constexpr, AFTER_PRIOR: gl.constexpr = False):
    """4 warps (warpgroup 0; the partition adds warpgroup 1). k_desc: the rotary keys as rows [rows, 64], blocks
    [min(64, PAGE), 64]; c_desc: the latent [rows, 512], blocks [min(64, PAGE), 256]; rows are b * cache_rows + t
    (contiguous, PAGE 0) or page * PAGE + t % PAGE (block_table [B, max_pages]). qk_scale: softmax_scale *
    log2(e) > 0. BN (tokens per block) must be 64 and STAGES (block buffers) 2: plan/decode.MlaGluonConfig.
    AFTER_PRIOR: launched as a programmatic dependent of the kernel before it (_unit waits for that grid)."""
    gl.static_assert(BN == BLOCK, "64-token blocks")
    gl.static_assert(STAGES == 2, "two block buffers")
    dtype: gl.constexpr = k_desc.dtype
    q_rope, q_lat, k_bufs, c_bufs = _shared_buffers(dtype, M_ROWS, k_desc, c_desc)
    p0_smem = gl.allocate_shared_memory(dtype, [M_ROWS, BLOCK],
                                        gl.NVMMASharedLayout.get_default_for([M_ROWS, BLOCK], dtype))
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    vecs = gl.allocate_shared_memory(gl.float32, [4, M_ROWS], vec_layout)
    ready_a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [N_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready_a.index(i), count=1)
        mbarrier.init(ready_b.index(i), count=1)
    for i in gl.static_range(N_BARS):
        mbarrier.init(bars.index(i), count=1)

    # Integer arguments equal to 1 arrive as constexprs, which worker partitions cannot take: make them tensors.
    seqlen_k_add = gl.to_tensor(seqlen_k_add)
    seqlen_q = gl.to_tensor(seqlen_q)
    m_tiles = gl.to_tensor(m_tiles)
    num_heads = gl.to_tensor(num_heads)
    rows_per_split = gl.to_tensor(rows_per_split)
    stride_bt = gl.to_tensor(stride_bt)
    max_pages = gl.to_tensor(max_pages)
    cache_rows = gl.to_tensor(cache_rows)
    stride_ob = gl.to_tensor(stride_ob)
    stride_os = gl.to_tensor(stride_os)
    stride_oh = gl.to_tensor(stride_oh)
    stride_lb = gl.to_tensor(stride_lb)
    stride_lh = gl.to_tensor(stride_lh)
    stride_ls = gl.to_tensor(stride_ls)
    gl.warp_specialize([
        (_wg0, (q_ptr, qv_ptr, stride_qb, stride_qs, stride_qh, stride_qvb, stride_qvs, stride_qvh, q_rope, q_lat,
                k_bufs, c_bufs, p0_smem, vecs, ready_a, ready_b, bars, k_desc, c_desc, block_table, stride_bt,
                max_pages, cache_rows, out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, cache_seqlens, seqlen_k_add,
                seqlen_q, m_tiles, num_heads, rows_per_split, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                stride_ls, qk_scale, PAGE, CAUSAL, SPLIT, AFTER_PRIOR)),
        (_wg1, (q_rope, q_lat, k_bufs, c_bufs, p0_smem, vecs, ready_a, ready_b, bars, k_desc, c_desc, block_table,
                stride_bt, max_pages, cache_rows, out_ptr, o_part_ptr, cache_seqlens, seqlen_k_add, seqlen_q,
                m_tiles, num_heads, rows_per_split, stride_ob, stride_os, stride_oh, qk_scale, PAGE, CAUSAL, SPLIT,
                AFTER_PRIOR)),
    ], [4], [256])
