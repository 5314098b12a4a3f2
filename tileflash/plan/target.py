"""The compile target: its compute capability and what it has (shared memory per block, tensor memory), and the
head-dim padding every kernel shares."""
from __future__ import annotations

import torch

from .. import _utils
from .._utils import next_pow2


# Shared memory one block may use, by compute capability (CUDA's limits: A100 163 KB, Ada and consumer Blackwell
# 99 KB, H100/H200 and B200 227 KB).
SHARED_MEM_PER_BLOCK = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 103: 232448, 120: 101376}


def small_shared_memory(arch: int | None) -> bool:
    """Under 200 KB of shared memory per block (A100, Ada, consumer Blackwell): the H200's tiles do not fit there.
    arch None (the interpreter, no driver) counts as the H200's."""
    return SHARED_MEM_PER_BLOCK.get(arch, SHARED_MEM_PER_BLOCK[90]) < 200 * 1024


def tensor_memory(arch: int | None) -> bool:
    """sm_10x (B200): Triton keeps tl.dot accumulators in tensor memory (512 columns of 32 bits per SM)."""
    return arch is not None and arch // 10 == 10


def mma_sync_target(arch: int | None) -> bool:
    """Ampere, Ada and consumer Blackwell (sm_8x, sm_12x): tensor cores fed by mma.sync, whose operands and
    accumulators live in registers (no wgmma, no tcgen05), so the Triton kernels' 4-warp 64-row tiles spill
    there (compile check, --res-usage: 280-720 bytes for d128 forward tiles on sm_80) and take 8 warps."""
    return arch is not None and (arch < 90 or arch >= 120)


def has_tma(arch: int | None) -> bool:
    """Whether the Triton tiles take TMA descriptors: sm_90 and sm_10x/11x. Below sm_90 there is no TMA (Triton
    lowers descriptors to pointer arithmetic over their fields); on sm_12x, which has TMA but mma.sync MMAs,
    descriptor tiles spilled where pointer tiles did not (compile check, --res-usage: d64 dK/dV 520 bytes, d256
    forward 432, decode up to 376 on sm_80). Those targets take pointers."""
    return arch is None or 90 <= arch < 120


def native_fp4_mma(arch: int | None) -> bool:
    """Blackwell (sm_10x, sm_11x, sm_12x): tensor cores multiply e2m1 codes with e4m3 scales per 16 values natively
    (tcgen05.mma / mma.sync kind::mxf4nvf4, which tl.dot_scaled emits there). Elsewhere Triton cannot lower a
    dot_scaled with e4m3 scales (sm_90 fails to compile it) and the interpreter has none."""
    return arch is not None and arch >= 100


def padded_head_dim(d: int, fp8: bool = False) -> int:
    """Head dims are padded inside the kernel to a power of two (>= 16, the smallest tl.dot K; >= 32 for 8-bit
    operands, whose MMAs take K in steps of 32)."""
    return max(32 if fp8 else 16, next_pow2(d))


def target_arch() -> int | None:
    """The CUDA compute capability kernels compile for (80, 90, 100, 120, ...), from Triton's active target, not
    torch's device, so the CPU compile check (tests/sm90_compile_check.py --arch) takes the same paths as that GPU;
    None in the interpreter or without a CUDA driver."""
    if _utils.is_interpreter():
        return None
    try:
        import triton

        target = triton.runtime.driver.active.get_current_target()
    except Exception:  # no usable GPU driver
        return None
    return target.arch if target.backend == "cuda" else None


def sm90_target() -> bool:
    """Whether kernels compile for sm_90 (H100/H200), where the Gluon kernels run."""
    return target_arch() == 90


def tma_aligned(t: torch.Tensor, dims) -> bool:
    """TMA's layout rules for a tensor (e.g. [B, S, H, D]) whose dims `dims` a descriptor spans by stride: a
    16-byte aligned base, those strides multiples of 16 bytes, and the last dim contiguous."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all((t.stride(i) * es) % 16 == 0 for i in dims)


def tma_4d_ok(t: torch.Tensor) -> bool:
    """A [B, S, H, D] tensor a 4-D TMA descriptor can address: aligned, and every dim in TMA's positive int32 range."""
    return tma_aligned(t, dims=(0, 1, 2)) and all(0 < n < 2 ** 31 for n in t.shape)
