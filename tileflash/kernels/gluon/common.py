"""Helpers shared by the Gluon kernels (attn_fwd.py, attn_bwd.py, decode_mma.py, lowp/kernels/gemm_mma.py). A
@gluon.jit function cannot call a @triton.jit one, so a few helpers also exist in Triton form (kernels/triton):
fp16_row_scale is attn_fwd._fp16_range, decode_mma._tanh is inner.tanh, packed_sequence is masks.seq_extents.
Constants (LOG2E) are shared: kernels/triton/masks.py."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

DECODE_UNIT = gl.constexpr(64.0)  # decoded NVFP4 values are e2m1 * scale / 2^6 (register-operand kernels)

# A barrier among the threads of one partition (all of a kernel's warps without warp specialisation): triton 3.6
# names it thread_barrier.
barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def grid_dependency_wait(x):
    """griddepcontrol.wait: launched as a programmatic dependent (PDL), block until the grid before this one has
    finished and its writes are visible; a no-op otherwise. x: any value (inline asm takes a tensor)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def allow_dependents(x):
    """griddepcontrol.launch_dependents: a kernel launched after this one as a programmatic dependent may start its
    programs once every program here has begun (they wait in griddepcontrol.wait). x: any value, as above."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def opaque_zero(x):
    """0, from an instruction with side effects, so the compiler neither folds it nor moves it out of x's loop."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def packed_sequence(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN: gl.constexpr):
    """(batch coordinate of the descriptors, first query row, query rows, first key, keys) of sequence b: with
    VARLEN the packed rows [cu_seqlens[b], cu_seqlens[b + 1]) of [1, total, H, D] tensors (seqlen_q/k: the packed
    row counts; entries past them, a caller's error, are clamped to them as in masks.seq_extents, so no store
    leaves the tensors), else all of batch b."""
    if VARLEN:
        q0 = gl.minimum(gl.load(cu_seqlens_q + b), seqlen_q)
        k0 = gl.minimum(gl.load(cu_seqlens_k + b), seqlen_k)
        q1 = gl.minimum(gl.load(cu_seqlens_q + b + 1), seqlen_q)
        k1 = gl.minimum(gl.load(cu_seqlens_k + b + 1), seqlen_k)
        return b * 0, q0, q1 - q0, k0, k1 - k0
    return b, b * 0, seqlen_q, b * 0, seqlen_k


@gluon.jit
def fp16_row_scale(amax):
    """(2^k, 2^-k) per row with k putting the largest finite |value| in [2^8, 2^9) (k = 0 for an all-zero row)."""
    e = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
    k = gl.where(e == 0, 0, gl.minimum(gl.maximum(135 - e, -126), 126))
    return ((127 + k) << 23).to(gl.float32, bitcast=True), ((127 - k) << 23).to(gl.float32, bitcast=True)
