"""Launchers of the low-precision kernels: the NVFP4 quantizers and the NVFP4 GEMMs (on sm_90 the wgmma kernel up to
M = 1024 where its TMA copies apply, the register-operand kernel for other decode-sized calls; larger W4A16 calls
(above 256 rows where wgmma does not apply) the decoded weight and cuBLAS; else the Triton dequantizing kernel)."""
from __future__ import annotations

import torch

from .. import _utils, config
from . import direct
from ..lowp.formats import NVFP4_BLOCK
from ..lowp.kernels.gemm_dequant import nvfp4_matmul_kernel
from ..lowp.kernels.gemm_mma import nvfp4_matmul_mma_kernel
from ..lowp.kernels.gemm_wgmma import HALF_STEP, STEP_K, activation_prep_kernel, nvfp4_matmul_wgmma_kernel
from ..lowp.kernels.quant import nvfp4_dequantize_kernel, nvfp4_quantize_kernel
from ..plan.gemm import GEMM_WGMMA_K_MULTIPLE, gemm_config, gemm_decoded_config, gemm_mma_config, gemm_wgmma_config
from ..plan.target import native_fp4_mma, sm90_target, target_arch, tma_aligned
from .tensors import gluon_desc, launch_sum_cast


def quant_blocks(k: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K) of the quantize / dequantize kernels: up to 128 columns (8 scale blocks) and 4096
    elements per program. BLOCK_K >= 32 keeps every tile dimension >= 2. Not tuned: both kernels are memory-bound
    elementwise passes."""
    block_k = min(128, max(32, _utils.next_pow2(k)))
    return 4096 // block_k, block_k


def _grid(rows: int, k: int):
    block_r, block_k = quant_blocks(k)
    return (_utils.cdiv(rows, block_r), _utils.cdiv(k, block_k)), block_r, block_k


def launch_nvfp4_quantize(x2, data, scale_bits, global_scale) -> None:
    """x2 [R, K] -> data [R, K/2] uint8, scale_bits [R, K/16] uint8 (e4m3 bit patterns), both contiguous."""
    grid, block_r, block_k = _grid(x2.shape[0], x2.shape[1])
    k = x2.shape[1]
    nvfp4_quantize_kernel[grid](x2, data, scale_bits, global_scale, x2.shape[0], k, x2.stride(0), x2.stride(1),
                                k // 2, k // NVFP4_BLOCK, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)


def launch_nvfp4_dequantize(d2, s2, global_scale, out) -> None:
    """d2 [R, K/2] uint8, s2 [R, K/16] uint8 -> out [R, K] (contiguous) in out's dtype: fp32, fp16 or bf16."""
    k = d2.shape[1] * 2
    grid, block_r, block_k = _grid(d2.shape[0], k)
    nvfp4_dequantize_kernel[grid](d2, s2, global_scale, out, d2.shape[0], k, d2.stride(0), d2.stride(1),
                                  s2.stride(0), s2.stride(1), BLOCK_R=block_r, BLOCK_K=block_k,
                                  UPCAST=_utils.upcast_tiles(), num_warps=4)


