"""Attention backward dK/dV (and dQ by TMA reduce-add) for sm_90 with warp specialisation, written in Gluon.

Why a second dK/dV kernel: the Triton one (attn_bwd.py) runs the loads, five products and the softmax gradient of
a step in one instruction stream per warpgroup, with CTA barriers between them, and stays at 0.71-0.74x cuDNN at
d128 (notebook, session 6). Here the pipeline is stated explicitly, as in the forward (gluon/attn_fwd.py), following
FA3's backward:

  producer (1 warp, 24 registers): TMA loads of the CTA's K and V (128 keys, once), then Q and dO tiles of BLOCK_M
      query rows into a ring of STAGES stages, for every (query head of the GQA group, query block) that sees the
      keys: first the blocks that need a mask (causal diagonal, keys past Sk), then the rest.
  consumers (2 warpgroups, 240 registers each): 64 keys each. Rows-major scores, so lse and delta are two values per
      thread: S = Q K_w^T, dP = dO V_w^T, P = exp2(S * scale*log2(e) - lse2), dS = P (dP - delta); P and dS go to
      shared memory, from where dV_w += P^T dO and dK_w += dS^T Q read them transposed. With ATOMIC_DQ each
      warpgroup then computes half of dQ = dS K (its half of the head dim, over both warpgroups' 128 keys; the dS
      halves meet through an mbarrier) and adds it into an fp32 buffer with one TMA reduce-add per step. Without it
      the launcher runs the dQ pass of attn_bwd.py (deterministic gradients).

What made it fast (notebook, session 10): per-thread fp32 atomics for dQ cost more than all four other
products together (red.global from the accumulator layout touches 8 rows per warp instruction); one bulk TMA
reduce-add per step does not. The dQ product of step t is issued at step t + 1, ahead of S_{t+1}, and dV/dK stay in
flight into the next step, so a warpgroup neither waits for the other one's dS at once nor for its own products
before the next step's loads and MMAs are issued. At d128 the compiler hoisted ~30 loop-invariant wgmma descriptors
(K, V, P: one per 16-wide slice) out of the loop and spilled them; reloading them stalled the first consumer for 17%
of its samples (Nsight Compute, session 11). Addressing those buffers through an opaque zero keeps the descriptors in
the loop (a few integer adds each step) and the kernel free of spills: +12-13% at d128. The dQ tile's own fence
(`fence.proxy.async`, which also waits for the thread's outstanding global loads) and barrier held 7-15% of a
consumer's samples: the next step's lse/delta are loaded after it, and with ONE_FENCE the reduce-add shares the
P/dS fence instead (d64 +2-7%, d128 causal +4-8%, d128 non-causal -2-5%: not taken there).

Head dim 64: a step's exp2 and ALU work and its fixed costs (barriers, the shared-memory stores of P, dS and dQ and
the fences that wait for them) do not shrink with d while its products halve: at 64 rows per step d64 ran at
0.75x d128 (Nsight Compute: the dQ store's fence and barrier alone held 13-15% of a consumer's samples). d64
therefore takes 128 query rows per step (BLOCK_M), twice the products per fixed cost (+6-8%), and ONE_FENCE
(+2-7%): 0.80-0.86x d128 at s >= 4k (notebook, session 11), with a few spilled scalars (56-64 bytes) and shared
memory nearly full (225 KB).
At d64, rows of at most 256 keys (512 causal) keep the Triton kernels (plan.backward.bwd_ws_config).

Keys-major scores (FA3's SdP_swapAB: S^T = K_w Q^T, P^T and dS^T from registers into the dV/dK products) were
built and measured (session 20, `python -m tileflash sweep backward-ws --vary keys_major=0,1 dq_by_rows=0,1`):
d128 -1.2% / -5.6% (4k full, 16k causal), d64 within +-2% of dQ split by rows alone; removed.

Layout: q, do, dq_acc [B, Sq, Hq, D] and k, v [B, Sk, Hkv, D] through 4-D TMA descriptors (rows past a sequence's
end load as zeros and are dropped from the reduce-add); lse2 (lse * log2(e), +inf for rows that saw no key, from the
preprocess) and delta [B, Hq, Sq] float32 with a contiguous last dim, loaded with row masks (+inf past Sq, so those
rows' P is 0); dK, dV stored by pointers with key masks. Scope
(plan/backward.ws_backward_config decides, else the Triton kernels run): 16-bit dtypes, head dims 64 and 128, no
window or softcap beyond causal; varlen batches without seqused_k (VARLEN: rows
and keys offset by each sequence's start, see attn_bwd_ws_kernel).
Gluon has no CPU interpreter: tests/sm90_compile_check.py compiles this kernel for sm_90 on the CPU, and the GPU
suite checks its results.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton._C.libtriton import ir

from .common import barrier, opaque_zero, packed_sequence
from ..triton.masks import LOG2E

KEYS_PER_WARPGROUP = 64  # wgmma's M: each consumer warpgroup owns 64 keys of the CTA's 128
BLOCK_KEYS = 2 * KEYS_PER_WARPGROUP
WG_KEYS = gl.constexpr(KEYS_PER_WARPGROUP)
BLOCK_N = gl.constexpr(BLOCK_KEYS)


@gluon.constexpr_function
def _acc_layout(n):
    """The register layout of a warpgroup's wgmma accumulator with n columns (4 warps stacked along the rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _tile(n_tiles, num_heads_kv):
    """(batch, KV head, tile index, first key) of this CTA; tile 0 (the most query blocks when causal) first."""
    pid = gl.program_id(0)
    tile = pid % n_tiles
    bh = pid // n_tiles
    return bh // num_heads_kv, bh % num_heads_kv, tile, tile * BLOCK_N


