"""NVFP4 weight GEMM for M <= 1024 on sm_90, on wgmma: c = a @ dequant(b)^T.

Why a third kernel: above 16 activation rows the GEMM stops being bound by the weight's bytes and becomes bound by
the tensor cores, and the Triton kernel (gemm_dequant.py) feeds them poorly: its decoded weight tile goes through
shared memory into the MMA and the dequantisation runs in the same instruction stream as the products (run 153,
graph replay, N=K=8192: M=64 48.5 us, M=128 55.0 us at its best tiles, cuBLAS bf16 38.3 / 38.7). Here, as in
CUTLASS's mixed-input GEMMs, the weight is the wgmma's register operand:

  * Swapped product c^T = w a^T: each consumer warpgroup owns 64 weight rows (wgmma's M) and the activation rows
    are wgmma's N (BLOCK_M = 16, 32, 64 or 128), so the decoded weight never leaves the registers.
  * The weight decode of the register-operand kernel (gemm_mma.scaled_halves): byte j of a row holds elements 2j
    and 2j+1, so c = a_even W_lo^T + a_odd W_hi^T, and a digit permutation of the contraction order gives each
    thread 16 contiguous bytes of its two rows (the A fragment's rows g and g + 8): one 16-byte shared-memory
    load per row and MMA step of 128 K values, decoded in registers.
  * The activation is prepared once per call by a small Triton kernel (activation_prep_kernel): each row scaled
    by a power of two into fp16's range (the decode gives fp16), split into even and odd K and put in the same
    permuted order, [2 * m_pad, K/2] fp16; it reaches shared memory by TMA, as wgmma's B operand.
  * Warp specialisation: a producer warp streams each stage (STEPS = 1 or 2 MMA steps: per consumer the weight
    bytes [64, 64 STEPS] and the 16-byte box of scales of an even step and its successor, a TMA box starting
    16-byte aligned; the activation halves [BLOCK_M, 64] of each step) by TMA into a ring of STAGES; the
    consumers decode step j + 1 while the products of step j run, queue its products behind them, and release a
    stage once its last step's products retire. Two-step stages read 128 contiguous bytes of each weight row
    (run 163: 1.1-1.5x faster at M <= 64 than one-step stages); a 128-row activation tile keeps one-step stages,
    which hold more steps in flight in the same shared memory.
  * Persistent CTAs: grid min(work units, SMs); CTA p takes units p, p + G, ... (a unit: 64 CONSUMERS weight
    rows x BLOCK_M activation rows x one K slice) and the ring runs on from one unit into the next.
  * The GEMM is launched as a programmatic dependent of the prep pass: its producer requests the first PREFETCH
    stages' weights before it waits for the prep grid (griddepcontrol.wait). Run 163: one stage is 2-8% faster
    than the whole ring (the activation copies of the first stages then wait behind fewer weight copies).

Shapes: prep [2 * m_pad, K/2] fp16 with row factors [m_pad] fp32 (activation_prep_kernel); b_data viewed as int32
words [N, K/8]; b_scales bytes [N, K/16]; g the float32 global scale; c [M, N] in a's dtype, or fp32 partials
[SPLIT_K, M, N] that the caller sums. K is a multiple of 256 (whole scale boxes; slices of whole stages and an
even number of steps). No CPU interpreter for the Gluon kernel: the CPU suite runs activation_prep_kernel and
compiles the rest for sm_90 (tests/sm90_compile_check.py); tests/lowp/test_gemm.py runs it on the GPU.
"""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ...kernels.gluon.common import DECODE_UNIT, grid_dependency_wait
from ...kernels.triton.combine import allow_dependent_launch
from .gemm_mma import scaled_halves

WEIGHT_ROWS = 64  # weight rows per consumer warpgroup: wgmma's M
STEP_K = 128  # K values per MMA step: 64 bytes of a weight row, 64 values of each activation half
HALF_STEP = STEP_K // 2
ROWS = gl.constexpr(WEIGHT_ROWS)
HALF = gl.constexpr(HALF_STEP)


