"""MLA decode for sm_90 at few query rows per sequence (H x Sq <= 32: DeepSeek-V3 served at tensor parallel 8 or 4
has 16 or 32 heads a GPU), in Gluon: the products transposed, one warpgroup.

Why not the seesaw kernel (mla_decode.py) there: wgmma's M is 64, so its tile pads 16 rows to 64 and does the tensor
work of 64; a 64-token block then costs it about as long at H=16 as at H=128 (~2.3 us per SM, run 212), which is
also how long the block's 72 KB take to arrive at one SM's share of HBM, so H=16 read 3.64 TB/s (issue 28 asks 3.8).
Here the block's keys are M and the query rows N (ROWS: 16 where the planner takes it; 8 and 32 for sweeps):

  S^T [64 keys, N] = K_rope q_rope^T + C q_lat^T   A: the block from shared memory (K-major), B: q [N, 576]
  O^T [512, N]    += C^T P^T                        A: the latent block read transposed (MN-major), B: P [N, 64]

so a block costs N / 64 of the seesaw's tensor work. One warpgroup does all of it, with the block's loads (two
buffers, the next issued once a block's P V retires) in flight meanwhile. O^T is two [256, N] fp32 accumulators
(32 registers a thread at N = 16). The softmax runs on S^T relabelled [N, 64] (gl.permute moves no
data), so it is attn_fwd's _softmax and the seesaw's _masked; its row reductions cross the 4 warps (keys are M).
Rows, splits, partials, pages and the zeroing of a partial block's tail are the seesaw's. Run 214 (H100, graph
replay): 1.01-1.15x the seesaw at H=16, and two 16-row tiles 1.05-1.10x it at H=32 (32-row tiles, 255 registers,
in between): plan/decode.mla_gluon_rows.

FP8 (e4m3 caches with per-tensor scales; the seesaw reads 16-bit caches only): the blocks arrive by
TMA as bytes (half of a 16-bit block's) into the same two buffers, and each is widened once, exactly, into one fp16
block (wgmma reads 16-bit operands from shared memory) that the block's products then read; its buffer is free for
block j + 2 as soon as it is widened, so two blocks of loads stay in flight through the products. At <= 16 rows
(AHEAD, the planner's choice there) block j + 1 is widened while P_j V_j runs, into a second fp16 block (its rotary
keys into registers, wgmma's A operand; 220 KB of shared memory at 16 rows), so a block's chain is max(widen, P V)
+ S + softmax rather than their sum (run 282, H100: 2-6% faster at H=16 and H=8). As in the Triton
kernel the tiles are fp16 and the scales factor out: S = k_scale (q . k8 + qv (v_scale / k_scale) . c8), O =
v_scale sum p c8; q and the rescaled qv are scaled by one power of two that puts their largest |value| in [2^8,
2^9) (fp16's range), undone in the logit scale with k_scale.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .attn_fwd import _softmax
from .common import barrier, fp16_row_scale
from .mla_decode import (BLOCK, HALF, OUT_LAYOUT, ROPE, _load_block, _masked, _q_tile, _shared_buffers, _store_half,
                         _store_lse, _store_queries, _unit, _zero_past_end)


@gluon.jit
def _store_out(acc_t, inv_l, out_ptr, o_part_ptr, b, row0, rows_q, num_heads, split, rows_per_split, stride_ob,
               stride_os, stride_oh, col0, SPLIT: gl.constexpr):
    """One half of O^T [256, N] as rows of O (coalesced), times inv_l: _store_half's destinations."""
    o = gl.convert_layout(gl.permute(acc_t, (1, 0)), OUT_LAYOUT)
    _store_half(o, gl.convert_layout(inv_l, gl.SliceLayout(1, OUT_LAYOUT)), out_ptr, o_part_ptr, b, row0, rows_q,
                num_heads, split, rows_per_split, stride_ob, stride_os, stride_oh, col0, SPLIT)


