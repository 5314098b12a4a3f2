"""nvfp4_matmul: a @ dequant(b)^T with an NVFP4 weight b (the blockscaled GEMM). Kernels: on sm_90 decode-sized
M (<= 16) takes the register-operand Gluon kernel (tileflash/lowp/kernels/gemm_mma.py), everything else the
Triton kernel (tileflash/lowp/kernels/gemm_dequant.py), which also runs in the CPU interpreter.

Shapes: a [M, K] fp16/bf16, b_data [N, K/2] uint8, b_scales [N, K/16] float8_e4m3fn, b_global_scale float32 [];
out [M, N] in a's dtype. K must be a positive multiple of 16 (the scale block); no other alignment is required.
"""
from __future__ import annotations

import torch

from .. import _utils
from ..launch import direct
from ..launch.lowp import GemmPlan
from .quant import check_nvfp4


_PLANS = direct.PlanCache()


def _gemm_key(a, b_data, b_scales, b_global_scale):
    return tuple(direct.tensor_key(t) for t in (a, b_data, b_scales, b_global_scale))


def _nvfp4_matmul_impl(a: torch.Tensor, b_data: torch.Tensor, b_scales: torch.Tensor,
                       b_global_scale: torch.Tensor) -> torch.Tensor:
    plan = direct.plan_for(_PLANS, lambda: _gemm_key(a, b_data, b_scales, b_global_scale),
                           lambda: GemmPlan(a, b_data, b_scales))
    return plan.run(a, b_data, b_scales, b_global_scale)


_nvfp4_matmul_op = torch.library.custom_op("tileflash::nvfp4_matmul", mutates_args=())(_nvfp4_matmul_impl)


@_nvfp4_matmul_op.register_fake
def _(a, b_data, b_scales, b_global_scale):
    return a.new_empty((a.shape[0], b_data.shape[0]))


def nvfp4_matmul(a: torch.Tensor, b_data: torch.Tensor, b_scales: torch.Tensor,
                 b_global_scale: torch.Tensor) -> torch.Tensor:
    """a [M, K] (fp16/bf16) @ dequant(b)^T -> [M, N] in a's dtype, fp32 accumulation.

    b is an NVFP4 [N, K] matrix as returned by nvfp4_quantize: b_data [N, K/2] uint8, b_scales [N, K/16]
    float8_e4m3fn, b_global_scale float32 []. K must be a positive multiple of 16.
    """
    if torch.compiler.is_compiling():
        _check_matmul(a, b_data, b_scales, b_global_scale)
        return _nvfp4_matmul_op(a, b_data, b_scales, b_global_scale)
    plan = direct.plan_for(_PLANS, lambda: _gemm_key(a, b_data, b_scales, b_global_scale),
                           lambda: _check_matmul(a, b_data, b_scales, b_global_scale) or GemmPlan(a, b_data, b_scales))
    return plan.run(a, b_data, b_scales, b_global_scale)


def _check_matmul(a, b_data, b_scales, b_global_scale) -> None:
    _utils.check_tensor("a", a, ndim=2, dtypes=_utils.SUPPORTED_DTYPES)
    if a.shape[1] == 0 or a.shape[1] % 16 != 0:
        raise ValueError(f"a: K (dimension 1) must be a positive multiple of 16 (the NVFP4 scale block), "
                         f"got shape {tuple(a.shape)}")
    _utils.check_tensor("b_data", b_data, ndim=2, dtypes=(torch.uint8,), device=a.device)
    if b_data.shape[1] * 2 != a.shape[1]:
        raise ValueError(f"b_data: expected shape (N, {a.shape[1] // 2}) (K/2 with a's K={a.shape[1]}), "
                         f"got {tuple(b_data.shape)}")
    check_nvfp4(b_data, b_scales, b_global_scale, names=("b_data", "b_scales", "b_global_scale"))