class GemmPlan(direct.Replayable):
    """One nvfp4_matmul call's kernel (on sm_90, W4A16 takes the wgmma kernel up to M = 1024 with K a multiple of 256
    and TMA-addressable weights (run 164: 1.2-1.5x the register-operand kernel at M = 1 and 16), the
    register-operand kernel for the other calls with M <= 16; larger W4A16 calls (above 256 rows where wgmma does
    not apply) and W4A4 calls above 256 rows off Blackwell the decoded operands and cuBLAS; W4A4 on the native
    block-scaled MMA where the target has it; else the Triton kernel), K slices and launch arguments. With one K
    slice the kernel writes out [M, N] in out_dtype; with more, fp32 partials [slices, M, N] in the workspace, which
    a second launch sums in slice order into out. The wgmma kernel's prepared activation ([2 * m_pad, K/2] fp16 and
    [m_pad] row factors) comes from the workspace too."""

    def __init__(self, a, b_data, b_scales, a_scales, out_dtype):
        self.a_nvfp4 = a_scales is not None
        m, n = a.shape[0], b_data.shape[0]
        k = b_data.shape[1] * 2
        self.out_shape, self.dtype, self.device = (m, n), out_dtype, a.device
        self.empty = m == 0 or n == 0
        arch = target_arch()
        self.native = self.a_nvfp4 and native_fp4_mma(arch)
        self.mma = self.wgmma = None
        sm90_w4a16 = not self.empty and not self.a_nvfp4 and sm90_target()
        wgmma_ok = sm90_w4a16 and _wgmma_operands_ok(b_data, b_scales)
        self.decoded = None if self.empty else config.chosen("gemm_decoded",
                                                             gemm_decoded_config(m, n, k, self.native, wgmma_ok))
        if self.decoded is not None:
            if self.decoded.chunk_rows <= 0:
                raise ValueError(f"{self.decoded}: chunks of at least one row")
            return
        if sm90_w4a16:
            num_sms = _utils.num_sms(a.device)
            if wgmma_ok:
                self.wgmma = config.chosen("gemm_wgmma", gemm_wgmma_config(m, n, k, num_sms=num_sms))
            if self.wgmma is None and _mma_operands_ok(a, b_data, b_scales):
                self.mma = config.chosen("gemm_mma", gemm_mma_config(m, n, k, num_sms=num_sms))
        if self.empty:  # nothing to launch (no tile for an empty output)
            return
        self.ws_numel = 0
        if self.wgmma is not None:
            self.cfg = self.wgmma
            self.m_pad = _utils.cdiv(m, self.cfg.block_m) * self.cfg.block_m
            self.split = self.cfg.split_k
            self.k_per_split = k // self.split
            if self.k_per_split % GEMM_WGMMA_K_MULTIPLE or k % self.split or self.cfg.steps not in (1, 2):
                raise ValueError(f"GemmWgmmaConfig(split_k={self.split}, steps={self.cfg.steps}): K={k} must split "
                                 f"into slices of a multiple of {GEMM_WGMMA_K_MULTIPLE} values, stages of 1 or 2 steps")
            # prep (fp16, two per fp32 slot), the row factors, then the partials; each 16-byte aligned for TMA
            self.partials_at = self.m_pad * k // 2 + _utils.cdiv(self.m_pad, 4) * 4
            self.ws_numel = self.partials_at
        else:
            self.cfg = self.mma or config.chosen("gemm", gemm_config(m, n, k, interpret=_utils.is_interpreter(),
                                                                     num_sms=_utils.num_sms(a.device),
                                                                     a_nvfp4=self.a_nvfp4, native_fp4=self.native,
                                                                     arch=arch))
            self.k_per_split, self.split = _k_slices(k, self.cfg.block_k, self.cfg.split_k)
        if self.split > 1:
            self.ws_numel += self.split * m * n

    def run(self, a, b_data, b_scales, b_global_scale, a_scales=None, a_global_scale=None):
        if self.empty:
            return a.new_empty(self.out_shape, dtype=self.dtype)
        out = _utils.new_output(self.out_shape, self.dtype, self.device)
        stream = direct.current_stream(self.device)
        if self.decoded is not None:
            self._run_decoded(a, b_data, b_scales, b_global_scale, a_scales, a_global_scale, out, stream)
            return out
        ws = direct.WORKSPACE.get(self.device, stream, self.ws_numel) if self.ws_numel else None
        self.execute(self._launch, (a, b_data, b_scales, b_global_scale, a_scales, a_global_scale, out, ws), stream)
        return out

    def _launch(self, a, b_data, b_scales, b_global_scale, a_scales, a_global_scale, out, ws) -> None:
        operands = (a, b_data, b_scales, b_global_scale, a_scales, a_global_scale)
        split = self.split
        if self.wgmma is not None:
            self._launch_wgmma(a, b_data, b_scales, b_global_scale, out, ws)
        elif split == 1:
            self._launch_gemm(*operands, out)
        else:
            partials = direct.derived(ws[:split * out.numel()].view(split, *out.shape), ws)
            self._launch_gemm(*operands, partials)
            launch_sum_cast(partials, out, split)

    def _run_decoded(self, a, b_data, b_scales, b_global_scale, a_scales, a_global_scale, out, stream) -> None:
        """Each chunk of weight rows decoded into the output's dtype in the workspace, then cuBLAS's GEMM into its
        output columns (W4A4: a decoded first, whole, into a buffer of the call's own). Plain launches, nothing
        recorded: the call's GPU time (>= ~100 us) dwarfs its host time. a is detached: nvfp4_matmul has no
        gradient, and torch.mm's out= refuses an a that requires one."""
        m, n, k = out.shape[0], b_data.shape[0], b_data.shape[1] * 2
        rows = min(n, self.decoded.chunk_rows)
        slots = rows * k // 2  # two 16-bit values per fp32 slot (K is a multiple of 16)
        ws = direct.WORKSPACE.get(self.device, stream, slots)
        weight = ws[:slots].view(self.dtype).view(rows, k)
        if self.a_nvfp4:  # from the caching allocator, not the workspace, which would keep M x K for good
            decoded_a = torch.empty((m, k), dtype=self.dtype, device=self.device)
            launch_nvfp4_dequantize(a, a_scales.view(torch.uint8), a_global_scale, decoded_a)
            a = decoded_a
        a = a.detach()
        scale_bits = b_scales.view(torch.uint8)
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            w = weight[:n1 - n0]
            launch_nvfp4_dequantize(b_data[n0:n1], scale_bits[n0:n1], b_global_scale, w)
            torch.mm(a, w.t(), out=out if n1 - n0 == n else out[:, n0:n1])

    def _launch_wgmma(self, a, b_data, b_scales, b_global_scale, out, ws) -> None:
        """The activation's prep pass, the wgmma kernel into out (one K slice) or into fp32 partials, then their
        sum in slice order."""
        cfg, m_pad, split = self.cfg, self.m_pad, self.split
        (m, k), n = a.shape, b_data.shape[0]
        prep_numel = m_pad * k // 2
        prep = direct.derived(ws[:prep_numel].view(torch.float16).view(2 * m_pad, k // 2), ws)
        factor = direct.derived(ws[prep_numel:prep_numel + m_pad], ws)
        dest = out
        if split > 1:
            start = self.partials_at
            dest = direct.derived(ws[start:start + split * m * n].view(split, m, n), ws)
        # A programmatic dependent launch: the GEMM starts fetching weights while the prep pass runs, and waits in
        # griddepcontrol.wait before it reads what the pass wrote.
        direct.launch(activation_prep_kernel, (m_pad,), a, prep, factor, m, m_pad, k, a.stride(0), a.stride(1),
                      BLOCK_K=min(_utils.next_pow2(k), 8192), PDL=True, num_warps=8)
        words = direct.derived(b_data.view(torch.int32), b_data)
        scale_bits = direct.derived(b_scales.view(torch.uint8), b_scales)
        units = _utils.cdiv(n, 64 * cfg.consumers) * (m_pad // cfg.block_m) * split
        direct.launch(
            nvfp4_matmul_wgmma_kernel, (min(units, _utils.num_sms(a.device)),),
            gluon_desc(prep, [cfg.block_m, HALF_STEP], swizzled=True), gluon_desc(words, [64, 16 * cfg.steps]),
            gluon_desc(scale_bits, [64, 16]), factor, b_global_scale, dest, m, n, m_pad,
            self.k_per_split // (STEP_K * cfg.steps), dest.stride(-2), dest.stride(-1), BLOCK_M=cfg.block_m,
            CONSUMERS=cfg.consumers, STAGES=cfg.stages, STEPS=cfg.steps, SPLIT_K=split,
            PREFETCH=min(cfg.prefetch, cfg.stages), num_warps=4, launch_pdl=True)
        if split > 1:
            launch_sum_cast(dest, out, split)

    def _launch_gemm(self, a, b_data, b_scales, b_global_scale, a_scales, a_global_scale, dest) -> None:
        m, n, k = a.shape[0], b_data.shape[0], b_data.shape[1] * 2
        s_bits = direct.derived(b_scales.view(torch.uint8), b_scales)
        cfg, kps, split = self.cfg, self.k_per_split, self.split
        if self.mma is not None:
            direct.launch(
                nvfp4_matmul_mma_kernel, (cfg.programs_n, split),
                a, b_data, s_bits, b_global_scale, dest, m, n, k, kps, kps // 2, a.stride(0), b_data.stride(0),
                s_bits.stride(0), dest.stride(-2), dest.stride(-1), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                KS_STEPS=kps // cfg.block_k, SPLIT_K=split, num_warps=4)
            return
        # A 16-bit a passes b's scales and global scale in the NVFP4 a's slots (never read: A_NVFP4 is off).
        a_bits = direct.derived(a_scales.view(torch.uint8), a_scales) if self.a_nvfp4 else s_bits
        a_g = a_global_scale if self.a_nvfp4 else b_global_scale
        scale_words = (k % 64 == 0 and cfg.block_k % 64 == 0
                       and all(t.stride(1) == 1 and _utils.words_aligned(t, 1) for t in (s_bits, a_bits)))
        direct.launch(
            nvfp4_matmul_kernel, (_utils.cdiv(m, cfg.block_m), _utils.cdiv(n, cfg.block_n), split),
            a, a_bits, a_g, b_data, s_bits, b_global_scale, dest, m, n, k, kps,
            a.stride(0), a.stride(1), a_bits.stride(0), a_bits.stride(1), b_data.stride(0), b_data.stride(1),
            s_bits.stride(0), s_bits.stride(1), dest.stride(-2), dest.stride(-1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, UPCAST=_utils.upcast_tiles(),
            SCALE_WORDS=scale_words and not self.native, SWAP_AB=cfg.swap_ab, A_NVFP4=self.a_nvfp4,
            NATIVE_FP4=self.native, WEIGHTS_FIRST=cfg.weights_first, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)


def _k_slices(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(values per K slice, slices) of both kernels: at most split_k slices of whole block_k steps, none empty."""
    k_steps = _utils.cdiv(k, block_k)
    k_per_split = _utils.cdiv(k_steps, min(split_k, k_steps)) * block_k
    return k_per_split, _utils.cdiv(k, k_per_split)  # no empty slice


def _wgmma_operands_ok(b_data, b_scales) -> bool:
    """What the wgmma kernel's TMA copies need of the weight (the activation is copied into the workspace first,
    so a may have any strides)."""
    return tma_aligned(b_data, dims=(0,)) and tma_aligned(b_scales, dims=(0,))


def _mma_operands_ok(a, b_data, b_scales) -> bool:
    """What the register-operand kernel assumes of the tensors: K a multiple of 32 with contiguous, 16-byte
    aligned rows of a and b_data (its copies and loads move 16 bytes at a time) and unit-stride scale rows."""
    return (a.shape[1] % 32 == 0 and a.stride(1) == 1 and b_data.stride(1) == 1 and b_scales.stride(1) == 1
            and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (a, b_data)))