@gluon.jit
def _store_queries_fp16(q_rope, q_lat, q, lat0, lat1, qv_factor):
    """FP8 caches: _q_tile's q and qv * qv_factor as fp16 in shared memory, both times the 2^k that puts their
    largest finite |value| in [2^8, 2^9); returns 2^-k."""
    q = q.to(gl.float32)
    lat0 = lat0.to(gl.float32) * qv_factor
    lat1 = lat1.to(gl.float32) * qv_factor
    up, down = fp16_row_scale(gl.maximum(_finite_amax(q), gl.maximum(_finite_amax(lat0), _finite_amax(lat1))))
    _store_queries(q_rope, q_lat, (q * up).to(gl.float16), (lat0 * up).to(gl.float16), (lat1 * up).to(gl.float16))
    return down


@gluon.jit
def _finite_amax(x):
    """The largest finite |value| of x [R, C] (a scalar)."""
    a = gl.abs(x)
    return gl.max(gl.max(gl.where(a < float("inf"), a, 0.0), 1), 0)


@gluon.constexpr_function
def _widen_layout(cols):
    """16 bytes of e4m3 per thread along a row of a [rows, cols] block (cols 64 or 256)."""
    return gl.BlockedLayout([1, 16], [32 * 16 // cols, cols // 16], [4, 1], [1, 0])


@gluon.jit
def _widen(src, dst):
    """An e4m3 block in shared memory -> fp16 (exact) in dst, by the whole warpgroup."""
    dst.store(src.load(_widen_layout(src.shape[1])).to(gl.float16))


@gluon.jit
def _widen_block(k_bufs, c_bufs, c_wide, x, t0, seqlen_k, k_layout: gl.constexpr):
    """The e4m3 block in byte buffer x: its rotary keys as fp16 registers in k_layout (wgmma's A operand), its latent
    widened into c_wide[2x], c_wide[2x + 1] with rows past the sequence's end zeroed; every warp has read the bytes
    on return (the buffer may reload)."""
    k = k_bufs.index(x).load(k_layout).to(gl.float16)
    for h in gl.static_range(2):
        _widen(c_bufs.index(2 * x + h), c_wide.index(2 * x + h))
    fence_async_shared()
    barrier()
    _zero_past_end(c_wide.index(2 * x), t0, seqlen_k)
    _zero_past_end(c_wide.index(2 * x + 1), t0, seqlen_k)
    return k


@gluon.jit
def _values_t(c_lo, c_hi, p_smem, alpha, acc_l, acc_r):
    """O^T = alpha O^T + C^T P^T of the block whose latent halves are c_lo, c_hi (two products, issued)."""
    scale = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, acc_l.type.layout)), 0)
    acc_l = warpgroup_mma(c_lo.permute((1, 0)), p_smem.permute((1, 0)), acc_l * scale, is_async=True)
    return acc_l, warpgroup_mma(c_hi.permute((1, 0)), p_smem.permute((1, 0)), acc_r * scale, is_async=True)


@gluon.jit
def _scores_p(k_blk, c_lo, c_hi, q_rope, q_lat, p_smem, s_t, jb, m_i, l_i, seqlen_k, seqlen_q, row0, num_heads,
              full_hi, qk_scale, ready_hi, ph, t0, CAUSAL: gl.constexpr, WAIT_HI: gl.constexpr, ZERO: gl.constexpr):
    """S^T of block jb (rotary keys k_blk from shared memory or registers, latent halves c_lo, c_hi), retired, and
    its P in p_smem (visible to wgmma); returns (S^T's registers, the softmax state, alpha). WAIT_HI: c_hi is the
    16-bit cache's part B, awaited on ready_hi (phase ph) once the first two products are issued. ZERO: the latent
    rows past the sequence's end (keys t0..) zeroed before P V reads them (the plain loop; widened blocks are zeroed
    when widened)."""
    s_t = warpgroup_mma(k_blk, q_rope.permute((1, 0)), s_t, use_acc=False, is_async=True)
    s_t = warpgroup_mma(c_lo, q_lat.index(0).permute((1, 0)), s_t, is_async=True)
    if WAIT_HI:
        mbarrier.wait(ready_hi, ph)
    s_t = warpgroup_mma(c_hi, q_lat.index(1).permute((1, 0)), s_t, is_async=True)
    s_t = warpgroup_mma_wait(0, deps=(s_t,))
    p, m_i, l_i, alpha = _softmax(_masked(gl.permute(s_t, (1, 0)), jb, seqlen_k, seqlen_q, row0, num_heads, full_hi,
                                          BLOCK, CAUSAL), m_i, l_i, qk_scale)
    p_smem.store(p.to(p_smem.dtype))  # the last block's P V has retired (waited by the caller)
    if ZERO:
        _zero_past_end(c_lo, t0, seqlen_k)
        _zero_past_end(c_hi, t0, seqlen_k)
    fence_async_shared()
    barrier()
    return s_t, m_i, l_i, alpha


