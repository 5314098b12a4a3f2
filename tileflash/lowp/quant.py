"""NVFP4 quantize / dequantize (Triton kernels) and FP8 e4m3 helpers for KV caches (PyTorch).

Formats and rounding rules: tileflash/lowp/formats.py. Shapes:
  nvfp4_quantize:   x [..., K] fp32/fp16/bf16, K a positive multiple of 16
                    -> data [..., K/2] uint8, scales [..., K/16] float8_e4m3fn, global_scale float32 []
  nvfp4_dequantize: (data, scales, global_scale) -> float32 [..., K]
  fp8_quantize:     x [...] -> (x_fp8 float8_e4m3fn, scale float32 [1] or [H]); x ~= x_fp8 * scale
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
        scale = ieee_div(amax.reshape(-1), E4M3.max)
        scale = torch.where(scale > 0, scale, 1.0)
    else:
        _check_fp8_scale(scale, x, dim)
    return e4m3_saturate(x.float() / _scale_view(scale, x.dim(), dim)), scale


def fp8_dequantize(x_fp8: torch.Tensor, scale: torch.Tensor, per_head_dim: Optional[int] = None) -> torch.Tensor:
    """Inverse of fp8_quantize: float(x_fp8) * scale (scale [1], or [H] along per_head_dim), float32."""
    _utils.check_tensor("x_fp8", x_fp8, dtypes=(E4M3.dtype,))
    dim = _head_dim(x_fp8, per_head_dim)
    _check_fp8_scale(scale, x_fp8, dim)
    return x_fp8.float() * _scale_view(scale, x_fp8.dim(), dim)
