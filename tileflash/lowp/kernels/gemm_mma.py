"""NVFP4 weight GEMM for decode-sized M (<= 16) on sm_90, written in Gluon: c = a @ dequant(b)^T. Since run 164
the wgmma kernel (gemm_wgmma.py: a TMA ring, 1.2-1.5x faster at M = 1 and 16) takes these calls where K is a
multiple of 256; this one serves the rest (K a multiple of 32, weights TMA cannot address).

Why a second kernel (the Triton one is gemm_dequant.py): at M <= 16 the GEMM is bound by the bytes of the
weight, 0.5625 per value, so the dequantisation has ~5 issue slots per value to spend at the copy roofline. The
Triton kernel spent 7.3 SASS instructions per value (session 12 count): it interleaves the two nibbles of each
byte back into the K order (PRMT / HADD2 shuffles) and moves the decoded tile through shared memory into the MMA
operand layout. Here each weight byte is read from global memory straight into the thread that feeds it to the
tensor cores, and decoded there:

  * mma.sync (mma_v2, m16n8k16) with both operands in registers: A = the activation rows (16, zero-padded), B =
    the weight tile [K, N]; the accumulator is 16 x BLOCK_N fp32 spread over 4 warps along N.
  * Nibble halves: byte j of a weight row holds elements 2j (low nibble) and 2j+1 (high), so
    c = a_even @ W_lo^T + a_odd @ W_hi^T, two products over K/2 whose operands come from the same bytes without
    re-interleaving them.
  * A permuted contraction order: the MMA's B fragment gives thread (g, t) of a warp the K indices
    {2t, 2t+1, 2t+8, 2t+9} of every 16; within each 64 bytes of a row, byte j = 16t + 4kb + 2i1 + i0 is taken as
    MMA index kk = 16kb + 8i1 + 2t + i0 (a digit permutation, `_mma_order`), so each thread's bytes of a row are
    16 contiguous ones: one 16-byte load, four words that 13 PTX instructions each turn into 8 fp16 values
    (e2m1 -> e4m3 bit placement, then the hardware e4m3x2 -> f16x2 conversion). The activation is permuted the
    same way once per program, when its K slice is staged in shared memory.
  * Block scales: the 16 contiguous bytes span two scale blocks (bytes 8s..8s+7 share scale s), so a thread loads
    two scale bytes per row and 64 bytes and multiplies pairs of decoded values by {s, s} (HMUL2).
  * The activation is converted to fp16 (what the e4m3 conversion produces) after scaling each row by a power of
    two that puts its largest finite |value| in [2^8, 2^9) (exact for bf16 inputs; undone on the accumulator).

Shapes: a [M, K] fp16/bf16 (M <= 16), b_data [N, K/2] uint8, b_scales [N, K/16] e4m3 bits (uint8 view), g the
float32 global scale; c [M, N] in a's dtype, or fp32 partials [SPLIT_K, M, N] that the caller sums. Grid
(P, SPLIT_K): a program stages its K slice of a (at most KS_STEPS x BLOCK_K values) in shared memory once and
computes every P-th N tile with it. No CPU interpreter: the CPU suite compiles it for sm_90
(tests/sm90_compile_check.py), the GPU suite runs it (tests/lowp/test_gemm.py).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mma_v2

from ...kernels.gluon.common import DECODE_UNIT, barrier, fp16_row_scale
from .quant import e2m1_f16x2_ptx

ROWS = 16  # mma.sync's M: activation rows per program (M <= 16)
M_ROWS = gl.constexpr(ROWS)


@gluon.constexpr_function
def _mma_layout():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])


@gluon.jit
def _mma_order(x, R: gl.constexpr, J: gl.constexpr):
    """x [R, J] (J a multiple of 64) with byte index j = 64c + 16t + 4kb + 2i1 + i0 along dim 1 -> the same values
    at MMA index kk = 64c + 16kb + 8i1 + 2t + i0 (see the module docstring)."""
    x = gl.reshape(x, [R, J // 64, 4, 4, 2, 2])
    x = gl.permute(x, [0, 1, 3, 4, 2, 5])
    return gl.reshape(x, [R, J])


_WORDS_ASM = gl.constexpr("""{
        .reg .b32 l, h, t, r;
        .reg .b16 l0, l1, h0, h1;""" + e2m1_f16x2_ptx("$8", (("$0", "$1"), ("$2", "$3"), ("$4", "$5"), ("$6", "$7")))
                          + "}")


@gluon.jit
def _e2m1_words(words):
    """int32 words of four e2m1 byte pairs -> (lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3): the low / high nibble of
    byte i as fp16 holding e2m1 * 2^-6 (quant.e2m1_f16x2_ptx: e4m3 bit placement, then the hardware e4m3x2 ->
    f16x2 conversion): 9 shift/logic instructions and 4 conversions per 8 values."""
    return gl.inline_asm_elementwise(
        asm=_WORDS_ASM,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[words], dtype=(gl.float16,) * 8, is_pure=True, pack=1)


@gluon.jit
def _bytes_of_words(b0, b1, b2, b3, R: gl.constexpr, J: gl.constexpr):
    """Four [R, J / 4] tensors (byte i of each word) -> [R, J] in byte order."""
    return gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [R, J])


@gluon.constexpr_function
def _word_layout(block_n, bytes_per_row):
    """Registers of the weight bytes as int32 words [block_n, bytes_per_row / 4]: thread (warp w, lane 4g + t)
    holds rows g + 8w (+ 32 per repetition) and words 4t..4t+3 (bytes 16t..16t+15) of every 16 (+ 16 per
    repetition): one 16-byte load per row and 64 bytes. Words, not bytes, so the registers carried across loop
    iterations need no re-packing before the decode."""
    reg = [[0, 1], [0, 2]] + [[0, 16 << i] for i in range((bytes_per_row // 64).bit_length() - 1)]
    reg += [[32 << i, 0] for i in range((block_n // 32).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[8, 0], [16, 0]], block_bases=[],
                                      shape=[block_n, bytes_per_row // 4])


@gluon.constexpr_function
def _scale_layout(block_n, bytes_per_row):
    """Registers of the scale bits [block_n, bytes_per_row / 8] that _word_layout's bytes need: the two scales
    of each thread's 16 bytes (bytes 8s..8s+7 share scale s), contiguous."""
    reg = [[0, 1]] + [[0, 8 << i] for i in range((bytes_per_row // 64).bit_length() - 1)]
    reg += [[32 << i, 0] for i in range((block_n // 32).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[8, 0], [16, 0]], block_bases=[],
                                      shape=[block_n, bytes_per_row // 8])


@gluon.jit
def scaled_halves(packed, s_bits, R: gl.constexpr, BK2: gl.constexpr):
    """Weight words [R, BK2 / 4] (four bytes of a row each) and their scale bits [R, BK2 / 8] -> (lo, hi) [R, BK2]
    fp16 in MMA order: the decoded low / high nibbles times their block scales (e2m1 * scale / 2^6, exact in fp16).
    The callers' register layouts give each thread 16 contiguous bytes of a row and the two scales they need;
    they convert the result to their MMA operand layout without moving data (shared with gemm_wgmma.py)."""
    l0, l1, l2, l3, h0, h1, h2, h3 = _e2m1_words(packed)
    lo = _bytes_of_words(l0, l1, l2, l3, R, BK2)
    hi = _bytes_of_words(h0, h1, h2, h3, R, BK2)
    scale = s_bits.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    blocks: gl.constexpr = gl.reshape(lo, [R, BK2 // 8, 8]).type.layout  # 8 bytes per scale block
    scale = gl.expand_dims(gl.convert_layout(scale, gl.SliceLayout(2, blocks), assert_trivial=True), 2)
    lo = gl.reshape(gl.reshape(lo, [R, BK2 // 8, 8]) * scale, [R, BK2])
    hi = gl.reshape(gl.reshape(hi, [R, BK2 // 8, 8]) * scale, [R, BK2])
    return _mma_order(lo, R, BK2), _mma_order(hi, R, BK2)


@gluon.jit
def _weight_tile(packed, s_bits, BLOCK_N: gl.constexpr, BK2: gl.constexpr):
    """One step of weight words (_weight_load) and scale bits -> (W_lo, W_hi) [BK2, BLOCK_N] fp16 in the MMA's B
    layout (scaled_halves, transposed)."""
    lo, hi = scaled_halves(packed, s_bits, BLOCK_N, BK2)
    b_dot: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=_mma_layout(), k_width=2)
    w_lo = gl.convert_layout(gl.permute(lo, [1, 0]), b_dot, assert_trivial=True)
    w_hi = gl.convert_layout(gl.permute(hi, [1, 0]), b_dot, assert_trivial=True)
    return w_lo, w_hi


@gluon.jit
def _stage_activation(a_ptr, a_raw, a_even, a_odd, M, k_lo, k_hi, stride_am, n_steps,
                      BLOCK_K: gl.constexpr, KS_STEPS: gl.constexpr):
    """a[:, k_lo:k_hi] -> shared memory as fp16, scaled per row (see fp16_row_scale), split into even and odd K
    and put in MMA order, one [16, BLOCK_K / 2] slab per step. The raw slice arrives by asynchronous copies, all in
    flight at once (one memory latency, not one per step), and is read twice from shared memory: for the row
    maxima, then for the conversion. Returns each row's 2^-k (to undo the scale)."""
    BK2: gl.constexpr = BLOCK_K // 2
    a_layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_K // 32], [1, 32], [4, 1], [1, 0])
    a_rows = gl.arange(0, M_ROWS, layout=gl.SliceLayout(1, a_layout))
    a_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_layout))
    row_ptrs = a_ptr + gl.expand_dims(a_rows.to(gl.int64) * stride_am, 1)
    row_ok = gl.expand_dims(a_rows < M, 1)
    for st in gl.static_range(KS_STEPS):
        k = k_lo + st * BLOCK_K + a_cols
        async_copy.async_copy_global_to_shared(a_raw.index(st), row_ptrs + gl.expand_dims(k, 0),
                                               mask=row_ok & gl.expand_dims(k < k_hi, 0))
    async_copy.commit_group()
    async_copy.wait_group(0)
    barrier()
    amax = gl.zeros([M_ROWS], gl.float32, gl.SliceLayout(1, a_layout))
    for st in range(n_steps):
        ok = row_ok & gl.expand_dims(k_lo + st * BLOCK_K + a_cols < k_hi, 0)  # masked copies leave no zeros
        x = gl.abs(gl.where(ok, a_raw.index(st).load(a_layout).to(gl.float32), 0.0))
        amax = gl.maximum(amax, gl.max(gl.where(x < float("inf"), x, 0.0), 1))
    up, down = fp16_row_scale(amax)
    for st in range(n_steps):
        ok = row_ok & gl.expand_dims(k_lo + st * BLOCK_K + a_cols < k_hi, 0)
        x = gl.where(ok, a_raw.index(st).load(a_layout).to(gl.float32), 0.0)
        ev, od = gl.split(gl.reshape((x * gl.expand_dims(up, 1)).to(gl.float16), [M_ROWS, BK2, 2]))
        a_even.index(st).store(_mma_order(ev, M_ROWS, BK2))
        a_odd.index(st).store(_mma_order(od, M_ROWS, BK2))
    barrier()
    return down


@gluon.jit
def _weight_load(b_ptr, s_ptr, row0, jst, live, j0, kb, N, stride_bn, stride_sn, BLOCK_N: gl.constexpr,
                 BK2: gl.constexpr):
    """The weight bytes of rows row0.. and bytes j0 + jst.. as int32 words [BLOCK_N, BK2 / 4], and their scale
    bits [BLOCK_N, BK2 / 8], in the registers of _word_layout / _scale_layout (rows of b_data 16-byte aligned);
    bytes past the slice's kb, rows past N and everything when not live load as code 0 with scale 0."""
    w_layout: gl.constexpr = _word_layout(BLOCK_N, BK2)
    s_layout: gl.constexpr = _scale_layout(BLOCK_N, BK2)
    rows = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
    wj = jst // 4 + gl.arange(0, BK2 // 4, layout=gl.SliceLayout(0, w_layout))
    row_ptrs = (b_ptr + gl.expand_dims(rows.to(gl.int64) * stride_bn + j0, 1)).to(gl.pointer_type(gl.int32))
    packed = gl.load(row_ptrs + gl.expand_dims(wj, 0),
                     mask=gl.expand_dims((rows < N) & live, 1) & gl.expand_dims(wj < kb // 4, 0), other=0)
    s_rows = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    sj = jst // 8 + gl.arange(0, BK2 // 8, layout=gl.SliceLayout(0, s_layout))
    s_bits = gl.load(s_ptr + gl.expand_dims(s_rows.to(gl.int64) * stride_sn, 1) + gl.expand_dims(j0 // 8 + sj, 0),
                     mask=gl.expand_dims((s_rows < N) & live, 1) & gl.expand_dims(sj < kb // 8, 0), other=0)
    return packed, s_bits


@gluon.jit
def _step(acc_lo, acc_hi, w, sc, a_even, a_odd, row, jst, kb, M, N, c_rows, c_base, row_factor, stride_cn,
          BLOCK_N: gl.constexpr, BK2: gl.constexpr):
    """One iteration: the products of one weight step; on the tile's last step, its output tile is stored and the
    accumulators restart."""
    mma: gl.constexpr = _mma_layout()
    a_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    st = jst // BK2
    w_lo, w_hi = _weight_tile(w, sc, BLOCK_N, BK2)
    acc_lo = mma_v2(a_even.index(st).load(a_dot), w_lo, acc_lo)
    acc_hi = mma_v2(a_odd.index(st).load(a_dot), w_hi, acc_hi)
    if jst + BK2 >= kb:  # the tile's last step
        c_cols = row + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        c_ok = gl.expand_dims(c_rows < M, 1) & gl.expand_dims(c_cols < N, 0)
        gl.store(c_base + gl.expand_dims(c_cols.to(gl.int64) * stride_cn, 0),
                 ((acc_lo + acc_hi) * row_factor).to(c_base.dtype.element_ty), mask=c_ok)
        acc_lo = gl.zeros([M_ROWS, BLOCK_N], gl.float32, mma)
        acc_hi = gl.zeros([M_ROWS, BLOCK_N], gl.float32, mma)
    return acc_lo, acc_hi


@gluon.jit
def _advance(row, jst, kb, P, BLOCK_N: gl.constexpr, BK2: gl.constexpr):
    """(first row, first byte) of the next iteration: the next step of the tile, else step 0 of the next tile."""
    last = jst + BK2 >= kb
    return gl.where(last, row + P * BLOCK_N, row), gl.where(last, 0, jst + BK2)


@gluon.jit
def nvfp4_matmul_mma_kernel(a_ptr, b_ptr, s_ptr, g_ptr, c_ptr, M, N, K, k_per_split, kb_per_split,
                            stride_am, stride_bn, stride_sn, stride_cm, stride_cn,
                            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, KS_STEPS: gl.constexpr,
                            SPLIT_K: gl.constexpr):
    """Grid (P programs over N, SPLIT_K), 4 warps. Program (p, s) stages K slice s of a (k_per_split values,
    kb_per_split = k_per_split / 2 bytes; a's rows contiguous, K a multiple of 32) once and computes the N tiles
    p, p + P, ...; its (tile, step) iterations run as one loop whose weight loads are issued ahead of use.
    SPLIT_K > 1: c_ptr is an fp32 workspace [SPLIT_K, M, N] (stride_cm, stride_cn for M, N)."""
    BK2: gl.constexpr = BLOCK_K // 2
    mma: gl.constexpr = _mma_layout()
    p = gl.program_id(0)
    P = gl.num_programs(0)
    split = gl.program_id(1)
    k_lo = split * k_per_split
    k_hi = gl.minimum(k_lo + k_per_split, K)
    n_steps = gl.cdiv(k_hi - k_lo, BLOCK_K)
    a_raw = gl.allocate_shared_memory(a_ptr.dtype.element_ty, [KS_STEPS, M_ROWS, BLOCK_K],
                                      gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
    slab: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    a_even = gl.allocate_shared_memory(gl.float16, [KS_STEPS, M_ROWS, BK2], slab)
    a_odd = gl.allocate_shared_memory(gl.float16, [KS_STEPS, M_ROWS, BK2], slab)
    j0 = split * kb_per_split  # first byte of this program's slice of each weight row
    kb = gl.multiple_of((k_hi - k_lo) // 2, 16)  # bytes of the slice: K % 32 == 0, so whole 16-byte vectors
    total = gl.cdiv(gl.cdiv(N, BLOCK_N) - p, P) * n_steps
    # Iteration i is step i % n_steps of tile p + (i // n_steps) * P; (row, byte) counters instead of divisions.
    # Two iterations per trip, each slot's registers reloaded right after use (two iterations ahead, no moves).
    row, jst = p * BLOCK_N, 0  # iteration i's
    wa, sa = _weight_load(b_ptr, s_ptr, row, 0, 0 < total, j0, kb, N, stride_bn, stride_sn, BLOCK_N, BK2)
    row_next, j_next = _advance(row, 0, kb, P, BLOCK_N, BK2)
    wb, sb = _weight_load(b_ptr, s_ptr, row_next, j_next, 1 < total, j0, kb, N, stride_bn, stride_sn, BLOCK_N,
                          BK2)
    row_next, j_next = _advance(row_next, j_next, kb, P, BLOCK_N, BK2)  # iteration i + 2's
    # The first weight loads are in flight while a's slice is staged.
    down = _stage_activation(a_ptr, a_raw, a_even, a_odd, M, k_lo, k_hi, stride_am, n_steps, BLOCK_K, KS_STEPS)
    # Undo the activation's row scale, the decode's 2^-6 unit and the global scale in one factor per row.
    row_factor = gl.expand_dims(gl.convert_layout(down, gl.SliceLayout(1, mma)), 1) * (gl.load(g_ptr) * DECODE_UNIT)
    c_rows = gl.arange(0, M_ROWS, layout=gl.SliceLayout(1, mma))
    c_base = c_ptr + gl.expand_dims(c_rows.to(gl.int64) * stride_cm, 1)
    if SPLIT_K > 1:
        c_base += split.to(gl.int64) * M * N
    # Low and high nibble products accumulate separately: two dependency chains of mma.sync instead of one.
    acc_lo = gl.zeros([M_ROWS, BLOCK_N], gl.float32, mma)
    acc_hi = gl.zeros([M_ROWS, BLOCK_N], gl.float32, mma)
    for i in range(0, total, 2):
        acc_lo, acc_hi = _step(acc_lo, acc_hi, wa, sa, a_even, a_odd, row, jst, kb, M, N, c_rows, c_base,
                               row_factor, stride_cn, BLOCK_N, BK2)
        row, jst = _advance(row, jst, kb, P, BLOCK_N, BK2)
        wa, sa = _weight_load(b_ptr, s_ptr, row_next, j_next, i + 2 < total, j0, kb, N, stride_bn, stride_sn,
                              BLOCK_N, BK2)
        row_next, j_next = _advance(row_next, j_next, kb, P, BLOCK_N, BK2)
        if i + 1 < total:
            acc_lo, acc_hi = _step(acc_lo, acc_hi, wb, sb, a_even, a_odd, row, jst, kb, M, N, c_rows, c_base,
                                   row_factor, stride_cn, BLOCK_N, BK2)
            row, jst = _advance(row, jst, kb, P, BLOCK_N, BK2)
        wb, sb = _weight_load(b_ptr, s_ptr, row_next, j_next, i + 3 < total, j0, kb, N, stride_bn, stride_sn,
                              BLOCK_N, BK2)
        row_next, j_next = _advance(row_next, j_next, kb, P, BLOCK_N, BK2)