@gluon.jit
def _widened_ahead(q_rope, q_lat, k_bufs, c_bufs, c_wide, p_smem, ready_a, ready_b, s_t, m_i, l_i, acc_l, acc_r, n,
                   k_desc, c_desc, b, s_lo, seqlen_k, seqlen_q, row0, num_heads, full_hi, block_table, stride_bt,
                   max_pages, cache_rows, qk_scale, PAGE: gl.constexpr, CAUSAL: gl.constexpr):
    """The split's n blocks of an e4m3 cache with block j + 1 widened (CUDA cores) while P_j V_j runs on the tensor
    cores: per block the chain is max(widen, P V) + S + softmax rather than their sum. Block j's bytes are in buffer
    j % 2 and its widened latent in c_wide[2 (j % 2)..]; byte buffer x reloads (block j + 2) once block j is widened,
    so two blocks' bytes stay in flight."""
    k_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_t.type.layout, k_width=2)
    if n > 0:
        mbarrier.wait(ready_a.index(0), 0)
        mbarrier.wait(ready_b.index(0), 0)
        k_reg = _widen_block(k_bufs, c_bufs, c_wide, 0, s_lo * BLOCK, seqlen_k, k_layout)
        _load_block(0, 2, n, k_desc, c_desc, k_bufs, c_bufs, ready_a, ready_b, b, s_lo, seqlen_k, block_table,
                    stride_bt, max_pages, cache_rows, PAGE)
        _, m_i, l_i, alpha = _scores_p(k_reg, c_wide.index(0), c_wide.index(1), q_rope, q_lat, p_smem, s_t, s_lo, m_i,
                                       l_i, seqlen_k, seqlen_q, row0, num_heads, full_hi, qk_scale, ready_b.index(0), 0,
                                       0, CAUSAL, False, False)
        for j in range(n - 1):
            x = j % 2
            acc_l, acc_r = _values_t(c_wide.index(2 * x), c_wide.index(2 * x + 1), p_smem, alpha, acc_l,
                                     acc_r)  # P_j V_j, in flight
            ph = ((j + 1) // 2) & 1
            mbarrier.wait(ready_a.index(1 - x), ph)
            mbarrier.wait(ready_b.index(1 - x), ph)
            k_reg = _widen_block(k_bufs, c_bufs, c_wide, 1 - x, (s_lo + j + 1) * BLOCK, seqlen_k, k_layout)
            _load_block(1 - x, j + 3, n, k_desc, c_desc, k_bufs, c_bufs, ready_a, ready_b, b, s_lo, seqlen_k,
                        block_table, stride_bt, max_pages, cache_rows, PAGE)
            acc_l, acc_r = warpgroup_mma_wait(0, deps=(acc_l, acc_r))  # P_j V_j retired: p_smem is free
            _, m_i, l_i, alpha = _scores_p(k_reg, c_wide.index(2 * (1 - x)), c_wide.index(2 * (1 - x) + 1), q_rope,
                                           q_lat, p_smem, s_t, s_lo + (j + 1), m_i, l_i, seqlen_k, seqlen_q, row0,
                                           num_heads, full_hi, qk_scale, ready_b.index(0), 0, 0, CAUSAL, False, False)
        x = (n - 1) % 2
        acc_l, acc_r = _values_t(c_wide.index(2 * x), c_wide.index(2 * x + 1), p_smem, alpha, acc_l, acc_r)
        acc_l, acc_r = warpgroup_mma_wait(0, deps=(acc_l, acc_r))
    return m_i, l_i, acc_l, acc_r


@gluon.jit
def mla_decode_narrow_kernel(q_ptr, qv_ptr, k_desc, c_desc, out_ptr, lse_ptr, o_part_ptr, lse_part_ptr,
                             cache_seqlens, block_table, stride_bt, max_pages, cache_rows, seqlen_k_add, seqlen_q,
                             m_tiles, num_heads, rows_per_split, stride_qb, stride_qs, stride_qh, stride_qvb,
                             stride_qvs, stride_qvh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                             qk_scale, k_scale_ptr, v_scale_ptr, BN: gl.constexpr,
                             STAGES: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr,
                             ROWS: gl.constexpr, FP8: gl.constexpr, AHEAD: gl.constexpr = False,
                             AFTER_PRIOR: gl.constexpr = False):
    """4 warps; mla_decode_kernel's arguments (ROWS query rows per CTA instead of its 64), and with FP8 (e4m3
    caches) their fp32 scales k_scale_ptr[0] and v_scale_ptr[0] (unread otherwise). AHEAD (FP8): block j + 1 is
    widened while block j's P V runs (_widened_ahead). AFTER_PRIOR: as mla_decode_kernel's."""
    gl.static_assert(FP8 or not AHEAD, "AHEAD: e4m3 caches")
    gl.static_assert(ROWS <= 16 or not AHEAD, "AHEAD: two widened blocks leave shared memory for 16 rows at most")
    gl.static_assert(BN == BLOCK, "64-token blocks")
    gl.static_assert(STAGES == 2, "two block buffers")
    gl.static_assert(ROWS == 8 or ROWS == 16 or ROWS == 32, "8, 16 or 32 query rows")
    dtype: gl.constexpr = gl.float16 if FP8 else k_desc.dtype  # the tiles' (q, widened blocks, P)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, ROWS, 16])
    q_rope, q_lat, k_bufs, c_bufs = _shared_buffers(dtype, ROWS, k_desc, c_desc)
    p_smem = gl.allocate_shared_memory(dtype, [ROWS, BLOCK],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK], dtype))
    if FP8 and AHEAD:  # two blocks' latents widened (the rotary keys widen into registers): 220 KB in all
        c_wide = gl.allocate_shared_memory(dtype, [4, BLOCK, HALF],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK, HALF], dtype))
    elif FP8:  # the block being read, widened
        k_wide = gl.allocate_shared_memory(dtype, [BLOCK, ROPE], gl.NVMMASharedLayout.get_default_for([BLOCK, ROPE],
                                                                                                      dtype))
        c_wide = gl.allocate_shared_memory(dtype, [2, BLOCK, HALF],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK, HALF], dtype))
    ready_a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready_a.index(i), count=1)
        mbarrier.init(ready_b.index(i), count=1)

    b, row0, split, seqlen_k, s_hi, s_lo, full_hi = _unit(cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, BLOCK,
                                                          CAUSAL, ROWS, AFTER_PRIOR, SPLIT)
    n = s_hi - s_lo
    rows_q = seqlen_q * num_heads
    q, lat0, lat1 = _q_tile(q_ptr, qv_ptr, row0, rows_q, num_heads, stride_qb, stride_qs, stride_qh, stride_qvb,
                            stride_qvs, stride_qvh, b, ROWS)
    for first in gl.static_range(2):  # blocks 0 and 1, in flight while q arrives
        _load_block(first, first, n, k_desc, c_desc, k_bufs, c_bufs, ready_a, ready_b, b, s_lo, seqlen_k, block_table,
                    stride_bt, max_pages, cache_rows, PAGE)
    if FP8:
        k_scale = gl.load(k_scale_ptr)
        v_scale = gl.load(v_scale_ptr)
        qk_scale = qk_scale * k_scale * _store_queries_fp16(q_rope, q_lat, q, lat0, lat1, v_scale / k_scale)
    else:
        _store_queries(q_rope, q_lat, q, lat0, lat1)

    s_t = gl.zeros([BLOCK, ROWS], gl.float32, acc_layout)  # ignored by each block's first S^T (use_acc=False)
    rows_layout: gl.constexpr = gl.SliceLayout(1, gl.permute(s_t, (1, 0)).type.layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_layout)
    l_i = gl.zeros([ROWS], gl.float32, rows_layout)
    acc_l = gl.zeros([HALF, ROWS], gl.float32, acc_layout)
    acc_r = gl.zeros([HALF, ROWS], gl.float32, acc_layout)
    if AHEAD:
        m_i, l_i, acc_l, acc_r = _widened_ahead(q_rope, q_lat, k_bufs, c_bufs, c_wide, p_smem, ready_a, ready_b, s_t,
                                                m_i, l_i, acc_l, acc_r, n, k_desc, c_desc, b, s_lo, seqlen_k, seqlen_q,
                                                row0, num_heads, full_hi, block_table, stride_bt, max_pages,
                                                cache_rows, qk_scale, PAGE, CAUSAL)
    else:
        for j in range(n):
            x = j % 2
            ph = (j // 2) & 1
            t0 = (s_lo + j) * BLOCK
            mbarrier.wait(ready_a.index(x), ph)
            if FP8:  # widen the whole block, then its bytes' buffer takes block j + 2
                mbarrier.wait(ready_b.index(x), ph)
                _widen(k_bufs.index(x), k_wide)
                for h in gl.static_range(2):
                    _widen(c_bufs.index(2 * x + h), c_wide.index(h))
                fence_async_shared()
                barrier()
                _load_block(x, j + 2, n, k_desc, c_desc, k_bufs, c_bufs, ready_a, ready_b, b, s_lo, seqlen_k,
                            block_table, stride_bt, max_pages, cache_rows, PAGE)
                k_blk = k_wide
                c_lo = c_wide.index(0)
                c_hi = c_wide.index(1)
            else:
                k_blk = k_bufs.index(x)
                c_lo = c_bufs.index(2 * x)
                c_hi = c_bufs.index(2 * x + 1)
            s_t, m_i, l_i, alpha = _scores_p(k_blk, c_lo, c_hi, q_rope, q_lat, p_smem, s_t, s_lo + j, m_i, l_i,
                                             seqlen_k, seqlen_q, row0, num_heads, full_hi, qk_scale, ready_b.index(x),
                                             ph, t0, CAUSAL, not FP8, True)
            acc_l, acc_r = _values_t(c_lo, c_hi, p_smem, alpha, acc_l, acc_r)
            acc_l, acc_r = warpgroup_mma_wait(0, deps=(acc_l, acc_r))
            barrier()  # every warp's share of this block's products has retired before its buffer is reused
            if not FP8:
                _load_block(x, j + 2, n, k_desc, c_desc, k_bufs, c_bufs, ready_a, ready_b, b, s_lo, seqlen_k,
                            block_table, stride_bt, max_pages, cache_rows, PAGE)

    # Rows that saw no key give out = 0 and lse = -inf.
    seen = l_i > 0.0
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    _store_lse(m_i, l_i, seen, row0, lse_ptr, lse_part_ptr, b, rows_q, num_heads, split, rows_per_split, stride_lb,
               stride_lh, stride_ls, SPLIT)
    if FP8:
        inv_l = inv_l * v_scale
    _store_out(acc_l, inv_l, out_ptr, o_part_ptr, b, row0, rows_q, num_heads, split, rows_per_split, stride_ob,
               stride_os, stride_oh, 0, SPLIT)
    _store_out(acc_r, inv_l, out_ptr, o_part_ptr, b, row0, rows_q, num_heads, split, rows_per_split, stride_ob,
               stride_os, stride_oh, HALF, SPLIT)
