"""nvfp4_matmul: a @ dequant(b)^T with an NVFP4 weight b (the blockscaled GEMM). Kernels: on sm_90 decode-sized
M (<= 16) takes the register-operand Gluon kernel (tileflash/kernels/gemm_nvfp4_mma.py), everything else the
Triton kernel (tileflash/kernels/gemm_blockscaled.py), which also runs in the CPU interpreter.

Shapes: a [M, K] fp16/bf16, b_data [N, K/2] uint8, b_scales [N, K/16] float8_e4m3fn, b_global_scale float32 [];
out [M, N] in a's dtype. K must be a positive multiple of 16 (the scale block); no other alignment is required.
"""
from __future__ import annotations

import torch

from .. import _utils
from ..heuristics import gemm_config, gemm_mma_config
from ..kernels.gemm_blockscaled import nvfp4_matmul_kernel
from ..kernels.gemm_nvfp4_mma import nvfp4_matmul_mma_kernel
from ._launch import sm90_target
from .quant import check_nvfp4


def _nvfp4_matmul_impl(a: torch.Tensor, b_data: torch.Tensor, b_scales: torch.Tensor,
                       b_global_scale: torch.Tensor) -> torch.Tensor:
    (m, k), n = a.shape, b_data.shape[0]
    if m == 0 or n == 0:
        return a.new_empty((m, n))
    if sm90_target():
        mma_cfg = gemm_mma_config(m, n, k, num_sms=_utils.num_sms(a.device))
        if mma_cfg is not None and _mma_operands_ok(a, b_data, b_scales):
            return _launch_mma(a, b_data, b_scales.view(torch.uint8), b_global_scale, mma_cfg)
    cfg = gemm_config(m, n, k, interpret=_utils.is_interpreter(), num_sms=_utils.num_sms(a.device))
    k_per_split, split, dest = _k_slices(a, n, cfg.block_k, cfg.split_k)
    s_bits = b_scales.view(torch.uint8)
    grid = (_utils.cdiv(m, cfg.block_m), _utils.cdiv(n, cfg.block_n), split)
    nvfp4_matmul_kernel[grid](
        a, b_data, s_bits, b_global_scale, dest, m, n, k, k_per_split,
        a.stride(0), a.stride(1), b_data.stride(0), b_data.stride(1), s_bits.stride(0), s_bits.stride(1),
        dest.stride(-2), dest.stride(-1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, UPCAST=_utils.upcast_tiles(),
        SCALE_WORDS=k % 64 == 0 and cfg.block_k % 64 == 0 and s_bits.stride(1) == 1 and _utils.words_aligned(s_bits, 1),
        SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return _summed(dest, a.dtype)


def _k_slices(a, n: int, block_k: int, split_k: int):
    """(values per K slice, slices, destination) of both kernels: at most split_k slices of whole block_k steps,
    none empty; one slice writes the output [M, N] in a's dtype, more write fp32 partials [slices, M, N]."""
    m, k = a.shape
    k_steps = _utils.cdiv(k, block_k)
    k_per_split = _utils.cdiv(k_steps, min(split_k, k_steps)) * block_k
    split = _utils.cdiv(k, k_per_split)  # no empty slice
    dest = (_utils.new_output((m, n), a.dtype, a.device) if split == 1
            else torch.empty((split, m, n), dtype=torch.float32, device=a.device))
    return k_per_split, split, dest


def _summed(dest: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output from _k_slices' destination: fp32 partials summed by torch in slice order (bitwise
    reproducible; two small kernels with C++ launch costs, less host time than a second Triton launch)."""
    return dest if dest.dim() == 2 else dest.sum(0).to(dtype)


def _mma_operands_ok(a, b_data, b_scales) -> bool:
    """What the register-operand kernel assumes of the tensors: K a multiple of 32 with contiguous, 16-byte
    aligned rows of a and b_data (its copies and loads move 16 bytes at a time) and unit-stride scale rows."""
    return (a.shape[1] % 32 == 0 and a.stride(1) == 1 and b_data.stride(1) == 1 and b_scales.stride(1) == 1
            and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (a, b_data)))


def _launch_mma(a, b_data, s_bits, b_global_scale, cfg) -> torch.Tensor:
    """The register-operand kernel for M <= 16 (kernels/gemm_nvfp4_mma.py, sm_90), K sliced as in the Triton
    path."""
    (m, k), n = a.shape, b_data.shape[0]
    k_per_split, split, dest = _k_slices(a, n, cfg.block_k, cfg.split_k)
    nvfp4_matmul_mma_kernel[(cfg.programs_n, split)](
        a, b_data, s_bits, b_global_scale, dest, m, n, k, k_per_split, k_per_split // 2,
        a.stride(0), b_data.stride(0), s_bits.stride(0), dest.stride(-2), dest.stride(-1), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, KS_STEPS=k_per_split // cfg.block_k, SPLIT_K=split, num_warps=4)
    return _summed(dest, a.dtype)


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
    _utils.check_tensor("a", a, ndim=2, dtypes=_utils.SUPPORTED_DTYPES)
    if a.shape[1] == 0 or a.shape[1] % 16 != 0:
        raise ValueError(f"a: K (dimension 1) must be a positive multiple of 16 (the NVFP4 scale block), "
                         f"got shape {tuple(a.shape)}")
    _utils.check_tensor("b_data", b_data, ndim=2, dtypes=(torch.uint8,), device=a.device)
    if b_data.shape[1] * 2 != a.shape[1]:
        raise ValueError(f"b_data: expected shape (N, {a.shape[1] // 2}) (K/2 with a's K={a.shape[1]}), "
                         f"got {tuple(b_data.shape)}")
    check_nvfp4(b_data, b_scales, b_global_scale, names=("b_data", "b_scales", "b_global_scale"))
    return _utils.eager_or_op(_nvfp4_matmul_op, _nvfp4_matmul_impl)(a, b_data, b_scales, b_global_scale)
