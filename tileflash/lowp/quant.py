"""NVFP4 quantize / dequantize (Triton kernels) and FP8 e4m3 helpers for KV caches (PyTorch).

Formats and rounding rules: tileflash/lowp/formats.py. Shapes:
  nvfp4_quantize:   x [..., K] fp32/fp16/bf16, K a positive multiple of 16
                    -> data [..., K/2] uint8, scales [..., K/16] float8_e4m3fn, global_scale float32 []
  nvfp4_dequantize: (data, scales, global_scale) -> float32 [..., K]
  fp8_quantize:     x [...] -> (x_fp8 float8_e4m3fn, scale float32 [1] or [H]); x ~= x_fp8 * scale
  fp8_quantize_qkv: q, k, v -> e4m3 q8, k8, v8 and FA3's descales [B, Hkv] (FP8 attention's inputs)
global_scale must be positive and finite; its value is not checked (that would synchronise with the device).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _utils
from ..launch.lowp import launch_nvfp4_dequantize, launch_nvfp4_quantize
from .formats import E4M3, NVFP4_BLOCK, e4m3_saturate, finite_amax, ieee_div, nvfp4_global_scale

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _new_bytes(shape, dtype, device) -> torch.Tensor:
    """An 8-bit output; poisoned with 0xFF under test (a NaN scale our kernels never write, and -6 codes)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.view(torch.uint8).fill_(0xFF).view(dtype) if _utils.POISON_OUTPUTS else t


