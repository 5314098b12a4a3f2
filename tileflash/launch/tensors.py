"""Tensors as kernel arguments: dummies for unused pointers, byte views, TMA descriptors (Triton's and Gluon's) and
the layout rules they need. No input checking here (the public functions check first)."""
from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _utils
from . import direct
from ..kernels.triton.cast import sum_cast_kernel, values_t_kernel
from ..plan.target import padded_head_dim, tma_aligned


@functools.lru_cache(maxsize=None)
def unused_pointer(device) -> torch.Tensor:
    """The stand-in for pointer arguments a launch does not use (never read or written): one per device, since an
    allocation per launch is a measurable part of an eager decode call's host time."""
    return direct.constant(torch.empty(1, dtype=torch.int32, device=device))


@functools.lru_cache(maxsize=None)
def unit_scale(device) -> torch.Tensor:
    """fp32 1.0, one per device: an absent FP8 descale (read with strides 0)."""
    return direct.constant(torch.ones(1, dtype=torch.float32, device=device))


def scale_strides(scale, batch_stride: bool) -> tuple[int, int]:
    """(batch, head) strides of a scale: FP8 attention's descales [B, Hkv] (batch_stride), a cache's [1] or
    [Hkv] scales or FA3's per-sequence [B, Hkv] ones, or an absent one (unit_scale): 0 along any dim of size 1, so
    [1] serves every head."""
    if scale is None:
        return 0, 0
    if batch_stride or scale.dim() == 2:
        return tuple(st if n > 1 else 0 for n, st in zip(scale.shape, scale.stride()))
    return 0, scale.stride(0) if scale.numel() > 1 else 0


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bytes (FP8 / e4m3 tensors are read and written as uint8 bit patterns)."""
    return direct.derived(t.view(torch.uint8), t)


def strides3(t: torch.Tensor, batch_stride0: bool = False) -> tuple[int, int, int]:
    """The first three strides, the batch's as 0 where one tensor is shared by every batch (varlen)."""
    s = t.stride()
    return (0 if batch_stride0 else s[0]), s[1], s[2]


def row_descriptors(tensors, rows: int, block_rows: int):
    """TMA descriptors over [B, S, H, D] tensors viewed as [rows, H, D] (batch and sequence merged), blocks of
    block_rows rows of one head, or None when the layout does not allow it: merged dims need stride(0) == S *
    stride(1), and TMA needs 16-byte aligned bases and strides. Only for head dims that are powers of two, so a
    tile never reaches past D, and for at least one row (a descriptor's dims must be positive; an empty tensor,
    e.g. Sk = 0, takes the pointer path). The forward reads K/V through them (paged: a pool [pages, page_size, ...]
    viewed as pages x page_size rows), the backward Q/dO."""
    if not 0 < rows < 2 ** 31:  # TMA coordinates are int32
        return None
    descs = []
    for t in tensors:
        d = t.shape[3]
        if d != padded_head_dim(d, t.element_size() == 1) or d > 256:  # a box spans <= 256 elements per dim
            return None
        mergeable = t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)
        if not (mergeable and tma_aligned(t, dims=(1, 2))):
            return None
        desc = TensorDescriptor(t, [rows, t.shape[2], d], [t.stride(1), t.stride(2), 1], [block_rows, 1, d])
        descs.append(direct.derived(desc, t))
    return descs


def values_t_width(rows: int, seqs: int, gap: int) -> int:
    """Columns of FP8 attention's V^T for `rows` key rows in `seqs` sequences: where one more sequence would start."""
    return values_t_column(rows, seqs, gap)


def values_t_column(start: int, seq: int, gap: int) -> int:
    """V^T's column of the first key of sequence `seq`, whose first key is row `start` of the merged rows (batch b of
    [B, S, ..] starts at b * S; packed sequences at cu_seqlens_k): 16-byte aligned, so that a TMA descriptor reads
    every sequence (by pointers the Triton forward spilled and ran 3-6x slower, run 169), with at least gap - 15
    zero columns after each sequence (gap: plan/prefill.values_t_gap's VALUES_T_GAP, or VALUES_T_WIDE_GAP, which
    zero-fills each sequence's last key block). kernels/triton/cast.values_t_kernel writes it, kernels/triton/
    attn_fwd.py reads it."""
    return _utils.cdiv(start, 16) * 16 + gap * seq