@triton.jit
def activation_prep_kernel(a_ptr, prep_ptr, factor_ptr, M, m_pad, K, stride_am, stride_ak, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Row r of a [M, K] (fp16 / bf16) -> prep[r] and prep[m_pad + r] (the even and odd K values, [K/2] fp16 each,
    in the weight decode's contraction order) times 2^k, and factor[r] = 2^-k, with k putting the row's largest
    finite |value| in [2^8, 2^9) (k = 0 for a zero row; bf16 values stay exact unless 2^33 times smaller than the
    largest); rows M..m_pad are zeros. Order within each 64 values of a half: position kk = 16kb + 8i1 + 2t + i0
    holds value j = 16t + 4kb + 2i1 + i0 (gemm_mma._mma_order). Grid (m_pad,); K a multiple of 256, BLOCK_K a
    power of two >= 128 (one load of the whole row when K <= BLOCK_K: the second pass reads it from L1). The
    halves are reordered by a reshape and permute of the tile: measured 1.6-2.3x faster than gathering each
    position's value from the row (run 157, M = 64..256, K = 8192: 4.7-5.5 vs 7.8-12.5 us). PDL: the GEMM after
    it may launch at once (it fetches weights until griddepcontrol.wait)."""
    allow_dependent_launch(PDL)
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    row = a_ptr + r.to(tl.int64) * stride_am
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.abs(tl.load(row + (k0 + offs) * stride_ak, mask=(r < M) & (k0 + offs < K), other=0.0).to(tl.float32))
        amax = tl.maximum(amax, tl.where(x < float("inf"), x, 0.0))
    e = (tl.max(amax, 0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    k = tl.where(e == 0, 0, tl.minimum(tl.maximum(135 - e, -126), 126))
    up = ((127 + k) << 23).to(tl.float32, bitcast=True)
    tl.store(factor_ptr + r, ((127 - k) << 23).to(tl.float32, bitcast=True))
    half = tl.arange(0, BLOCK_K // 2)
    out = prep_ptr + r.to(tl.int64) * (K // 2)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(row + (k0 + offs) * stride_ak, mask=(r < M) & (k0 + offs < K), other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape((x * up).to(tl.float16), [BLOCK_K // 2, 2]))
        even = tl.reshape(tl.permute(tl.reshape(even, [BLOCK_K // 128, 4, 4, 2, 2]), [0, 2, 3, 1, 4]), [BLOCK_K // 2])
        odd = tl.reshape(tl.permute(tl.reshape(odd, [BLOCK_K // 128, 4, 4, 2, 2]), [0, 2, 3, 1, 4]), [BLOCK_K // 2])
        ok = k0 // 2 + half < K // 2
        tl.store(out + k0 // 2 + half, even, mask=ok)
        tl.store(out + m_pad.to(tl.int64) * (K // 2) + k0 // 2 + half, odd, mask=ok)


@gluon.constexpr_function
def _acc_layout(block_m):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_m, 16])


@gluon.constexpr_function
def _word_layout():
    """Registers of one step's weight words [64 rows, 16]: thread (warp w, lane 4g + t) holds words 4t..4t+3 (bytes
    16t..16t+15) of rows 16w + g and 16w + g + 8, the rows of wgmma's A fragment."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                      lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[WEIGHT_ROWS, 16])


@gluon.constexpr_function
def _scale_layout():
    """Registers of one step's scale bytes [64 rows, 8]: the two scales of each thread's 16 bytes (bytes 8s..8s+7
    of a row share scale s), same rows as _word_layout."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]],
                                      lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[WEIGHT_ROWS, 8])


@gluon.jit
def _operands(w_bufs, s_bufs, st, SUB: gl.constexpr, PAR: gl.constexpr, CID: gl.constexpr, CONSUMERS: gl.constexpr,
              BLOCK_M: gl.constexpr):
    """MMA step SUB of ring stage st: the decoded weight halves (lo, hi) [64, 64] fp16 in wgmma's A-operand
    registers (the stage's words 16 SUB..; PAR = the step's parity: which 8 of the 16-byte scale box are its)."""
    words = w_bufs.index(st * CONSUMERS + CID).slice(SUB * 16, 16, dim=1).load(_word_layout())
    s_bits = s_bufs.index(st * CONSUMERS + CID).slice(PAR * 8, 8, dim=1).load(_scale_layout())
    lo, hi = scaled_halves(words, s_bits, ROWS, HALF)
    a_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_acc_layout(BLOCK_M), k_width=2)
    return (gl.convert_layout(lo, a_dot, assert_trivial=True), gl.convert_layout(hi, a_dot, assert_trivial=True))


@gluon.jit
def _issue(acc, w_lo, w_hi, a_bufs, st, SUB: gl.constexpr, STEPS: gl.constexpr):
    """MMA step SUB of stage st: its two products (even activation half with W_lo, odd with W_hi), asynchronous."""
    acc = warpgroup_mma(w_lo, a_bufs.index(2 * (STEPS * st + SUB)).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(w_hi, a_bufs.index(2 * (STEPS * st + SUB) + 1).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _retire(acc, w_lo, w_hi, LEFT: gl.constexpr):
    """Wait for the products that read w_lo, w_hi (they stay live until then), leaving the LEFT newest product
    groups in flight."""
    acc, w_lo, w_hi = warpgroup_mma_wait(LEFT, deps=(acc, w_lo, w_hi))
    return acc


@gluon.jit
def _landed(ready, s, STAGES: gl.constexpr):
    """Ring stage of the CTA's stage s, once its copies have landed."""
    st = s % STAGES
    mbarrier.wait(ready.index(st), (s // STAGES) & 1)
    return st


@gluon.jit
def _steps(acc, a_bufs, w_bufs, s_bufs, ready, empty, sb, n_stages, CID: gl.constexpr, STAGES: gl.constexpr,
           STEPS: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr):
    """Stages sb..sb+n_stages-1 of one work unit (STEPS MMA steps each; n_stages even when STEPS == 1), two MMA
    steps per trip, A (an even K step) then B (odd): a step decodes while the previous one's products run, and
    its products are queued behind them before those retire, so the tensor cores never wait for this
    warpgroup's decode; a stage is released once its last step's products retire. Measured against retiring
    each step before queueing the next (run 156, graph replay): 1-6% faster at M = 32, 64 and N=28672 M=64, equal
    at M = 128, 256. No wgmma serialisation (ptxas C7515) although products are in flight across the trips."""
    PER_TRIP: gl.constexpr = 2 // STEPS  # stages per trip
    st_a = _landed(ready, sb, STAGES)
    w_lo, w_hi = _operands(w_bufs, s_bufs, st_a, 0, 0, CID, CONSUMERS, BLOCK_M)
    acc = _issue(acc, w_lo, w_hi, a_bufs, st_a, 0, STEPS)
    st_b = st_a
    if STEPS == 1:
        st_b = _landed(ready, sb + 1, STAGES)
    x_lo, x_hi = _operands(w_bufs, s_bufs, st_b, STEPS - 1, 1, CID, CONSUMERS, BLOCK_M)
    acc = _issue(acc, x_lo, x_hi, a_bufs, st_b, STEPS - 1, STEPS)
    acc = _retire(acc, w_lo, w_hi, 2)
    if STEPS == 1:
        mbarrier.arrive(empty.index(st_a), count=1)
    for s in range(sb + PER_TRIP, sb + n_stages, PER_TRIP):
        st_a = _landed(ready, s, STAGES)
        w_lo, w_hi = _operands(w_bufs, s_bufs, st_a, 0, 0, CID, CONSUMERS, BLOCK_M)
        acc = _issue(acc, w_lo, w_hi, a_bufs, st_a, 0, STEPS)
        acc = _retire(acc, x_lo, x_hi, 2)
        mbarrier.arrive(empty.index(st_b), count=1)
        st_b = st_a
        if STEPS == 1:
            st_b = _landed(ready, s + 1, STAGES)
        x_lo, x_hi = _operands(w_bufs, s_bufs, st_b, STEPS - 1, 1, CID, CONSUMERS, BLOCK_M)
        acc = _issue(acc, x_lo, x_hi, a_bufs, st_b, STEPS - 1, STEPS)
        acc = _retire(acc, w_lo, w_hi, 2)
        if STEPS == 1:
            mbarrier.arrive(empty.index(st_a), count=1)
    acc = _retire(acc, x_lo, x_hi, 0)
    mbarrier.arrive(empty.index(st_b), count=1)
    return acc


@gluon.jit
def _unit(u, m_pad, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr, SPLIT_K: gl.constexpr):
    """Work unit u -> (first weight row, first activation row, K slice). The activation tiles of one weight tile
    and K slice are adjacent units, so CTAs running at the same time share the tile's weights in the L2."""
    m_tiles = m_pad // BLOCK_M
    rest = u // m_tiles
    n_tile = rest // SPLIT_K
    return n_tile * (CONSUMERS * ROWS), (u - rest * m_tiles) * BLOCK_M, rest - n_tile * SPLIT_K


@gluon.jit
def _units(N, m_pad, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr, SPLIT_K: gl.constexpr):
    """How many work units this CTA takes: units pid, pid + G, ... of (weight tiles x activation tiles x K
    slices), G = the grid."""
    total = gl.cdiv(N, CONSUMERS * ROWS) * (m_pad // BLOCK_M) * SPLIT_K
    return gl.cdiv(total - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _consumer(a_bufs, w_bufs, s_bufs, ready, empty, factor_ptr, g_ptr, out_ptr, M, N, m_pad, n_stages, stride_cm,
              stride_cn, CID: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, STEPS: gl.constexpr,
              CONSUMERS: gl.constexpr, SPLIT_K: gl.constexpr):
    """For each of the CTA's work units: weight rows [n0 + 64 CID, +64) times activation rows [m0, m0 + BLOCK_M)
    over the unit's n_stages stages, into out, or with SPLIT_K > 1 into the slice's fp32 partials [SPLIT_K, M, N]
    (out_ptr, strides stride_cm / stride_cn). The ring runs on across units: the next unit's stages load while
    this one's products are stored. Measured against summing the slices in the kernel (the split finishing a tile
    last adds them): that was never faster, and 1.3x slower at M = 128 (run 158: 45.0 vs 34.6 us)."""
    layout: gl.constexpr = _acc_layout(BLOCK_M)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
    g = gl.load(g_ptr) * DECODE_UNIT
    # The prep pass wrote the row factors: long finished once the first activation arrives; the wait orders this
    # warpgroup's reads of them under PDL.
    grid_dependency_wait(n_stages)
    for i in range(_units(N, m_pad, BLOCK_M, CONSUMERS, SPLIT_K)):
        n0, m0, split = _unit(gl.program_id(0) + i * gl.num_programs(0), m_pad, BLOCK_M, CONSUMERS, SPLIT_K)
        m_idx = m0 + cols
        factor = gl.load(factor_ptr + m_idx) * g  # in flight during the unit's steps
        acc = gl.zeros([ROWS, BLOCK_M], gl.float32, layout)
        acc = _steps(acc, a_bufs, w_bufs, s_bufs, ready, empty, i * n_stages, n_stages, CID, STAGES, STEPS,
                     CONSUMERS, BLOCK_M)
        n_idx = n0 + CID * ROWS + rows
        # The row's 2^-k, the decode's 2^-6 unit and the global scale in one factor per activation row.
        c = acc * gl.expand_dims(factor, 0)
        mask = gl.expand_dims(m_idx < M, 0) & gl.expand_dims(n_idx < N, 1)
        offs = gl.expand_dims(m_idx.to(gl.int64) * stride_cm, 0) + gl.expand_dims(n_idx.to(gl.int64) * stride_cn, 1)
        # SPLIT_K > 1: this slice's fp32 partial; a second launch sums them in slice order
        offs += split.to(gl.int64) * M * N
        gl.store(out_ptr + offs, c.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _load_weights(w_desc, s_desc, w_bufs, s_bufs, bar, st, n0, step, CONSUMERS: gl.constexpr):
    """Each consumer's weight words of one stage from MMA step `step` on, and the 16-byte box of scales of steps
    2 (step // 2) and its successor (a TMA box starts 16-byte aligned); rows past N arrive as zeros: code 0,
    scale 0."""
    for c in gl.static_range(CONSUMERS):
        row = n0 + c * ROWS
        tma.async_copy_global_to_shared(w_desc, [row, step * 16], bar, w_bufs.index(st * CONSUMERS + c))
        tma.async_copy_global_to_shared(s_desc, [row, (step // 2) * 16], bar, s_bufs.index(st * CONSUMERS + c))


@gluon.jit
def _load_activation(a_desc, a_bufs, bar, st, m0, m_pad, step, STEPS: gl.constexpr):
    """Both activation halves of the stage's MMA steps (a TMA box of 128 swizzled bytes per row each)."""
    for sub in gl.static_range(STEPS):
        col = (step + sub) * HALF
        tma.async_copy_global_to_shared(a_desc, [m0, col], bar, a_bufs.index(2 * (STEPS * st + sub)))
        tma.async_copy_global_to_shared(a_desc, [m_pad + m0, col], bar, a_bufs.index(2 * (STEPS * st + sub) + 1))


@gluon.jit
def _stage_source(i, N, m_pad, n_stages, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr, SPLIT_K: gl.constexpr):
    """Ring stage i of this CTA -> (first weight row, first activation row, K stage)."""
    unit = i // n_stages
    n0, m0, split = _unit(gl.program_id(0) + unit * gl.num_programs(0), m_pad, BLOCK_M, CONSUMERS, SPLIT_K)
    return n0, m0, split * n_stages + i - unit * n_stages


@gluon.jit
def _producer(a_desc, w_desc, s_desc, a_bufs, w_bufs, s_bufs, ready, empty, N, m_pad, n_stages,
              STAGES: gl.constexpr, STEPS: gl.constexpr, CONSUMERS: gl.constexpr, SPLIT_K: gl.constexpr,
              PREFETCH: gl.constexpr):
    """TMA copies of each of the CTA's stages (all its units in turn) into the ring. The weights of the first
    PREFETCH stages are requested before the activation is known to be ready (under PDL this overlaps the prep
    pass; the weights are the HBM-bound part)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    nbytes: gl.constexpr = (2 * STEPS * a_desc.block_type.nbytes
                            + CONSUMERS * (w_desc.block_type.nbytes + s_desc.block_type.nbytes))
    total = _units(N, m_pad, BLOCK_M, CONSUMERS, SPLIT_K) * n_stages
    first = gl.minimum(total, PREFETCH)
    for i in range(first):  # fresh stages: no release to wait for
        n0, m0, stage = _stage_source(i, N, m_pad, n_stages, BLOCK_M, CONSUMERS, SPLIT_K)
        mbarrier.expect(ready.index(i), nbytes)
        _load_weights(w_desc, s_desc, w_bufs, s_bufs, ready.index(i), i, n0, stage * STEPS, CONSUMERS)
    grid_dependency_wait(first)
    for i in range(first):
        n0, m0, stage = _stage_source(i, N, m_pad, n_stages, BLOCK_M, CONSUMERS, SPLIT_K)
        _load_activation(a_desc, a_bufs, ready.index(i), i, m0, m_pad, stage * STEPS, STEPS)
    for i in range(first, total):
        st = i % STAGES
        mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # passes at once on a stage's first use
        n0, m0, stage = _stage_source(i, N, m_pad, n_stages, BLOCK_M, CONSUMERS, SPLIT_K)
        bar = ready.index(st)
        mbarrier.expect(bar, nbytes)
        _load_weights(w_desc, s_desc, w_bufs, s_bufs, bar, st, n0, stage * STEPS, CONSUMERS)
        _load_activation(a_desc, a_bufs, bar, st, m0, m_pad, stage * STEPS, STEPS)


@gluon.jit
def nvfp4_matmul_wgmma_kernel(a_desc, w_desc, s_desc, factor_ptr, g_ptr, out_ptr, M, N, m_pad, n_stages, stride_cm,
                              stride_cn, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
                              STEPS: gl.constexpr, SPLIT_K: gl.constexpr, PREFETCH: gl.constexpr):
    """Persistent: grid (G,), CTA p takes work units p, p + G, ... (_unit). 4 warps (consumer 0; the partitions
    add consumers 1.. and the producer warp). a_desc: the prepared activation [2 * m_pad, K/2] fp16, blocks
    [BLOCK_M, 64]; w_desc: the weight words [N, K/8] int32, blocks [64, 16 STEPS]; s_desc: the scale bytes
    [N, K/16], blocks [64, 16]; n_stages: stages of STEPS MMA steps (128 K values each) per slice."""
    gl.static_assert(STEPS == 1 or STEPS == 2, "one or two MMA steps per stage")
    gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2, "one or two consumer warpgroups")
    gl.static_assert(PREFETCH <= STAGES, "the prefetched stages are the ring's first ones")
    a_bufs = gl.allocate_shared_memory(gl.float16, [2 * STEPS * STAGES, BLOCK_M, HALF], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES * CONSUMERS, ROWS, 16 * STEPS], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES * CONSUMERS, ROWS, 16], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    # Integer arguments equal to 1 arrive as constexprs, which worker partitions cannot take: make them tensors.
    M = gl.to_tensor(M)
    N = gl.to_tensor(N)
    m_pad = gl.to_tensor(m_pad)
    n_stages = gl.to_tensor(n_stages)
    stride_cm = gl.to_tensor(stride_cm)
    stride_cn = gl.to_tensor(stride_cn)
    # (Partition arguments are spelled out per call: constexprs inside a tuple variable arrive as plain values.)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, s_bufs, ready, empty, factor_ptr, g_ptr, out_ptr, M, N, m_pad, n_stages,
                         stride_cm, stride_cn, 0, BLOCK_M, STAGES, STEPS, CONSUMERS, SPLIT_K)),
            (_consumer, (a_bufs, w_bufs, s_bufs, ready, empty, factor_ptr, g_ptr, out_ptr, M, N, m_pad, n_stages,
                         stride_cm, stride_cn, 1, BLOCK_M, STAGES, STEPS, CONSUMERS, SPLIT_K)),
            (_producer, (a_desc, w_desc, s_desc, a_bufs, w_bufs, s_bufs, ready, empty, N, m_pad, n_stages, STAGES,
                         STEPS, CONSUMERS, SPLIT_K, PREFETCH)),
        ], [4, 1], [232, 40])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, s_bufs, ready, empty, factor_ptr, g_ptr, out_ptr, M, N, m_pad, n_stages,
                         stride_cm, stride_cn, 0, BLOCK_M, STAGES, STEPS, CONSUMERS, SPLIT_K)),
            (_producer, (a_desc, w_desc, s_desc, a_bufs, w_bufs, s_bufs, ready, empty, N, m_pad, n_stages, STAGES,
                         STEPS, CONSUMERS, SPLIT_K, PREFETCH)),
        ], [1], [40])