def _nvfp4_quantize_impl(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    data = _new_bytes((*x.shape[:-1], k // 2), torch.uint8, x.device)
    scales = _new_bytes((*x.shape[:-1], k // NVFP4_BLOCK), E4M3.dtype, x.device)
    x2 = x.reshape(-1, k)
    if x2.shape[0] > 0:
        launch_nvfp4_quantize(x2, data, scales.view(torch.uint8), global_scale)
    return data, scales


_nvfp4_quantize_op = torch.library.custom_op("tileflash::nvfp4_quantize", mutates_args=())(_nvfp4_quantize_impl)


@_nvfp4_quantize_op.register_fake
def _(x, global_scale):
    k = x.shape[-1]
    return (x.new_empty((*x.shape[:-1], k // 2), dtype=torch.uint8),
            x.new_empty((*x.shape[:-1], k // NVFP4_BLOCK), dtype=E4M3.dtype))


def _nvfp4_dequantize_impl(data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    k = data.shape[-1] * 2
    out = _utils.new_output((*data.shape[:-1], k), torch.float32, data.device)
    d2, s2 = data.reshape(-1, k // 2), scales.view(torch.uint8).reshape(-1, k // NVFP4_BLOCK)
    if d2.shape[0] > 0:
        launch_nvfp4_dequantize(d2, s2, global_scale, out)
    return out


_nvfp4_dequantize_op = torch.library.custom_op("tileflash::nvfp4_dequantize",
                                               mutates_args=())(_nvfp4_dequantize_impl)


@_nvfp4_dequantize_op.register_fake
def _(data, scales, global_scale):
    return data.new_empty((*data.shape[:-1], data.shape[-1] * 2), dtype=torch.float32)


def check_global_scale(name: str, g, device) -> None:
    _utils.check_tensor(name, g, ndim=0, dtypes=(torch.float32,), device=device)


def check_nvfp4(data, scales, global_scale, names=("data", "scales", "global_scale")) -> None:
    """Checks a quantized tensor: data [..., K/2] uint8, scales [..., K/16] e4m3, global scale []."""
    d_name, s_name, g_name = names
    _utils.check_tensor(d_name, data, dtypes=(torch.uint8,))
    if data.dim() == 0 or data.shape[-1] == 0 or data.shape[-1] % (NVFP4_BLOCK // 2) != 0:
        raise ValueError(f"{d_name}: expected shape [..., K/2] with K a positive multiple of {NVFP4_BLOCK}, "
                         f"got {tuple(data.shape)}")
    _utils.check_tensor(s_name, scales, ndim=data.dim(), dtypes=(E4M3.dtype,), device=data.device)
    k = data.shape[-1] * 2
    expected = (*data.shape[:-1], k // NVFP4_BLOCK)
    if tuple(scales.shape) != expected:
        raise ValueError(f"{s_name}: expected shape {expected} (one scale per {NVFP4_BLOCK} elements of "
                         f"{d_name}'s K={k}), got {tuple(scales.shape)}")
    check_global_scale(g_name, global_scale, data.device)
    _utils.check_fp8_hardware(d_name, data)


def nvfp4_quantize(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None):
    """Quantize x [..., K] (fp32/fp16/bf16, K a positive multiple of 16) to NVFP4.

    Returns (data [..., K/2] uint8, scales [..., K/16] float8_e4m3fn, global_scale float32 []). global_scale
    defaults to amax(|x|) / (6 * 448) over the finite elements (1.0 when that is 0). Rounding, saturation, -0.0
    and NaN rules: tileflash/lowp/formats.py.
    """
    _utils.check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % NVFP4_BLOCK != 0:
        raise ValueError(f"x: last dimension K must be a positive multiple of {NVFP4_BLOCK} (one scale per "
                         f"{NVFP4_BLOCK} elements), got shape {tuple(x.shape)}")
    if global_scale is None:
        global_scale = nvfp4_global_scale(x)
    else:
        check_global_scale("global_scale", global_scale, x.device)
    data, scales = _utils.eager_or_op(_nvfp4_quantize_op, _nvfp4_quantize_impl)(x, global_scale)
    return data, scales, global_scale


def nvfp4_dequantize(data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 (data [..., K/2] uint8, scales [..., K/16] float8_e4m3fn, global_scale float32 []) -> float32
    [..., K] = e2m1 value * float(scale) * global_scale."""
    check_nvfp4(data, scales, global_scale)
    return _utils.eager_or_op(_nvfp4_dequantize_op, _nvfp4_dequantize_impl)(data, scales, global_scale)


def _head_dim(x: torch.Tensor, per_head_dim) -> Optional[int]:
    if per_head_dim is None:
        return None
    if not isinstance(per_head_dim, int) or not -x.dim() <= per_head_dim < x.dim():
        raise ValueError(f"per_head_dim: expected None or a dimension of x (rank {x.dim()}), got {per_head_dim!r}")
    return per_head_dim % x.dim()


def _scale_view(scale: torch.Tensor, ndim: int, dim: Optional[int]) -> torch.Tensor:
    """scale [1] or [H] shaped to broadcast against x (H along dim) without changing x's shape (a 0-dim x too)."""
    if dim is None:
        return scale.reshape(()) if ndim == 0 else scale
    return scale.reshape([-1 if i == dim else 1 for i in range(ndim)])


def _check_fp8_scale(scale, x: torch.Tensor, dim: Optional[int]) -> None:
    _utils.check_tensor("scale", scale, ndim=1, dtypes=(torch.float32,), device=x.device)
    expected = (1,) if dim is None else (x.shape[dim],)
    if tuple(scale.shape) != expected:
        where = "per tensor" if dim is None else f"one per head along dim {dim}"
        raise ValueError(f"scale: expected shape {expected} ({where}), got {tuple(scale.shape)}")


def fp8_quantize(x: torch.Tensor, scale: Optional[torch.Tensor] = None, per_head_dim: Optional[int] = None):
    """x (fp32/fp16/bf16) -> (x_fp8 float8_e4m3fn, scale float32) with x ~= float(x_fp8) * scale.

    per_head_dim None: one scale, shape [1]; an int: one scale per index of that dimension (KV heads of a
    [B, S, Hkv, D] cache: per_head_dim=-2), shape [H]. The default scale is amax(|x|) / 448 over the finite
    elements (of the tensor or of each head), 1.0 where that is 0. x / scale is rounded to nearest even; magnitudes
    above 448 and +-inf saturate to +-448; NaN stays NaN (e4m3fn 0x7F); -0.0 stays -0.0.
    """
    _utils.check_tensor("x", x, dtypes=FLOAT_DTYPES)
    dim = _head_dim(x, per_head_dim)
    if scale is None:
        amax = finite_amax(x) if dim is None else finite_amax(x, tuple(i for i in range(x.dim()) if i != dim))
        scale = _fp8_descale(amax.reshape(-1))
    else:
        _check_fp8_scale(scale, x, dim)
    return e4m3_saturate(x.float() / _scale_view(scale, x.dim(), dim)), scale


def fp8_dequantize(x_fp8: torch.Tensor, scale: torch.Tensor, per_head_dim: Optional[int] = None) -> torch.Tensor:
    """Inverse of fp8_quantize: float(x_fp8) * scale (scale [1], or [H] along per_head_dim), float32."""
    _utils.check_tensor("x_fp8", x_fp8, dtypes=(E4M3.dtype,))
    dim = _head_dim(x_fp8, per_head_dim)
    _check_fp8_scale(scale, x_fp8, dim)
    return x_fp8.float() * _scale_view(scale, x_fp8.dim(), dim)


def _quantize_groups(x: torch.Tensor, hkv: int, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, descale fp32 [B, Hkv]) with one descale per (sequence, KV head). x [B, S, H, D], or packed
    [total, H, D] with cu_seqlens [B + 1] (tokens past cu_seqlens[-1] belong to no sequence and take 1);
    H = Hkv * group."""
    if cu_seqlens is None:
        b, s, h, d = x.shape
        groups = x.reshape(b, s, hkv, h // hkv, d)
        descale = _fp8_descale(finite_amax(groups, (1, 3, 4)))
        return e4m3_saturate(groups.float() / descale[:, None, :, None, None]).reshape(x.shape), descale
    total, h, d = x.shape
    groups = x.reshape(total, hkv, h // hkv, d)
    num_seqs = cu_seqlens.shape[0] - 1
    seq = torch.searchsorted(cu_seqlens[1:], torch.arange(total, device=x.device, dtype=cu_seqlens.dtype),
                             right=True).long()  # each token's sequence; num_seqs past the end
    amax = x.new_zeros(num_seqs + 1, hkv, dtype=torch.float32)
    amax.scatter_reduce_(0, seq[:, None].expand(total, hkv), finite_amax(groups, (2, 3)), "amax")
    descale = _fp8_descale(amax)
    descale[num_seqs] = 1.0  # the tokens of no sequence
    return e4m3_saturate(groups.float() / descale[seq][:, :, None, None]).reshape(x.shape), descale[:num_seqs]


def _fp8_descale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, or 1 where amax is 0."""
    descale = ieee_div(amax, E4M3.max)
    return torch.where(descale > 0, descale, 1.0)

def fp8_quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
                     cu_seqlens_k: Optional[torch.Tensor] = None):
    """q, k, v (fp32/fp16/bf16) -> (q8, k8, v8, q_descale, k_descale, v_descale): FP8 attention's inputs for
    flash_attn_func / flash_attn_varlen_func. x8 float8_e4m3fn of x's shape with x ~= float(x8) * descale; the
    descales fp32 [B, Hkv], one per (sequence, KV head): amax(|x|) / 448 over that sequence's tokens and that head's
    elements (for q: the KV head's group of query heads), 1 where that is 0; rounding and saturation as
    fp8_quantize's.
    Padded batches: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]. Packed sequences: q [total_q, Hq, D], k/v
    [total_k, Hkv, D] with cu_seqlens_q / cu_seqlens_k [B + 1] int32 (both). For paged KV pools, quantize the
    pools with fp8_quantize(..., per_head_dim=-2) and pass its [Hkv] scales expanded to [B, Hkv]."""
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    ndim = 3 if packed else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        _utils.check_tensor(name, t, ndim=ndim, dtypes=FLOAT_DTYPES, device=q.device)
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or q.shape[-2] % max(k.shape[-2], 1) or k.shape[-2] == 0:
        raise ValueError(f"q, k, v: expected k and v of one shape, q's head dim and a KV head count that divides "
                         f"q's heads, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if packed:
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            _utils.check_int32(name, t, 1, q.device)
            if t.shape[0] < 1:
                raise ValueError(f"{name}: expected batch + 1 offsets, got shape {tuple(t.shape)}")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.shape[0]} elements (cu_seqlens_q's), got "
                             f"{cu_seqlens_k.shape[0]}")
    elif k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (q's), got {k.shape[0]}")
    hkv = k.shape[-2]
    (q8, qd), (k8, kd), (v8, vd) = (_quantize_groups(x, hkv, cu) for x, cu in
                                    ((q, cu_seqlens_q), (k, cu_seqlens_k), (v, cu_seqlens_k)))
    return q8, k8, v8, qd, kd, vd
