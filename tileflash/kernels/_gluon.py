"""Helpers shared by the Gluon kernels (attn_fwd_ws.py, attn_bwd_ws.py)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def opaque_zero(x):
    """0, from an instruction with side effects, so the compiler neither folds it nor moves it out of x's loop."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def packed_sequence(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN: gl.constexpr):
    """(batch coordinate of the descriptors, first query row, query rows, first key, keys) of sequence b: with
    VARLEN the packed rows [cu_seqlens[b], cu_seqlens[b + 1]) of [1, total, H, D] tensors (seqlen_q/k: the packed
    row counts; entries past them, a caller's error, are clamped to them as in _masks.seq_extents, so no store
    leaves the tensors), else all of batch b."""
    if VARLEN:
        q0 = gl.minimum(gl.load(cu_seqlens_q + b), seqlen_q)
        k0 = gl.minimum(gl.load(cu_seqlens_k + b), seqlen_k)
        q1 = gl.minimum(gl.load(cu_seqlens_q + b + 1), seqlen_q)
        k1 = gl.minimum(gl.load(cu_seqlens_k + b + 1), seqlen_k)
        return b * 0, q0, q1 - q0, k0, k1 - k0
    return b, b * 0, seqlen_q, b * 0, seqlen_k
