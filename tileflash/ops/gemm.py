"""nvfp4_matmul: a @ dequant(b)^T with an NVFP4 weight b (the blockscaled GEMM). Kernels: on sm_90 decode-sized
M (<= 16) takes the register-operand Gluon kernel (tileflash/kernels/gemm_nvfp4_mma.py), everything else the
Triton kernel (tileflash/kernels/gemm_blockscaled.py), which also runs in the CPU interpreter.

Shapes: a [M, K] fp16/bf16, b_data [N, K/2] uint8, b_scales [N, K/16] float8_e4m3fn, b_global_scale float32 [];
out [M, N] in a's dtype. K must be a positive multiple of 16 (the scale block); no other alignment is required.
"""
from __future__ import annotations

import torch

from .. import _utils
from . import direct
from ..heuristics import gemm_config, gemm_mma_config
from ..kernels.gemm_blockscaled import nvfp4_matmul_kernel
from ..kernels.gemm_nvfp4_mma import nvfp4_matmul_mma_kernel
from ._launch import sm90_target
from .quant import check_nvfp4


class GemmPlan(direct.Replayable):
    """One nvfp4_matmul call's kernel (the register-operand kernel for M <= 16 on sm_90, else the Triton one),
    K slices and launch arguments; dest: out [M, N] in a's dtype, or fp32 partials [slices, M, N] that the run
    sums afterwards (torch, in slice order)."""

    def __init__(self, a, b_data, b_scales, mma_config=None):
        """mma_config: the register-operand kernel's tiles to take instead of the heuristic's (sweeps)."""
        (m, k), n = a.shape, b_data.shape[0]
        self.out_shape, self.dtype, self.device = (m, n), a.dtype, a.device
        self.empty = m == 0 or n == 0
        self.mma = mma_config
        if self.mma is None and not self.empty and sm90_target():
            cfg = gemm_mma_config(m, n, k, num_sms=_utils.num_sms(a.device))
            if cfg is not None and _mma_operands_ok(a, b_data, b_scales):
                self.mma = cfg
        if self.empty:  # nothing to launch (no tile for an empty output)
            return
        self.cfg = self.mma or gemm_config(m, n, k, interpret=_utils.is_interpreter(),
                                           num_sms=_utils.num_sms(a.device))
        self.k_per_split, self.split = _k_slices(k, self.cfg.block_k, self.cfg.split_k)

    def run(self, a, b_data, b_scales, b_global_scale):
        if self.empty:
            return a.new_empty(self.out_shape)
        dest = (_utils.new_output(self.out_shape, self.dtype, self.device) if self.split == 1
                else torch.empty((self.split, *self.out_shape), dtype=torch.float32, device=self.device))
        self.execute(self._launch, (a, b_data, b_scales, b_global_scale, dest), direct.current_stream(self.device))
        return dest if dest.dim() == 2 else dest.sum(0).to(self.dtype)

    def _launch(self, a, b_data, b_scales, b_global_scale, dest) -> None:
        (m, k), n = a.shape, b_data.shape[0]
        s_bits = direct.derived(b_scales.view(torch.uint8), b_scales)
        cfg, kps, split = self.cfg, self.k_per_split, self.split
        if self.mma is not None:
            direct.launch(
                nvfp4_matmul_mma_kernel, (cfg.programs_n, split),
                a, b_data, s_bits, b_global_scale, dest, m, n, k, kps, kps // 2, a.stride(0), b_data.stride(0),
                s_bits.stride(0), dest.stride(-2), dest.stride(-1), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                KS_STEPS=kps // cfg.block_k, SPLIT_K=split, num_warps=4)
            return
        direct.launch(
            nvfp4_matmul_kernel, (_utils.cdiv(m, cfg.block_m), _utils.cdiv(n, cfg.block_n), split),
            a, b_data, s_bits, b_global_scale, dest, m, n, k, kps,
            a.stride(0), a.stride(1), b_data.stride(0), b_data.stride(1), s_bits.stride(0), s_bits.stride(1),
            dest.stride(-2), dest.stride(-1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, UPCAST=_utils.upcast_tiles(),
            SCALE_WORDS=(k % 64 == 0 and cfg.block_k % 64 == 0 and s_bits.stride(1) == 1
                         and _utils.words_aligned(s_bits, 1)),
            SWAP_AB=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _k_slices(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(values per K slice, slices) of both kernels: at most split_k slices of whole block_k steps, none empty."""
    k_steps = _utils.cdiv(k, block_k)
    k_per_split = _utils.cdiv(k_steps, min(split_k, k_steps)) * block_k
    return k_per_split, _utils.cdiv(k, k_per_split)  # no empty slice


def _mma_operands_ok(a, b_data, b_scales) -> bool:
    """What the register-operand kernel assumes of the tensors: K a multiple of 32 with contiguous, 16-byte
    aligned rows of a and b_data (its copies and loads move 16 bytes at a time) and unit-stride scale rows."""
    return (a.shape[1] % 32 == 0 and a.stride(1) == 1 and b_data.stride(1) == 1 and b_scales.stride(1) == 1
            and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (a, b_data)))


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
