"""nvfp4_matmul: a @ dequant(b)^T with an NVFP4 weight b (the blockscaled GEMM), a either 16-bit (W4A16) or NVFP4
(W4A4, both operands from nvfp4_quantize). Kernels: W4A16 on sm_90 takes the wgmma Gluon kernel up to M = 1024
with K a multiple of 256 (tileflash/lowp/kernels/gemm_wgmma.py) and the register-operand Gluon kernel for the
other decode-sized calls (M <= 16, K a multiple of 32, gemm_mma.py). W4A16 above those rows (above 256 where the
wgmma kernel does not apply) decodes the weight into a's dtype (global scale folded in, rounded once; in chunks of
64 MiB of kept workspace, 128 rows at least) and multiplies it with cuBLAS (plan.gemm.gemm_decoded_config; its
accumulation follows torch's allow_bf16/fp16_reduced_precision_reduction settings). W4A4 on Blackwell (sm_100,
sm_120) feeds the codes and scales to the native block-scaled MMA; elsewhere above 256 rows it takes the same
route (a decoded whole into out_dtype too, in a buffer of the call). Everything else runs the Triton kernel
(tileflash/lowp/kernels/gemm_dequant.py), which also runs in the CPU interpreter and decodes W4A4's operands per
tile.

Shapes: a [M, K] fp16/bf16 or a [M, K/2] uint8 with a_scales [M, K/16] float8_e4m3fn and a_global_scale float32
[]; b_data [N, K/2] uint8, b_scales [N, K/16] float8_e4m3fn, b_global_scale float32 []; out [M, N] in a's dtype
(W4A16) or out_dtype (W4A4, bf16 by default). K must be a positive multiple of 16 (the scale block); no other
alignment is required.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _utils
from ..launch import direct
from ..launch.lowp import GemmPlan
from .quant import check_nvfp4


_PLANS = direct.PlanCache()


def _gemm_key(a, b_data, b_scales, b_global_scale, a_scales, a_global_scale, out_dtype):
    tensors = (a, b_data, b_scales, b_global_scale, a_scales, a_global_scale)
    return (*(direct.tensor_key(t) for t in tensors), out_dtype)


def _nvfp4_matmul_impl(a: torch.Tensor, b_data: torch.Tensor, b_scales: torch.Tensor, b_global_scale: torch.Tensor,
                       a_scales: Optional[torch.Tensor] = None, a_global_scale: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    args = (a, b_data, b_scales, b_global_scale, a_scales, a_global_scale)
    plan = direct.plan_for(_PLANS, lambda: _gemm_key(*args, out_dtype),
                           lambda: GemmPlan(a, b_data, b_scales, a_scales, _out_dtype(a, out_dtype)))
    return plan.run(*args)


_nvfp4_matmul_op = torch.library.custom_op("tileflash::nvfp4_matmul", mutates_args=())(_nvfp4_matmul_impl)


@_nvfp4_matmul_op.register_fake
def _(a, b_data, b_scales, b_global_scale, a_scales=None, a_global_scale=None, out_dtype=None):
    return a.new_empty((a.shape[0], b_data.shape[0]), dtype=_out_dtype(a, out_dtype))


def _out_dtype(a: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    return out_dtype or (torch.bfloat16 if a.dtype == torch.uint8 else a.dtype)


def nvfp4_matmul(a: torch.Tensor, b_data: torch.Tensor, b_scales: torch.Tensor, b_global_scale: torch.Tensor,
                 a_scales: Optional[torch.Tensor] = None, a_global_scale: Optional[torch.Tensor] = None,
                 out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """a @ dequant(b)^T -> [M, N], fp32 accumulation.

    b is an NVFP4 [N, K] matrix as returned by nvfp4_quantize: b_data [N, K/2] uint8, b_scales [N, K/16]
    float8_e4m3fn, b_global_scale float32 []. K must be a positive multiple of 16.
    a is either [M, K] fp16/bf16 (W4A16: out in a's dtype; a_scales, a_global_scale and out_dtype stay None) or
    NVFP4 too (W4A4): a = the data [M, K/2] uint8 of nvfp4_quantize, with its a_scales [M, K/16] and
    a_global_scale; out in out_dtype (bf16 by default, or fp16). W4A4 is the product of the two dequantized
    matrices; on Blackwell it runs on the tensor cores' native block-scaled MMA.
    """
    args = (a, b_data, b_scales, b_global_scale, a_scales, a_global_scale)
    if torch.compiler.is_compiling():
        _check_matmul(*args, out_dtype)
        return _nvfp4_matmul_op(*args, out_dtype)
    plan = direct.plan_for(_PLANS, lambda: _gemm_key(*args, out_dtype),
                           lambda: _check_matmul(*args, out_dtype)
                           or GemmPlan(a, b_data, b_scales, a_scales, _out_dtype(a, out_dtype)))
    return plan.run(*args)


def _check_matmul(a, b_data, b_scales, b_global_scale, a_scales, a_global_scale, out_dtype) -> None:
    if isinstance(a, torch.Tensor) and a.dtype == torch.uint8:  # W4A4
        if a_scales is None or a_global_scale is None:
            raise ValueError("a: an NVFP4 a (uint8 codes) needs a_scales and a_global_scale (from nvfp4_quantize)")
        _utils.check_tensor("a", a, ndim=2, dtypes=(torch.uint8,))
        check_nvfp4(a, a_scales, a_global_scale, names=("a", "a_scales", "a_global_scale"))
        k = a.shape[1] * 2
        if out_dtype not in (None, *_utils.SUPPORTED_DTYPES):
            raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float16, got {out_dtype}")
    else:
        _utils.check_tensor("a", a, ndim=2, dtypes=_utils.SUPPORTED_DTYPES)
        k = a.shape[1]
        if a_scales is not None or a_global_scale is not None:
            raise ValueError(f"a_scales / a_global_scale: only for an NVFP4 a (uint8 codes), a is {a.dtype}")
        if out_dtype not in (None, a.dtype):
            raise ValueError(f"out_dtype: a 16-bit a gives out in a's dtype ({a.dtype}), got {out_dtype}")
        if k == 0 or k % 16 != 0:
            raise ValueError(f"a: K (dimension 1) must be a positive multiple of 16 (the NVFP4 scale block), "
                             f"got shape {tuple(a.shape)}")
    _utils.check_tensor("b_data", b_data, ndim=2, dtypes=(torch.uint8,), device=a.device)
    if b_data.shape[1] * 2 != k:
        raise ValueError(f"b_data: expected shape (N, {k // 2}) (K/2 with a's K={k}), got {tuple(b_data.shape)}")
    check_nvfp4(b_data, b_scales, b_global_scale, names=("b_data", "b_scales", "b_global_scale"))