def launch_values_t(v4: torch.Tensor, vt: torch.Tensor, cu_seqlens_k: torch.Tensor | None, gap: int) -> None:
    """FP8 attention's V^T: v4 [B, S, Hkv, D] (or packed [1, total, Hkv, D] with cu_seqlens_k [B + 1] int32) into vt
    [Hkv, D, values_t_width(.., gap)] (any contents: every column is written, tokens or zeros), the K-major layout
    FP8 tensor cores read P V's second operand in."""
    b, s, h, d = v4.shape
    seqs = b if cu_seqlens_k is None else cu_seqlens_k.shape[0] - 1
    if seqs == 0:
        return
    parts = max(1, min(_utils.cdiv(b * s // seqs, VALUES_T_BLOCK), 64))  # programs per sequence and head
    src, dst = direct.derived(v4.view(torch.uint8), v4), direct.derived(vt.view(torch.uint8), vt)
    direct.launch(values_t_kernel, (seqs, parts, h), src, dst,
                  cu_seqlens_k if cu_seqlens_k is not None else unused_pointer(v4.device), s, v4.stride(0),
                  v4.stride(1), v4.stride(2), vt.stride(0), vt.stride(1), HEAD_DIM=d, HEAD_DIM_PAD=_utils.next_pow2(d),
                  BLOCK_T=VALUES_T_BLOCK, VARLEN=cu_seqlens_k is not None, GAP=gap, num_warps=4)


VALUES_T_BLOCK = 64  # tokens per program step of values_t_kernel (a copy: not tuned)


def values_t_descriptor(vt: torch.Tensor, tokens: int, block_n: int):
    """A TMA descriptor over V^T [Hkv, D, tokens] (launch_values_t; columns past `tokens` read as zeros), boxes
    [1, D, block_n]; None unless D is a power of two (a box never reaches into the next head) and tokens > 0."""
    h, d, _ = vt.shape
    if not 0 < tokens < 2 ** 31 or d != padded_head_dim(d, True) or d > 256:
        return None
    return direct.derived(TensorDescriptor(vt, [h, d, tokens], [vt.stride(0), vt.stride(1), 1], [1, d, block_n]), vt)


def alibi_args(alibi_slopes, dummy) -> tuple:
    """(slopes, batch stride) for a kernel's alibi_ptr, stride_alibi_b: [Hq] slopes are every batch's (stride 0);
    without ALiBi the dummy, never read."""
    if alibi_slopes is None:
        return dummy, 0
    return alibi_slopes, alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0


def dropout_args(rng, dropout_p: float, dummy) -> tuple:
    """(seed pointer, threshold, scale) for a kernel's rng_ptr, dropout_thr, dropout_scale (kernels/triton/dropout.py):
    rng the call's int64 seed tensor; without dropout (rng None) stand-ins, never read."""
    if rng is None:
        return dummy, 0, 1.0
    return rng, int(dropout_p * 2 ** 16), 1.0 / (1.0 - dropout_p)


def rotary_args(rotary_cos, rotary_sin, dummy) -> tuple:
    """(cos, sin, row stride, rows) of a rotary table, or stand-ins without one."""
    if rotary_cos is None:
        return dummy, dummy, 0, 1
    return rotary_cos, rotary_sin, rotary_cos.stride(0), rotary_cos.shape[0]


_GLUON_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                 torch.float8_e4m3fn: "float8e4nv"}


def desc_4d(t: torch.Tensor, block_rows: int, block_cols: int | None = None):
    """A Gluon TMA descriptor over [B, S, H, D] with blocks [1, block_rows, 1, block_cols (default D)]."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    block = [1, block_rows, 1, block_cols or t.shape[3]]
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, _GLUON_DTYPES[t.dtype]))
    return direct.derived(GluonDescriptor(t, list(t.shape), list(t.stride()), block, layout), t)


def values_t_gluon_desc(vt: torch.Tensor, block_n: int):
    """A Gluon TMA descriptor over FP8 attention's V^T [Hkv, D, width] (launch_values_t), blocks [1, D, block_n]:
    the Gluon forward's K-major V operand."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    block = [1, vt.shape[1], block_n]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return direct.derived(GluonDescriptor(vt, list(vt.shape), list(vt.stride()), block, layout), vt)


def gluon_desc(t: torch.Tensor, block: list, swizzled: bool = False):
    """A Gluon TMA descriptor over a 2D tensor with unit-stride rows, blocks `block`: in the default swizzled
    layout (an MMA operand), or unswizzled row-major (tiles that registers read in layouts of their own)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    bits = t.element_size() * 8
    dtype = getattr(gl, _GLUON_DTYPES[t.dtype]) if t.dtype in _GLUON_DTYPES else None
    layout = (gl.NVMMASharedLayout.get_default_for(block, dtype) if swizzled
              else gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=2))
    return direct.derived(GluonDescriptor(t, list(t.shape), list(t.stride()), block, layout), t)


def rows_desc(t, block_rows: int, block_cols: int, layout_rows: int):
    """A Gluon TMA descriptor over a cache [B or pages, S or page, 1, D] as rows [B * S, D], blocks [block_rows,
    block_cols], in the shared layout of [layout_rows, block_cols] tiles (the stage buffers it fills)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    dtype = getattr(gl, _GLUON_DTYPES[t.dtype])
    layout = gl.NVMMASharedLayout.get_default_for([layout_rows, block_cols], dtype)
    rows = t.shape[0] * t.shape[1]
    return direct.derived(GluonDescriptor(t, [rows, t.shape[3]], [t.stride(1), 1], [block_rows, block_cols], layout),
                          t)


SUM_CAST_BLOCK = 1024  # elements per program of sum_cast_kernel (an elementwise pass: not tuned)


def launch_sum_cast(src: torch.Tensor, dst: torch.Tensor, slices: int, scale: float = 1.0) -> None:
    """dst (contiguous, any float dtype) = scale * the sum of src's `slices` contiguous fp32 slices of dst's numel,
    in slice order (kernels/triton/cast.py)."""
    numel = dst.numel()
    direct.launch(sum_cast_kernel, (_utils.cdiv(numel, SUM_CAST_BLOCK),), src, dst, numel, slices, numel, scale,
                  BLOCK=SUM_CAST_BLOCK, INTERPRETED=_utils.is_interpreter(), num_warps=4)
