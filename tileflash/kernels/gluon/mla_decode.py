"""MLA decode for sm_90 (DeepSeek-V2/V3 through FA3's qv), warp-specialised in Gluon: FlashMLA's split of the work.

Why a second MLA kernel (the Triton decode kernel serves qv too): the 64-row tile's O is [64, 512] fp32, two
warpgroups' worth of registers, and Triton runs both products and the softmax of every step in one instruction
stream over pointer loads, which left H=128 at 223-274 TFLOP/s (issue 28 asks 550). Here:

  producer (1 warp): TMA loads of a step's BN keys into a ring of STAGES stages, each the rotary keys [BN, 64] and
      the latent [BN, 512] as two [BN, 256] halves (a TMA box spans <= 256 elements). Paged caches take one copy
      per page (pages shorter than BN) or per step; pages past the sequence load from row -BN (zero-filled, no
      memory read), so every stage carries the same byte count. The sequence's last, partial step has its rows
      past the end zeroed in shared memory before the consumers see it: P is 0 there, but 0 * (NaN or inf) from
      an unwritten cache row would not be.
  consumer 0 (warpgroup 0): S_j = q k_j^T + qv c_j^T (q, qv [64 rows, 64 / 512] in shared memory, written once by
      this warpgroup before the partitions start), the online softmax, P_j into shared memory (two slots) with the
      row rescale alpha_j, and O[:, :256] += P_j c_j[:, :256]. S_{j+1} is issued before the softmax of step j,
      so the chain S -> softmax -> S never leaves the tensor cores idle (run 147's profile of the earlier order,
      S_{j+1} after the softmax: 2730 cycles a 32-token step, the tensor pipe 39% busy, consumer 1 waiting on P
      68% of its time). A stage is released once both halves of its PV have retired; S_{j+1} is issued while
      step j-1's stage is still held, so the ring needs STAGES >= 3.
  consumer 1 (warpgroup 1): O[:, 256:] = alpha_j O[:, 256:] + P_j c_j[:, 256:], from consumer 0's P and alpha.
  Epilogue: consumer 0 hands 1 / l to consumer 1 through shared memory; each stores its half of the output (or
  of the split's fp32 partial), consumer 0 the lse.

Rows: r = token * H + head of one sequence (pack-GQA over the single latent head), 64 per CTA (wgmma's M); rows
past Sq * H read zeros and are not stored. Grid (cdiv(Sq * H, 64) * B, num_splits). Split s covers its share of
the sequence's blocks (attn_fwd's rule), partials as attn_fwd's (o_part [splits, B * Sq * H, 512], lse_part
[splits, B * Sq * H]) for attn_combine. Causal (several query tokens): token t sees keys < seqlen_k - Sq + t + 1.

Scope (plan/decode.mla_gluon_config decides, else the Triton kernel runs): sm_90, 16-bit q and caches, a 64-wide
rotary key and a 512-wide latent, contiguous caches or pages of 8..32 or a multiple of BN tokens, TMA-aligned
rows; no window, softcap, sink, ALiBi, rotary or cache_batch_idx / cache_leftpad. No CPU interpreter: the CPU
suite compiles it (tests/sm90_compile_check.py), tests/kernels/test_gluon_mla.py runs it on the GPU.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .attn_fwd import LN2, _softmax
from .common import barrier
from ..triton.masks import LOG2E

ROWS = 64  # query rows per CTA: wgmma's M
ROPE_DIM = 64
LATENT_DIM = 512
HALF_DIM = LATENT_DIM // 2  # each consumer's share of O's columns, and the latent's TMA box width
M_ROWS = gl.constexpr(ROWS)
ROPE = gl.constexpr(ROPE_DIM)
HALF = gl.constexpr(HALF_DIM)
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_DIM, 16]))
O_ROWS = gl.constexpr(gl.SliceLayout(1, O_LAYOUT))  # one value per row of either consumer's half of O


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
def _unit(cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """(sequence, first query row, split, then _sequence's four) of this CTA."""
    b = gl.program_id(0) // m_tiles
    split = gl.program_id(1)
    seqlen_k, s_hi, s_lo, full_hi = _sequence(cache_seqlens, seqlen_k_add, b, gl.num_programs(1), split, seqlen_q,
                                              BN, CAUSAL)
    return b, (gl.program_id(0) % m_tiles) * M_ROWS, split, seqlen_k, s_hi, s_lo, full_hi


@gluon.jit
def _zero_tail(buf, valid, BN: gl.constexpr):
    """Rows >= valid of a [BN, HALF] stage buffer set to zero, 8 rows at a time (one warp)."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, 1], [1, 0])
    rows = gl.arange(0, 8, layout=gl.SliceLayout(1, lay))
    for c in gl.static_range(BN // 8):
        if c * 8 + 8 > valid:
            chunk = buf.slice(c * 8, 8)
            x = chunk.load(lay)
            chunk.store(gl.where(gl.expand_dims(c * 8 + rows < valid, 1), x, gl.zeros_like(x)))


@gluon.jit
def _load_step(k_desc, c_desc, k_bufs, c_bufs, bar, st, t0, b, seqlen_k, block_table, stride_bt, max_pages,
               cache_rows, BN: gl.constexpr, PAGE: gl.constexpr, CHUNK: gl.constexpr):
    """The copies of keys [t0, t0 + BN) into stage st, completing on bar (always the same byte count)."""
    mbarrier.expect(bar, BN // CHUNK * (k_desc.block_type.nbytes + 2 * c_desc.block_type.nbytes))
    for i in gl.static_range(BN // CHUNK):
        t = t0 + i * CHUNK
        if PAGE == 0:
            row = b * cache_rows + t
        else:
            page = gl.load(block_table + b.to(gl.int64) * stride_bt + gl.minimum(t // PAGE, max_pages - 1))
            row = gl.where(t < seqlen_k, page * PAGE + t % PAGE, -BN)  # past the end: zeros, no read
        tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_bufs.index(st).slice(i * CHUNK, CHUNK))
        for h in gl.static_range(2):
            tma.async_copy_global_to_shared(c_desc, [row, h * HALF], bar,
                                            c_bufs.index(2 * st + h).slice(i * CHUNK, CHUNK))


@gluon.jit
def _producer(k_desc, c_desc, k_bufs, c_bufs, kv_ready, kv_empty, tail_bar, cache_seqlens, block_table, stride_bt,
              max_pages, cache_rows, seqlen_k_add, seqlen_q, m_tiles, BN: gl.constexpr, STAGES: gl.constexpr,
              PAGE: gl.constexpr, CAUSAL: gl.constexpr):
    b, _, _, seqlen_k, s_hi, s_lo, _ = _unit(cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, BN, CAUSAL)
    CHUNK: gl.constexpr = BN if PAGE == 0 or PAGE >= BN else PAGE  # rows per copy
    for j in range(s_hi - s_lo):
        st = j % STAGES
        t0 = (s_lo + j) * BN
        tail = t0 + BN > seqlen_k
        mbarrier.wait(kv_empty.index(st), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        if tail:  # the producer zeroes the rows past the end before it releases the stage
            _load_step(k_desc, c_desc, k_bufs, c_bufs, tail_bar.index(0), st, t0, b, seqlen_k, block_table,
                       stride_bt, max_pages, cache_rows, BN, PAGE, CHUNK)
        else:
            _load_step(k_desc, c_desc, k_bufs, c_bufs, kv_ready.index(st), st, t0, b, seqlen_k, block_table,
                       stride_bt, max_pages, cache_rows, BN, PAGE, CHUNK)
        if tail:
            mbarrier.wait(tail_bar.index(0), 0)  # one tail per CTA: the barrier's first phase
            for h in gl.static_range(2):
                _zero_tail(c_bufs.index(2 * st + h), seqlen_k - t0, BN)
            fence_async_shared()
            mbarrier.arrive(kv_ready.index(st), count=1)


@gluon.jit
def _scores(q_rope, q_lat, k_bufs, c_bufs, st, s_init):
    """S = q k^T + qv c^T of stage st, issued (not waited)."""
    s = warpgroup_mma(q_rope, k_bufs.index(st).permute((1, 0)), s_init, use_acc=False, is_async=True)
    s = warpgroup_mma(q_lat.index(0), c_bufs.index(2 * st).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(q_lat.index(1), c_bufs.index(2 * st + 1).permute((1, 0)), s, is_async=True)


@gluon.jit
def _masked(s, jb, seqlen_k, seqlen_q, row0, num_heads, full_hi, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """Scores of block jb's keys past the sequence's end (or past a row's token, causal) set to -inf; blocks below
    full_hi need no mask."""
    if jb < full_hi:
        return s
    cols = jb * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
    ok = gl.expand_dims(cols < seqlen_k, 0)
    if CAUSAL:
        tok = (row0 + gl.arange(0, M_ROWS, layout=gl.SliceLayout(1, s.type.layout))) // num_heads
        ok = ok & (gl.expand_dims(cols, 0) < gl.expand_dims(seqlen_k - seqlen_q + 1 + tok, 1))
    return gl.where(ok, s, float("-inf"))


@gluon.jit
def _publish(p, alpha, p_smem, a_smem, p_ready, p_empty, j):
    """P_j and alpha_j into shared memory slot j % 2 for both consumers, once consumer 1 is done with P_{j-2}
    (two slots: consumer 0 runs a step ahead of consumer 1)."""
    slot = j % 2
    mbarrier.wait(p_empty.index(slot), ((j // 2) & 1) ^ 1)
    p_smem.index(slot).store(p.to(p_smem.dtype))
    a_smem.index(slot).store(alpha)
    fence_async_shared()
    barrier()
    mbarrier.arrive(p_ready.index(slot), count=1)


@gluon.jit
def _rescale_and_pv(acc, alpha, p_smem, c_bufs, kv_empty, j, STAGES: gl.constexpr):
    """With nothing in flight (a non-wgmma write to an accumulator inside a pipeline stage makes ptxas serialise
    every wgmma of the kernel: C7514 / C7515): release step j-1's stage, O[:, :256] *= alpha_j, then issue
    O[:, :256] += P_j c_j[:, :256]. Consumer 1's half of PV_j keeps the tensor cores busy meanwhile."""
    if j > 0:
        mbarrier.arrive(kv_empty.index((j - 1) % STAGES), count=1)
    acc = warpgroup_mma_init(acc * gl.expand_dims(gl.convert_layout(alpha, O_ROWS), 1))
    return warpgroup_mma(p_smem.index(j % 2), c_bufs.index(2 * (j % STAGES)), acc, is_async=True)


@gluon.jit
def _store_half(acc, inv_l, out_ptr, o_part_ptr, b, row0, rows_q, num_heads, split, rows_per_split, stride_ob,
                stride_os, stride_oh, col0, SPLIT: gl.constexpr):
    """Rows of this CTA times inv_l into out [B, Sq, H, 512] (q's dtype) or the split's fp32 partial."""
    lay: gl.constexpr = acc.type.layout
    r = row0 + gl.arange(0, M_ROWS, layout=gl.SliceLayout(1, lay))
    cols = gl.expand_dims(col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, lay)), 0)
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
def _consumer0(q_ptr, qv_ptr, stride_qb, stride_qs, stride_qh, stride_qvb, stride_qvs, stride_qvh, q_rope, q_lat,
               k_bufs, c_bufs, p_smem, a_smem, f_smem, kv_ready, kv_empty, p_ready, p_empty, f_ready, out_ptr,
               lse_ptr, o_part_ptr, lse_part_ptr, cache_seqlens, seqlen_k_add, seqlen_q, m_tiles,
               num_heads, rows_per_split, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
               qk_scale, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
    b, row0, split, seqlen_k, s_hi, s_lo, full_hi = _unit(cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, BN, CAUSAL)
    n = s_hi - s_lo
    # q and qv by pointers while the producer's first loads are in flight (only this warpgroup reads them).
    rows_q = seqlen_q * num_heads
    _load_q(q_rope, q_ptr, row0, rows_q, num_heads, stride_qb, stride_qs, stride_qh, b, 0, ROPE)
    for h in gl.static_range(2):
        _load_q(q_lat.index(h), qv_ptr, row0, rows_q, num_heads, stride_qvb, stride_qvs, stride_qvh, b, h * HALF,
                HALF)
    fence_async_shared()
    barrier()
    s_init = gl.zeros([M_ROWS, BN], gl.float32, s_layout)  # ignored (use_acc=False): only its layout counts
    m_i = gl.full([M_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([M_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([M_ROWS, HALF], gl.float32, O_LAYOUT)
    if n > 0:
        mbarrier.wait(kv_ready.index(0), 0)
        s = warpgroup_mma_wait(0, deps=(_scores(q_rope, q_lat, k_bufs, c_bufs, 0, s_init),))
        acc = warpgroup_mma_init(acc)  # PV_{j-1} stays in flight across steps
        for j in range(n - 1):  # S_j is complete, PV_{j-1} may be in flight
            # S_{j+1} is issued first: it runs under this step's softmax, so the tensor cores never wait for it.
            st = (j + 1) % STAGES
            mbarrier.wait(kv_ready.index(st), ((j + 1) // STAGES) & 1)
            s_next = _scores(q_rope, q_lat, k_bufs, c_bufs, st, s_init)
            p, m_i, l_i, alpha = _softmax(_masked(s, s_lo + j, seqlen_k, seqlen_q, row0, num_heads, full_hi, BN,
                                                  CAUSAL), m_i, l_i, qk_scale)
            _publish(p, alpha, p_smem, a_smem, p_ready, p_empty, j)
            acc, s = warpgroup_mma_wait(0, deps=(acc, s_next))  # PV_{j-1} and S_{j+1} have retired
            acc = _rescale_and_pv(acc, alpha, p_smem, c_bufs, kv_empty, j, STAGES)
        p, m_i, l_i, alpha = _softmax(_masked(s, s_hi - 1, seqlen_k, seqlen_q, row0, num_heads, full_hi, BN, CAUSAL),
                                      m_i, l_i, qk_scale)
        _publish(p, alpha, p_smem, a_smem, p_ready, p_empty, n - 1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        acc = _rescale_and_pv(acc, alpha, p_smem, c_bufs, kv_empty, n - 1, STAGES)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(kv_empty.index((n - 1) % STAGES), count=1)

    # Epilogue: rows that saw no key give out = 0 and lse = -inf.
    seen = l_i > 0.0
    inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
    f_smem.store(inv_l)
    barrier()
    mbarrier.arrive(f_ready.index(0), count=1)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    r = row0 + gl.arange(0, M_ROWS, layout=gl.SliceLayout(1, s_layout))
    if SPLIT:
        gl.store(lse_part_ptr + split.to(gl.int64) * rows_per_split + b.to(gl.int64) * rows_q + r, lse,
                 mask=r < rows_q)
    else:
        off = b.to(gl.int64) * stride_lb + (r % num_heads).to(gl.int64) * stride_lh + (r // num_heads) * stride_ls
        gl.store(lse_ptr + off, lse, mask=r < rows_q)
    _store_half(acc, gl.convert_layout(inv_l, O_ROWS), out_ptr, o_part_ptr, b, row0, rows_q, num_heads, split,
                rows_per_split, stride_ob, stride_os, stride_oh, 0, SPLIT)


@gluon.jit
def _consumer1(c_bufs, p_smem, a_smem, f_smem, kv_ready, kv_empty, p_ready, p_empty, f_ready, out_ptr, o_part_ptr,
               cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, num_heads, rows_per_split, stride_ob, stride_os,
               stride_oh, BN: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    b, row0, split, seqlen_k, s_hi, s_lo, full_hi = _unit(cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, BN, CAUSAL)
    acc = gl.zeros([M_ROWS, HALF], gl.float32, O_LAYOUT)
    for j in range(s_hi - s_lo):
        st = j % STAGES
        mbarrier.wait(kv_ready.index(st), (j // STAGES) & 1)  # the stage's bytes, seen by this warpgroup too
        slot = j % 2
        mbarrier.wait(p_ready.index(slot), (j // 2) & 1)
        acc = acc * gl.expand_dims(a_smem.index(slot).load(O_ROWS), 1)
        acc = warpgroup_mma(p_smem.index(slot), c_bufs.index(2 * st + 1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(p_empty.index(slot), count=1)
        mbarrier.arrive(kv_empty.index(st), count=1)
    mbarrier.wait(f_ready.index(0), 0)
    _store_half(acc, f_smem.load(O_ROWS), out_ptr, o_part_ptr, b, row0, seqlen_q * num_heads, num_heads, split,
                rows_per_split, stride_ob, stride_os, stride_oh, HALF, SPLIT)


@gluon.jit
def _load_q(smem, ptr, row0, rows_q, num_heads, stride_b, stride_s, stride_h, b, col0, COLS: gl.constexpr):
    """Rows [row0, row0 + 64) of q or qv (row r = token r // H, head r % H of sequence b), columns [col0, col0 +
    COLS), into smem; rows past Sq * H as zeros."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = row0 + gl.arange(0, M_ROWS, layout=gl.SliceLayout(1, lay))
    off = b.to(gl.int64) * stride_b + (r // num_heads).to(gl.int64) * stride_s + (r % num_heads).to(gl.int64) * stride_h
    cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, lay))
    smem.store(gl.load(ptr + gl.expand_dims(off, 1) + gl.expand_dims(cols, 0), mask=gl.expand_dims(r < rows_q, 1),
                       other=0.0))


@gluon.jit
def mla_decode_kernel(q_ptr, qv_ptr, k_desc, c_desc, out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, cache_seqlens,
                      block_table, stride_bt, max_pages, cache_rows, seqlen_k_add, seqlen_q, m_tiles, num_heads,
                      rows_per_split, stride_qb, stride_qs, stride_qh, stride_qvb, stride_qvs, stride_qvh,
                      stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale,
                      BN: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr, CAUSAL: gl.constexpr,
                      SPLIT: gl.constexpr):
    """4 warps (consumer 0; the partitions add 5 more). k_desc: the rotary keys as rows [rows, 64], blocks
    [min(BN, PAGE), 64]; c_desc: the latent [rows, 512], blocks [min(BN, PAGE), 256]; rows are b * cache_rows + t
    (contiguous, PAGE 0) or page * PAGE + t % PAGE (block_table [B, max_pages]). qk_scale: softmax_scale *
    log2(e) > 0."""
    gl.static_assert(STAGES >= 3, "S_{j+1} is issued while step j-1's stage is still held")
    dtype: gl.constexpr = k_desc.dtype
    q_rope = gl.allocate_shared_memory(dtype, [M_ROWS, ROPE],
                                       gl.NVMMASharedLayout.get_default_for([M_ROWS, ROPE], dtype))
    q_lat = gl.allocate_shared_memory(dtype, [2, M_ROWS, HALF],
                                      gl.NVMMASharedLayout.get_default_for([M_ROWS, HALF], dtype))
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, ROPE], k_desc.layout)
    c_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES, BN, HALF], c_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [2, M_ROWS, BN],
                                       gl.NVMMASharedLayout.get_default_for([M_ROWS, BN], dtype))
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    a_smem = gl.allocate_shared_memory(gl.float32, [2, M_ROWS], vec_layout)  # one alpha per P slot
    f_smem = gl.allocate_shared_memory(gl.float32, [M_ROWS], vec_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tail_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    f_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers' PV halves
    mbarrier.init(tail_bar.index(0), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_empty.index(i), count=1)
    mbarrier.init(f_ready.index(0), count=1)

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
        (_consumer0, (q_ptr, qv_ptr, stride_qb, stride_qs, stride_qh, stride_qvb, stride_qvs, stride_qvh, q_rope,
                      q_lat, k_bufs, c_bufs, p_smem, a_smem, f_smem, kv_ready, kv_empty, p_ready, p_empty, f_ready,
                      out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, cache_seqlens, seqlen_k_add, seqlen_q,
                      m_tiles, num_heads, rows_per_split, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                      stride_ls, qk_scale, BN, STAGES, CAUSAL, SPLIT)),
        (_consumer1, (c_bufs, p_smem, a_smem, f_smem, kv_ready, kv_empty, p_ready, p_empty, f_ready, out_ptr,
                      o_part_ptr, cache_seqlens, seqlen_k_add, seqlen_q, m_tiles, num_heads, rows_per_split,
                      stride_ob, stride_os, stride_oh, BN, STAGES, CAUSAL, SPLIT)),
        (_producer, (k_desc, c_desc, k_bufs, c_bufs, kv_ready, kv_empty, tail_bar, cache_seqlens, block_table,
                     stride_bt, max_pages, cache_rows, seqlen_k_add, seqlen_q, m_tiles, BN, STAGES, PAGE, CAUSAL)),
    ], [4, 1], [192, 56])  # consumer 0 (the default partition) gets the rest, 256: S_{j+1} in flight, O's half