@gluon.jit
def _query_blocks(start_n, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, VARLEN: gl.constexpr):
    """Query blocks [m_lo, m_hi) that see any of keys [start_n, start_n + 128), of which [m_lo, m_full) need a mask:
    all of them in the tile holding Sk's last key, else (causal, bottom-right aligned: row i sees key j iff
    j <= i + Sk - Sq) those whose first row does not see the tile's last key."""
    m_hi = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    m_lo = m_hi * 0
    m_full = m_lo
    if CAUSAL:
        diag = seqlen_k - seqlen_q
        m_lo = gl.minimum(gl.maximum(start_n - diag, 0) // BLOCK_M, m_hi)
        key_max = gl.minimum(start_n + BLOCK_N, seqlen_k) - 1
        m_full = gl.minimum(gl.maximum((gl.maximum(key_max - diag, 0) + BLOCK_M - 1) // BLOCK_M, m_lo), m_hi)
    if start_n + BLOCK_N > seqlen_k:
        m_full = m_hi
    if VARLEN:  # a tile past its sequence's keys (the grid covers the longest): no steps
        m_lo = gl.where(start_n < seqlen_k, m_lo, m_hi)
        m_full = gl.where(start_n < seqlen_k, m_full, m_hi)
    return m_lo, m_full, m_hi


@gluon.jit
def _step(u, n, m0, tile, head_kv, group_size, ROTATE: gl.constexpr, BLOCK_M: gl.constexpr):
    """(query head, first query row) of step u of a run of n blocks from m0 for each head of the group. ROTATE:
    CTAs of one head start at different blocks, so their dQ reduce-adds do not pile on the same rows."""
    i = u % n
    if ROTATE:
        i = (i + tile) % n
    return head_kv * group_size + u // n, (m0 + i) * BLOCK_M


@gluon.jit
def _step_at(t, t0, n_mask, n_full, m_lo, m_full, tile, head_kv, group_size, ROTATE: gl.constexpr,
             BLOCK_M: gl.constexpr):
    """_step for step t of the whole sequence: t0 masked steps (n_mask blocks per head), then the full ones."""
    if t < t0:
        hq, start_m = _step(t, n_mask, m_lo, tile, head_kv, group_size, False, BLOCK_M)
    else:
        hq, start_m = _step(t - t0, gl.maximum(n_full, 1), m_full, tile, head_kv, group_size, ROTATE, BLOCK_M)
    return hq, start_m


@gluon.jit
def _load_tile(desc, bar, buf, b, start_m, hq):
    """Rows [start_m, start_m + BLOCK_M) of head hq (Q or dO) into buf, counted on bar."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [b, start_m, hq, 0], bar, buf)


@gluon.jit
def _load_step(t, hq, start_m, b, q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, qdo_empty,
               STAGES: gl.constexpr):
    """Q and dO rows [start_m, start_m + BLOCK_M) of head hq into stage t % STAGES."""
    s = t % STAGES
    mbarrier.wait(qdo_empty.index(s), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
    _load_tile(q_desc, q_ready.index(s), q_bufs.index(s), b, start_m, hq)
    _load_tile(do_desc, do_ready.index(s), do_bufs.index(s), b, start_m, hq)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, do_ready,
              qdo_empty, seqlen_q, seqlen_k, n_tiles, num_heads_kv, group_size, cu_seqlens_q, cu_seqlens_k,
              CAUSAL: gl.constexpr, ROTATE: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
              VARLEN: gl.constexpr):
    b, hk, tile, start_n = _tile(n_tiles, num_heads_kv)
    b, q0, seqlen_q, k0, seqlen_k = packed_sequence(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, k0 + start_n, hk, 0], kv_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [b, k0 + start_n, hk, 0], kv_bar, v_smem.index(0))
    m_lo, m_full, m_hi = _query_blocks(start_n, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, VARLEN)
    n_mask = m_full - m_lo
    n_full = m_hi - m_full
    for u in range(n_mask * group_size):
        hq, start_m = _step(u, n_mask, m_lo, tile, hk, group_size, False, BLOCK_M)
        _load_step(u, hq, q0 + start_m, b, q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, qdo_empty, STAGES)
    t0 = n_mask * group_size
    for u in range(n_full * group_size):
        hq, start_m = _step(u, n_full, m_full, tile, hk, group_size, ROTATE, BLOCK_M)
        _load_step(t0 + u, hq, q0 + start_m, b, q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, qdo_empty,
                   STAGES)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add shared-memory tile src into global memory at coord through tensor_desc (TMA's cp.reduce.async.bulk;
    out-of-bounds rows are dropped). Gluon does not wrap this op of its builder in triton 3.6/3.7."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _load_stats(b, hq, q0, start_m, valid, seqlen_q, lse2_ptr, delta_ptr, stride_lb, stride_lh,
                layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """lse2 and delta of rows [start_m, start_m + BLOCK_M) of query head hq of the sequence whose rows start at q0
    (+inf and 0 past its Sq, or if not valid)."""
    rows = start_m + gl.arange(0, BLOCK_M, layout=layout)
    ok = (rows < seqlen_q) & valid
    stat = b.to(gl.int64) * stride_lb + hq.to(gl.int64) * stride_lh + q0 + rows
    return gl.load(lse2_ptr + stat, mask=ok, other=float("inf")), gl.load(delta_ptr + stat, mask=ok, other=0.0)


STATS_ROWS = gl.constexpr(64)  # rows per chunk of _row_stats
CAST_ROWS = gl.constexpr(128)  # rows per chunk of _convert_dq (64 fp32 registers a thread: one wait per chunk)


@gluon.jit
def _row_stats(b, hk, group_size, q0, row_lo, seqlen_q, o_ptr, do_ptr, lse_ptr, lse2_ptr, delta_ptr, stride_ob,
               stride_os, stride_oh, stride_dob, stride_dos, stride_doh, stride_sb, stride_sh, stride_ss, stride_lb,
               stride_lh, WG: gl.constexpr, HEAD_DIM: gl.constexpr):
    """ONE_LAUNCH: the preprocess's work for the rows this CTA reads (query rows [row_lo, Sq) of every head of its
    group): delta = rowsum(dO * O) and lse2 = lse * log2(e) (+inf for rows that saw no key) into the workspace rows
    _load_stats reads, every second chunk of STATS_ROWS rows per warpgroup. CTAs of one group write the same
    values into the same rows (the same code on the same inputs)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout)), 0)
    per_head = (seqlen_q - row_lo + STATS_ROWS - 1) // STATS_ROWS
    for c in range(WG, per_head * group_size, 2):
        hq = (hk * group_size + c // per_head).to(gl.int64)
        r = row_lo + (c % per_head) * STATS_ROWS + gl.arange(0, STATS_ROWS, layout=rows_l)
        ok = r < seqlen_q
        row = (q0 + r).to(gl.int64)
        ok2 = gl.expand_dims(ok, 1) & (cols < HEAD_DIM)
        o = gl.load(o_ptr + gl.expand_dims(b.to(gl.int64) * stride_ob + row * stride_os + hq * stride_oh, 1) + cols,
                    mask=ok2, other=0.0)
        do = gl.load(do_ptr + gl.expand_dims(b.to(gl.int64) * stride_dob + row * stride_dos + hq * stride_doh, 1)
                     + cols, mask=ok2, other=0.0)
        delta = gl.sum(o.to(gl.float32) * do.to(gl.float32), axis=1)
        lse = gl.load(lse_ptr + b.to(gl.int64) * stride_sb + hq * stride_sh + row * stride_ss, mask=ok, other=0.0)
        stat = b.to(gl.int64) * stride_lb + hq * stride_lh + row
        gl.store(delta_ptr + stat, delta, mask=ok)
        gl.store(lse2_ptr + stat, gl.where(lse == float("-inf"), float("inf"), lse * LOG2E), mask=ok)


@gluon.jit
def _bulk_writes_done(x):
    """Wait until this thread's TMA reduce-adds are written to global memory (tma.store_wait lowers to the .read
    form, which only waits until their shared-memory source is read)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _convert_dq(group, b, hk, group_size, q0, seqlen_q, n_tiles, dq_acc_ptr, dq_ptr, counter_ptr, stride_qb,
                stride_qs, stride_qh, softmax_scale, HEAD_DIM: gl.constexpr):
    """ONE_LAUNCH, after this CTA's dQ reduce-adds are written: count the CTA in at counter[group]; the last of the
    group's n_tiles CTAs writes dQ = softmax_scale * the fp32 sums of the group's rows (every head of the group,
    rows [0, Sq)) and zeroes those sums and its counter, leaving the buffer as it found it (direct.COUNTERS)."""
    arrived = gl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
    if arrived == n_tiles - 1:
        gl.store(counter_ptr + group, 0)
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout)), 0)
        per_head = (seqlen_q + CAST_ROWS - 1) // CAST_ROWS
        for c in range(per_head * group_size):
            hq = (hk * group_size + c // per_head).to(gl.int64)
            r = (c % per_head) * CAST_ROWS + gl.arange(0, CAST_ROWS, layout=gl.SliceLayout(1, layout))
            ok = gl.expand_dims(r < seqlen_q, 1) & (cols < HEAD_DIM)
            off = gl.expand_dims(b.to(gl.int64) * stride_qb + (q0 + r).to(gl.int64) * stride_qs + hq * stride_qh, 1) \
                + cols
            # .cg: the other CTAs' sums are in L2, not in this SM's L1
            acc = gl.load(dq_acc_ptr + off, mask=ok, other=0.0, cache_modifier=".cg")
            gl.store(dq_ptr + off, (acc * softmax_scale).to(dq_ptr.dtype.element_ty), mask=ok)
            gl.store(dq_acc_ptr + off, gl.zeros_like(acc), mask=ok)


@gluon.constexpr_function
def _dq_rows(block_m, by_rows):
    """Rows of a warpgroup's dQ tile: half the step's rows (by_rows, with the whole head dim) or all of them."""
    return block_m // 2 if by_rows else block_m


@gluon.constexpr_function
def _dq_cols(head_dim, by_rows):
    return head_dim if by_rows else head_dim // 2


@gluon.jit
def _dq_product(ds_buf, k_all, WG: gl.constexpr, DQ_BY_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                BLOCK_M: gl.constexpr):
    """This warpgroup's share of dQ = dS K over the CTA's 128 keys (both warpgroups' dS halves, [rows, keys] in
    shared memory), issued async."""
    DQ_ROWS: gl.constexpr = _dq_rows(BLOCK_M, DQ_BY_ROWS)
    DQ_COLS: gl.constexpr = _dq_cols(HEAD_DIM, DQ_BY_ROWS)
    if DQ_BY_ROWS:
        ds = ds_buf.slice(WG * DQ_ROWS, DQ_ROWS, dim=0)
    else:
        ds = ds_buf
    if DQ_BY_ROWS:
        k_part = k_all
    else:
        k_part = k_all.slice(WG * DQ_COLS, DQ_COLS, dim=1)
    return warpgroup_mma(ds, k_part, gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, _acc_layout(DQ_COLS)),
                         use_acc=False, is_async=True)


@gluon.jit
def _dq_reduce(dq_desc, b, prev_m, prev_hq, dq_w, WG: gl.constexpr, DQ_BY_ROWS: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """Add this warpgroup's dQ tile (in dq_w) into the fp32 buffer at its rows and columns (TMA reduce-add)."""
    if DQ_BY_ROWS:
        _tma_reduce_add(dq_desc, [b, prev_m + WG * (BLOCK_M // 2), prev_hq, 0], dq_w)
    else:
        _tma_reduce_add(dq_desc, [b, prev_m, prev_hq, WG * (HEAD_DIM // 2)], dq_w)


@gluon.jit
def _consume_step(t, hq, start_m, prev_hq, prev_m, next_hq, next_m, has_next, lse2, delta, dk, dv, b, q0, start_n,
                  seqlen_q, seqlen_k, q_bufs, do_bufs, k_smem, v_smem, p_bufs, ds_bufs, dq_w, dq_desc, q_ready,
                  do_ready, qdo_empty, ds_ready, lse2_ptr, delta_ptr, stride_lb, stride_lh, qk_scale,
                  WG: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ONE_FENCE: gl.constexpr,
                  DQ_BY_ROWS: gl.constexpr):
    """Step t (query head hq, rows from start_m of the sequence whose rows start at q0) of a consumer warpgroup,
    which also finishes step t - 1 (prev_hq, prev_m): its dQ product and TMA reduce-add, and the release of its
    Q/dO stage. Returns dK, dV and the next step's (next_hq, next_m) lse2 and delta, loaded at the end
    of this step: a load at the start of a step held up the fence before the dQ reduce-add, which waits for the
    thread's loads (session 11).

    Order of the products, so the tensor cores have work while this warpgroup runs its softmax:
      dQ_{t-1} = dS_{t-1} K (both warpgroups' dS halves, from shared memory), S_t
      | wait for dQ_{t-1} (and dV_{t-1}, dK_{t-1} before it): release stage t-1, store dQ_{t-1}, reduce-add it (TMA)
      | dP_t | wait S_t: P_t | wait dP_t: dS_t
      | dV_w += P_t^T dO, dK_w += dS_t^T Q, left in flight into step t + 1.
    At t = 0 the dQ product reads an unwritten buffer and its result is dropped (a uniform instruction stream).
    S = Q K_w^T ([rows, 64 keys]): P and dS go to shared memory, from where the dV/dK products read them transposed.
    ONE_FENCE: the reduce-add of dQ_{t-1} is issued after the fence and barrier that publish P_t and dS_t, instead of
    after a fence of its own right behind its store: one fence and barrier fewer per step, and the store drains
    while the softmax runs; the reduce-add leaves later (plan.backward.bwd_ws_config says where that pays)."""
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = _acc_layout(WG_KEYS)
    s_shape: gl.constexpr = [BLOCK_M, WG_KEYS]
    stage = t % STAGES
    phase = (t // STAGES) & 1
    # The operands that stay put (K, V, P) are addressed through a zero the compiler cannot see: otherwise it hoists
    # their ~30 wgmma descriptors (one per 16-wide slice) out of the loop and spills them (notebook, session 11).
    z = opaque_zero(t)
    k_all = k_smem.index(z).reshape([BLOCK_N, HEAD_DIM])
    k_w = k_all.slice(WG * WG_KEYS, WG_KEYS, dim=0)
    v_w = v_smem.index(z).reshape([BLOCK_N, HEAD_DIM]).slice(WG * WG_KEYS, WG_KEYS, dim=0)
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    q_s = q_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
    do_s = do_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
    s_init = gl.zeros(s_shape, gl.float32, s_layout)  # ignored (use_acc=False): only its layout counts
    if ATOMIC_DQ:
        # Both halves of dS_{t-1} are in shared memory once both warpgroups arrived. Buffer t % 2 is written again
        # at step t + 2, after both warpgroups passed this wait at step t + 1, i.e. finished this product.
        mbarrier.wait(ds_ready.index((t + 1) % 2), ((t - 1) // 2) & 1, pred=t > 0)
        dq = _dq_product(ds_bufs.index((t + 1) % 2), k_all, WG, DQ_BY_ROWS, HEAD_DIM, BLOCK_M)
    mbarrier.wait(q_ready.index(stage), phase)
    sc = warpgroup_mma(q_s, k_w.permute((1, 0)), s_init, use_acc=False, is_async=True)
    # Products retire in order: everything before S_t is done now.
    if ATOMIC_DQ:
        dq, dk, dv = warpgroup_mma_wait(1, deps=(dq, dk, dv))
    else:
        dk, dv = warpgroup_mma_wait(1, deps=(dk, dv))
    mbarrier.arrive(qdo_empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)
    if ATOMIC_DQ:
        if t > 0:
            tma.store_wait(0)  # the previous reduce has read dq_w
            dq_w.reshape([_dq_rows(BLOCK_M, DQ_BY_ROWS), _dq_cols(HEAD_DIM, DQ_BY_ROWS)]).store(dq)
            if not ONE_FENCE:
                fence_async_shared()
                _dq_reduce(dq_desc, b, q0 + prev_m, prev_hq, dq_w, WG, DQ_BY_ROWS, HEAD_DIM, BLOCK_M)
    # dP_t is issued after dQ_{t-1} left the registers: fewer accumulators live at once. (Issued with S_t instead,
    # it also ran slower at d64, where registers are not short: it queues ahead of the other warpgroup's S.)
    mbarrier.wait(do_ready.index(stage), phase)
    dp = warpgroup_mma(do_s, v_w.permute((1, 0)), s_init, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(1, deps=(sc,))
    p = gl.exp2(sc * qk_scale - gl.expand_dims(lse2, 1))
    if MASKED:
        keys = start_n + WG * WG_KEYS + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(0, s_layout))
        keys2 = gl.expand_dims(keys, 0)
        ok = keys2 < seqlen_k
        if CAUSAL:
            ok = ok & (keys2 <= gl.expand_dims(rows + (seqlen_k - seqlen_q), 1))
        p = gl.where(ok, p, 0.0)
    p_bufs.index(WG + z).store(p.to(dtype))  # dV_{t-1}, which read this buffer, is done
    dp = warpgroup_mma_wait(0, deps=(dp,))
    ds = p * (dp - gl.expand_dims(delta, 1))
    ds_w = ds_bufs.index(t % 2).slice(WG * WG_KEYS, WG_KEYS, dim=1)
    ds_w.store(ds.to(dtype))
    fence_async_shared()
    barrier()  # every thread's P and dS are in shared memory before the products read them
    if ONE_FENCE and ATOMIC_DQ:
        mbarrier.arrive(ds_ready.index(t % 2), count=1)
        if t > 0:
            _dq_reduce(dq_desc, b, q0 + prev_m, prev_hq, dq_w, WG, DQ_BY_ROWS, HEAD_DIM, BLOCK_M)
    dv = warpgroup_mma(p_bufs.index(WG + z).permute((1, 0)), do_s, dv, is_async=True)
    dk = warpgroup_mma(ds_w.permute((1, 0)), q_s, dk, is_async=True)
    if ATOMIC_DQ and not ONE_FENCE:
        mbarrier.arrive(ds_ready.index(t % 2), count=1)
    lse2, delta = _load_stats(b, next_hq, q0, next_m, has_next, seqlen_q, lse2_ptr, delta_ptr, stride_lb,
                              stride_lh, gl.SliceLayout(1, s_layout), BLOCK_M)
    # Still in flight: the accumulators are carried into step t + 1, which waits for them first.
    dk, dv = warpgroup_mma_wait(2, deps=(dk, dv))
    return dk, dv, lse2, delta


@gluon.jit
def _finish(t_end, prev_hq, prev_m, dk, dv, b, k_all, ds_bufs, dq_w, dq_desc, ds_ready, WG: gl.constexpr,
            ATOMIC_DQ: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, DQ_BY_ROWS: gl.constexpr):
    """After the last step (t_end steps in all): its dQ product and reduce-add; every product waited for."""
    if ATOMIC_DQ:
        mbarrier.wait(ds_ready.index((t_end + 1) % 2), ((t_end - 1) // 2) & 1, pred=t_end > 0)
        dq = _dq_product(ds_bufs.index((t_end + 1) % 2), k_all, WG, DQ_BY_ROWS, HEAD_DIM, BLOCK_M)
        dq, dk, dv = warpgroup_mma_wait(0, deps=(dq, dk, dv))
        if t_end > 0:
            tma.store_wait(0)
            dq_w.reshape([_dq_rows(BLOCK_M, DQ_BY_ROWS), _dq_cols(HEAD_DIM, DQ_BY_ROWS)]).store(dq)
            fence_async_shared()
            _dq_reduce(dq_desc, b, prev_m, prev_hq, dq_w, WG, DQ_BY_ROWS, HEAD_DIM, BLOCK_M)  # prev_m: absolute
            tma.store_wait(0)
    else:
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    return dk, dv


@gluon.jit
def _consumer(q_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, kv_bar, q_ready,
              do_ready, qdo_empty, ds_ready, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, seqlen_q,
              seqlen_k, n_tiles, num_heads_kv, group_size, stride_lb, stride_lh, stride_dkb, stride_dks, stride_dkh,
              stride_dvb, stride_dvs, stride_dvh, qk_scale, softmax_scale, cu_seqlens_q, cu_seqlens_k, one,
              WG: gl.constexpr, CAUSAL: gl.constexpr, ROTATE: gl.constexpr, ATOMIC_DQ: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ONE_FENCE: gl.constexpr,
              DQ_BY_ROWS: gl.constexpr, VARLEN: gl.constexpr, ONE_LAUNCH: gl.constexpr):
    """one: ONE_LAUNCH's arguments (see attn_bwd_ws_kernel), a tuple."""
    b, hk, tile, start_n = _tile(n_tiles, num_heads_kv)
    group = b * num_heads_kv + hk
    # From here on b is the descriptors' batch coordinate (0 for packed sequences) and rows are the sequence's.
    b, q0, seqlen_q, k0, seqlen_k = packed_sequence(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    m_lo, m_full, m_hi = _query_blocks(start_n, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, VARLEN)
    if ONE_LAUNCH:
        (o_ptr, do_ptr, lse_ptr, dq_ptr, dq_acc_ptr, counter_ptr, stride_ob, stride_os, stride_oh, stride_dob,
         stride_dos, stride_doh, stride_sb, stride_sh, stride_ss, stride_qb, stride_qs, stride_qh, stats_ready,
         dq_done) = one
        _row_stats(b, hk, group_size, q0, m_lo * BLOCK_M, seqlen_q, o_ptr, do_ptr, lse_ptr, lse2_ptr, delta_ptr,
                   stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh, stride_sb, stride_sh,
                   stride_ss, stride_lb, stride_lh, WG, HEAD_DIM)
        mbarrier.arrive(stats_ready, count=1)  # both warpgroups' rows are written before either reads them
        mbarrier.wait(stats_ready, 0)
    n_mask = m_full - m_lo
    n_full = m_hi - m_full
    dtype: gl.constexpr = q_desc.dtype
    kv_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    k_all = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM])
    dq_w = dq_bufs.index(WG)
    dk = gl.zeros([WG_KEYS, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([WG_KEYS, HEAD_DIM], gl.float32, kv_layout)
    t0 = n_mask * group_size
    t_end = t0 + n_full * group_size
    prev_hq, prev_m = _step_at(0, t0, n_mask, n_full, m_lo, m_full, tile, hk, group_size, ROTATE, BLOCK_M)
    stats_layout: gl.constexpr = gl.SliceLayout(1, _acc_layout(WG_KEYS))
    lse2, delta = _load_stats(b, prev_hq, q0, prev_m, t_end > 0, seqlen_q, lse2_ptr, delta_ptr, stride_lb,
                              stride_lh, stats_layout, BLOCK_M)
    mbarrier.wait(kv_bar, 0)
    for u in range(t0):
        hq, start_m = _step(u, n_mask, m_lo, tile, hk, group_size, False, BLOCK_M)
        next_hq, next_m = _step_at(u + 1, t0, n_mask, n_full, m_lo, m_full, tile, hk, group_size, ROTATE, BLOCK_M)
        dk, dv, lse2, delta = _consume_step(
            u, hq, start_m, prev_hq, prev_m, next_hq, next_m, u + 1 < t_end, lse2, delta, dk, dv, b, q0, start_n,
            seqlen_q, seqlen_k, q_bufs, do_bufs, k_smem, v_smem, p_bufs, ds_bufs, dq_w, dq_desc, q_ready, do_ready,
            qdo_empty, ds_ready, lse2_ptr, delta_ptr, stride_lb, stride_lh, qk_scale, WG, True, CAUSAL, ATOMIC_DQ,
            HEAD_DIM, BLOCK_M, STAGES, ONE_FENCE, DQ_BY_ROWS)
        prev_hq = hq
        prev_m = start_m
    for u in range(t_end - t0):
        hq, start_m = _step(u, n_full, m_full, tile, hk, group_size, ROTATE, BLOCK_M)
        next_hq, next_m = _step(u + 1, n_full, m_full, tile, hk, group_size, ROTATE, BLOCK_M)
        dk, dv, lse2, delta = _consume_step(
            t0 + u, hq, start_m, prev_hq, prev_m, next_hq, next_m, t0 + u + 1 < t_end, lse2, delta, dk, dv, b, q0,
            start_n, seqlen_q, seqlen_k, q_bufs, do_bufs, k_smem, v_smem, p_bufs, ds_bufs, dq_w, dq_desc, q_ready,
            do_ready, qdo_empty, ds_ready, lse2_ptr, delta_ptr, stride_lb, stride_lh, qk_scale, WG, False, CAUSAL,
            ATOMIC_DQ, HEAD_DIM, BLOCK_M, STAGES, ONE_FENCE, DQ_BY_ROWS)
        prev_hq = hq
        prev_m = start_m
    dk, dv = _finish(t_end, prev_hq, q0 + prev_m, dk, dv, b, k_all, ds_bufs, dq_w, dq_desc, ds_ready, WG,
                     ATOMIC_DQ, HEAD_DIM, BLOCK_M, DQ_BY_ROWS)

    # Epilogue: keys no query row sees keep dK = dV = 0; rows past Sk are not stored.
    out_keys = start_n + WG * WG_KEYS + gl.arange(0, WG_KEYS, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    out_mask = gl.expand_dims(out_keys < seqlen_k, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
    key_off = gl.expand_dims((k0 + out_keys).to(gl.int64), 1)
    gl.store(dk_ptr + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh + key_off * stride_dks
             + gl.expand_dims(cols, 0), (dk * softmax_scale).to(dtype), mask=out_mask)
    gl.store(dv_ptr + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh + key_off * stride_dvs
             + gl.expand_dims(cols, 0), dv.to(dtype), mask=out_mask)
    if ONE_LAUNCH:
        _bulk_writes_done(t_end)
        if WG == 0:
            mbarrier.wait(dq_done, 0)  # the other warpgroup's reduce-adds are written
            barrier()  # and every thread's of this one
            _convert_dq(group, b, hk, group_size, q0, seqlen_q, n_tiles, dq_acc_ptr, dq_ptr, counter_ptr, stride_qb,
                        stride_qs, stride_qh, softmax_scale, HEAD_DIM)
        else:
            mbarrier.arrive(dq_done, count=1)


@gluon.jit
def attn_bwd_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse2_ptr, delta_ptr, dk_ptr,
                       dv_ptr, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, n_tiles, num_heads_kv, group_size,
                       stride_lb, stride_lh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                       qk_scale, softmax_scale, o_ptr, do_ptr, lse_ptr, dq_ptr, dq_acc_ptr, counter_ptr, stride_ob,
                       stride_os, stride_oh, stride_dob, stride_dos, stride_doh, stride_sb, stride_sh, stride_ss,
                       stride_qb, stride_qs, stride_qh, CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
                       ATOMIC_DQ: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                       STAGES: gl.constexpr, ONE_FENCE: gl.constexpr, DQ_BY_ROWS: gl.constexpr,
                       VARLEN: gl.constexpr, ONE_LAUNCH: gl.constexpr):
    """Grid: (n_tiles * B * Hkv,), 4 warps (the first consumer warpgroup; the partitions add 5 more). dq_desc: a
    descriptor over the fp32 dQ buffer [B, Sq, Hq, D] (zeroed; dQ without softmax_scale is added into it) with
    blocks [1, BLOCK_M / 2, 1, D] (DQ_BY_ROWS) or [1, BLOCK_M, 1, D / 2], used when ATOMIC_DQ.
    VARLEN: B sequences packed in [1, total, H, D] tensors (lse2/delta [1, Hq, total_q]), their rows and keys from
    cu_seqlens_q/k (int32 [B + 1]), n_tiles from the longest key sequence. Packed rows past a sequence's end hold
    the next sequence's rows: their lse2 is taken as +inf (P = 0, so dS = 0, and the dQ reduce-add adds zeros into
    the next sequence's rows); keys past its end are masked and not stored.
    ONE_LAUNCH (with ATOMIC_DQ, for calls whose host time exceeds their GPU time): the backward in this one launch
    instead of three. Each CTA first writes delta and lse2 of the rows it reads (_row_stats, from o, do [B, Sq, Hq,
    D] and lse [B, Hq, Sq] by their strides); dq_acc (the fp32 buffer under dq_desc, contiguous like dq) and
    counter_ptr (int32 [B * Hkv]) are zeros, and the last CTA of each (batch, KV head) writes dQ into dq (strides
    stride_q*) and leaves both zeroed (_convert_dq). Other calls pass stand-ins for these arguments."""
    dtype: gl.constexpr = q_desc.dtype
    # A leading dim of 1 lets the consumers address K and V by index (see _consume_step).
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, 1, _dq_rows(BLOCK_M, DQ_BY_ROWS), 1,
                                                     _dq_cols(HEAD_DIM, DQ_BY_ROWS)], dq_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, WG_KEYS], dtype)
    p_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, WG_KEYS], p_layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], ds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    if ONE_LAUNCH:
        stats_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        dq_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(stats_ready, count=2)
        mbarrier.init(dq_done, count=1)
    else:  # never used
        stats_ready = kv_bar
        dq_done = kv_bar
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
    fence_async_shared()
    # Integer arguments equal to 1 arrive as constexprs, which worker partitions cannot take: make them tensors.
    seqlen_q = gl.to_tensor(seqlen_q)
    seqlen_k = gl.to_tensor(seqlen_k)
    n_tiles = gl.to_tensor(n_tiles)
    num_heads_kv = gl.to_tensor(num_heads_kv)
    group_size = gl.to_tensor(group_size)
    stride_lb = gl.to_tensor(stride_lb)
    stride_lh = gl.to_tensor(stride_lh)
    stride_dkb = gl.to_tensor(stride_dkb)
    stride_dks = gl.to_tensor(stride_dks)
    stride_dkh = gl.to_tensor(stride_dkh)
    stride_dvb = gl.to_tensor(stride_dvb)
    stride_dvs = gl.to_tensor(stride_dvs)
    stride_dvh = gl.to_tensor(stride_dvh)
    one = (o_ptr, do_ptr, lse_ptr, dq_ptr, dq_acc_ptr, counter_ptr, gl.to_tensor(stride_ob), gl.to_tensor(stride_os),
           gl.to_tensor(stride_oh), gl.to_tensor(stride_dob), gl.to_tensor(stride_dos), gl.to_tensor(stride_doh),
           gl.to_tensor(stride_sb), gl.to_tensor(stride_sh), gl.to_tensor(stride_ss), gl.to_tensor(stride_qb),
           gl.to_tensor(stride_qs), gl.to_tensor(stride_qh), stats_ready, dq_done)
    WG0: gl.constexpr = 0
    WG1: gl.constexpr = 1
    # (Argument tuples are written out: a tuple built with + loses the constexprs' type.)
    gl.warp_specialize([
        (_consumer, (q_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, kv_bar, q_ready,
                     do_ready, qdo_empty, ds_ready, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, seqlen_q, seqlen_k, n_tiles,
                     num_heads_kv, group_size, stride_lb, stride_lh, stride_dkb, stride_dks, stride_dkh, stride_dvb,
                     stride_dvs, stride_dvh, qk_scale, softmax_scale, cu_seqlens_q, cu_seqlens_k, one, WG0, CAUSAL,
                     ROTATE, ATOMIC_DQ, HEAD_DIM, BLOCK_M, STAGES, ONE_FENCE, DQ_BY_ROWS, VARLEN, ONE_LAUNCH)),
        (_consumer, (q_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, kv_bar, q_ready,
                     do_ready, qdo_empty, ds_ready, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, seqlen_q, seqlen_k, n_tiles,
                     num_heads_kv, group_size, stride_lb, stride_lh, stride_dkb, stride_dks, stride_dkh, stride_dvb,
                     stride_dvs, stride_dvh, qk_scale, softmax_scale, cu_seqlens_q, cu_seqlens_k, one, WG1, CAUSAL,
                     ROTATE, ATOMIC_DQ, HEAD_DIM, BLOCK_M, STAGES, ONE_FENCE, DQ_BY_ROWS, VARLEN, ONE_LAUNCH)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, do_ready,
                     qdo_empty, seqlen_q, seqlen_k, n_tiles, num_heads_kv, group_size, cu_seqlens_q, cu_seqlens_k,
                     CAUSAL, ROTATE, BLOCK_M, STAGES, VARLEN)),
    ], [4, 1], [240, 24])


def n_tiles(seqlen_k: int) -> int:
    """CTAs per (batch, KV head): 128 keys each."""
    return triton.cdiv(seqlen_k, BLOCK_KEYS)
