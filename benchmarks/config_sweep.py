"""Tile-config sweep for the backward, the FP8 / NVFP4 decode and the NVFP4 GEMM (GPU only).

`python benchmarks/config_sweep.py FAMILY [FAMILY ...] [--json PATH]`, families:
  backward  bwd, bwd-d64, bwd-d128, bwd-d256, bwd-softcap, bwd-det, bwd-det-d64, bwd-16k, bwd-rotate, bwd-tma;
  decode    decode, decode-quant, decode-paged, decode-paged-tma, decode-page16-tma, decode-page16-stages,
            decode-small, decode-mqa, decode-d64, decode-quant-small, decode-quant-wide, decode-quant-overlap,
            decode-large, decode-mla, decode-mla-h128;
  GEMM      gemm, gemm-small, gemm-occupancy.
Each config is forced by replacing the heuristic the op reads (tileflash.ops.*.{bwd,decode,gemm}_config), checked
against a reference, then timed (decode: CUDA-graph replay). The winners go into tileflash/heuristics.py with the
numbers in a comment.
"""
import argparse
import dataclasses
import json
import sys
import traceback

import torch
import torch.nn.functional as F

import tileflash
from tileflash.bench.formulas import attn_fwd_flops, tflops
from tileflash.bench.table import format_table
from tileflash.bench.timing import bench_ms, graphed
from tileflash.heuristics import BwdConfig, DecodeConfig, GemmConfig, decode_block_m
from tileflash.ops import backward as bwd_ops
from tileflash.ops import decode as decode_ops
from tileflash.ops import gemm as gemm_ops
from tileflash.ops import direct

direct.ENABLED = False  # this script swaps heuristics and launchers, which cached plans would outlive

BF16 = torch.bfloat16
# (dkdv_block_m, dkdv_block_n, dq_block_m, dq_block_n, dkdv_warps, dkdv_stages, dq_warps, dq_stages). The default
# backward adds dQ up with atomics inside the dK/dV program (the dQ fields only matter with deterministic=True,
# family bwd-det). Registers for the atomic-dQ dK/dV program from an sm_90 build with triton 3.7 on the CPU (full /
# causal): none of these spill unless noted.
BWD_CONFIGS = {
    64: [(64, 64, 128, 32, 4, 3, 8, 3),  # 255 / 255 registers (the deterministic pick)
         (64, 128, 128, 64, 8, 2, 8, 2), (32, 128, 128, 64, 8, 2, 8, 2), (32, 64, 128, 64, 4, 3, 8, 2),
         (64, 128, 128, 64, 8, 3, 8, 2), (64, 64, 128, 64, 4, 2, 8, 2), (32, 64, 128, 64, 4, 2, 8, 2)],
    128: [(64, 128, 128, 64, 8, 2, 8, 2),  # the deterministic pick: spills 160 / 216 B with atomics
          (64, 128, 128, 64, 8, 3, 8, 2),  # one more Q/dO stage: 377.7 / 328.0 vs 333.5 / 322.6 (run 34, chosen)
          (32, 128, 128, 64, 8, 2, 8, 2), (32, 128, 128, 64, 8, 3, 8, 2), (16, 128, 128, 64, 8, 3, 8, 2),
          (16, 128, 128, 64, 8, 2, 8, 2), (32, 64, 128, 64, 4, 2, 8, 2), (16, 64, 128, 64, 4, 3, 8, 2)],
    256: [(32, 32, 64, 32, 8, 1, 8, 1), (16, 32, 64, 32, 4, 2, 8, 1), (32, 32, 64, 32, 4, 2, 8, 1),
          (16, 32, 64, 32, 8, 2, 8, 1), (16, 64, 64, 32, 8, 2, 8, 1)],
}
# The deterministic backward (separate dQ pass) keeps its session-2 sweep list.
# The dK/dV programs of one head starting their query blocks at staggered blocks (rotate, the tenth field) against
# all starting together, atomic dQ, the current tiles.
BWD_ROTATE_CONFIGS = {
    64: [(64, 128, 128, 64, 8, 3, 8, 2, True, False), (64, 128, 128, 64, 8, 3, 8, 2, True, True)],
    128: [(64, 128, 128, 64, 8, 2, 8, 2, True, False), (64, 128, 128, 64, 8, 2, 8, 2, True, True)],
    256: [(32, 32, 64, 32, 4, 2, 8, 1, True, False), (32, 32, 64, 32, 4, 2, 8, 1, True, True)],
}
# Q/dO of the dK/dV interior through TMA descriptors (eleventh field) against pointers. sm_90 builds on the CPU
# (triton 3.7): d64 interior step 342 -> 321 SASS instructions, no spills; d128 568 -> 625 with 360 B of spills.
BWD_TMA_CONFIGS = {
    64: [(64, 64, 128, 32, 4, 3, 8, 3, False, False, False), (64, 64, 128, 32, 4, 3, 8, 3, False, False, True),
         (64, 128, 128, 64, 8, 3, 8, 2, True, True, False), (64, 128, 128, 64, 8, 3, 8, 2, True, True, True)],
    128: [(64, 128, 128, 64, 8, 2, 8, 2, True, True, False), (64, 128, 128, 64, 8, 2, 8, 2, True, True, True)],
}
BWD_DET_CONFIGS = {
    64: [(64, 64, 128, 32, 4, 3, 8, 3), (64, 128, 128, 64, 8, 2, 8, 2), (64, 128, 64, 64, 4, 2, 4, 2),
         # the d64 dK/dV tile with other dQ tiles (run 26: 294 full / 277 causal with the first)
         (64, 64, 128, 64, 4, 3, 8, 2), (64, 64, 64, 64, 4, 3, 4, 3), (64, 64, 128, 32, 4, 3, 8, 2),
         (64, 64, 64, 32, 4, 3, 4, 3), (64, 64, 128, 64, 4, 3, 8, 3), (64, 64, 128, 128, 4, 3, 8, 2)],
    128: [(64, 128, 128, 64, 8, 2, 8, 2), (32, 128, 128, 64, 8, 2, 8, 2), (32, 128, 128, 64, 8, 3, 8, 2),
          (16, 128, 128, 64, 8, 3, 8, 2)],
    256: [(32, 32, 64, 32, 8, 1, 8, 1), (16, 32, 64, 32, 4, 2, 8, 1)],
}
# (block_n, warps, stages, tma, trans); earlier sweeps (RESULTS.md) settled tokens, warps and stages for the plain
# products, so this one weighs the transposed products (trans) against them.
DECODE_CONFIGS = [(64, 4, 2, True, False), (64, 4, 3, True, False), (64, 4, 2, True, True), (64, 4, 3, True, True),
                  (128, 4, 2, True, True), (64, 8, 3, True, True)]
# Quantized caches, around this session's pick (64, 4, 3, trans): deeper pipelines, larger steps.
QUANT_CONFIGS = [(64, 4, 3, True, True), (64, 4, 4, True, True), (128, 4, 3, True, True), (32, 4, 4, True, True),
                 (64, 4, 5, True, True)]
DECODE_SHAPES = [(1, 8192), (1, 32768), (8, 32768), (32, 8192), (256, 2048)]  # (batch, ctx), 32 / 8 heads, d 128
# Paged 16-bit caches (pointer gathers; 0.76-0.95x the contiguous speed in run 7): deeper pipelines and tile sizes.
PAGED_CONFIGS = [(64, 4, 2, False, False), (64, 4, 3, False, False), (64, 4, 4, False, False),
                 (128, 4, 2, False, False), (128, 4, 3, False, False), (64, 4, 3, False, True),
                 (32, 4, 4, False, False)]
PAGED_SHAPES = [(1, 32768), (32, 8192), (64, 4096)]
# Pages holding whole steps read one TMA box per tile (tma True) instead of per-token gathers (False); session 5
# built this on the CPU only. Small caches (the 64-token tiles) and a large one.
PAGED_TMA_SHAPES = [(1, 8192), (8, 8192), (32, 8192)]
PAGED_TMA_CONFIGS = [(64, 4, 2, True, False), (64, 4, 2, False, False), (128, 4, 2, True, False),
                     (128, 4, 2, False, False)]
# Page 16 (b=1 ctx 8k +10.2% over the contiguous cache with 64-token pointer gathers, run 32): one page per step
# read as a TMA box (16 tokens; deeper pipelines keep the bytes in flight) against pointer steps of 32 and 64 tokens
# (a TMA step must lie inside one page). sm_90 builds under triton 3.6 on the CPU: 17 KB / 25 KB of shared memory at
# 4 / 6 stages. Run 36: slower than 64-token pointer steps (b=1 ctx 8k 24.8 us at 8 stages vs 23.9; RESULTS.md).
PAGE16_TMA_CONFIGS = [(64, 4, 2, False, False), (16, 4, 4, True, False), (16, 4, 6, True, False),
                      (16, 4, 8, True, False), (32, 4, 3, False, False)]
PAGE16_TMA_SHAPES = [(1, 8192), (1, 32768), (8, 8192), (32, 8192)]
# Page 16 through pointers with deeper pipelines: with 2 stages Triton 3.6 loads each step's block-table entries
# synchronously right before that step's K/V copies (two dependent memory latencies per step, sm_90 TTGIR built on
# the CPU); from 3 stages the table entries arrive one stage ahead through cp.async (run 9 measured b=1 ctx 32k
# 57.5 us at 3 stages vs 55.7 at 2, before the block table moved off the per-token path). Run 43: slower again
# (b=1 ctx 8k 24.4 us at 3 or 4 stages vs 23.2 at 2; RESULTS.md).
PAGE16_STAGES_CONFIGS = [(64, 4, 2, False, False), (64, 4, 3, False, False), (64, 4, 4, False, False),
                         (32, 4, 3, False, False), (32, 4, 4, False, False), (128, 4, 3, False, False)]
# Small batches (few programs per SM after splitting): deeper pipelines and longer steps keep more bytes in flight
# per program; each config at several forced split counts (0 = the heuristic). (b, ctx, Hq, Hkv, format)
SMALL_SHAPES = [(1, 8192, 32, 8, "16bit"), (1, 32768, 32, 8, "16bit"), (1, 131072, 32, 8, "16bit"),
                (1, 32768, 8, 1, "16bit"), (8, 8192, 32, 8, "16bit"), (1, 32768, 32, 8, "fp8"),
                (8, 8192, 32, 8, "fp8"), (1, 32768, 32, 8, "nvfp4")]
SMALL_CONFIGS = {"16bit": [(64, 4, 2, True, False), (64, 4, 3, True, False), (64, 4, 4, True, False),
                           (128, 4, 2, True, False), (128, 4, 3, True, False), (64, 4, 4, True, True)],
                 "fp8": [(64, 4, 3, True, True), (64, 4, 4, True, True), (64, 4, 6, True, True),
                         (128, 4, 3, True, True), (128, 4, 4, True, True)]}
SMALL_CONFIGS["nvfp4"] = SMALL_CONFIGS["fp8"]
SMALL_SPLITS = (0, 16, 33, 66, 132)
# Quantized caches at larger batch: 8 warps (two warpgroups share a 128-token step) against the 4-warp pick.
QUANT_WIDE_SHAPES = [(b, ctx, 32, 8, fmt) for fmt in ("fp8", "nvfp4") for b, ctx in ((8, 32768), (32, 8192),
                                                                                       (256, 2048), (1, 32768))]
QUANT_WIDE_CONFIGS = {fmt: [(64, 4, 3, True, True), (128, 8, 3, True, True), (64, 8, 3, True, True),
                            (128, 8, 2, True, True), (128, 4, 3, True, True)] for fmt in ("fp8", "nvfp4")}
# The quantized loops are bound by dependent ALU chains at two programs per SM: the S/P-overlapped loop gives the
# schedulers the next block's dequantization and QK^T during this block's softmax.
QUANT_OVERLAP_CONFIGS = {fmt: [(128, 4, 3, True, True), (128, 4, 3, True, True, True), (64, 4, 3, True, True, True),
                               (128, 4, 2, True, True, True)] for fmt in ("fp8", "nvfp4")}
# 16-bit caches at larger batch (0.96-0.99x SDPA in run 19): longer steps, deeper pipelines, split counts.
LARGE_SHAPES = [(b, ctx, 32, 8, "16bit") for b, ctx in ((8, 8192), (8, 32768), (32, 2048), (32, 8192), (64, 4096),
                                                        (128, 1024), (256, 2048))]
LARGE_CONFIGS = {"16bit": [(64, 4, 2, True, False), (128, 4, 2, True, False), (64, 4, 3, True, False),
                           (32, 4, 4, True, False), (64, 4, 2, True, False, True)]}
# MQA (8 query heads on one KV head as in `bench decode`; few programs before splitting; 0.84-1.18x SDPA in run 19).
# Run 36 timed 32/1 heads by mistake, beside a sweep on the host's other GPU (short graphs then run long).
# Run 27 measured this family while another process compiled kernels on the same host: its times ran up to 40% over
# the benchmark's for the same config (b=256 ctx 2k 111.9 vs 80.6 us), and the 128-token steps it favoured gave no
# change in `bench decode` (run 28). Time sweeps on an otherwise idle host.
MQA_SHAPES = [(b, ctx, 8, 1, "16bit") for b, ctx in ((1, 8192), (1, 32768), (8, 8192), (32, 8192), (128, 1024),
                                                      (256, 2048))]
MQA_CONFIGS = {"16bit": [(64, 4, 2, True, False), (64, 4, 3, True, False), (128, 4, 2, True, False),
                         (128, 4, 3, True, False), (32, 4, 4, True, False)]}
# Head dim 64 (0.91-0.98x SDPA in run 32; 128-token steps, 2 stages, the d=128 bytes per step): shorter and longer
# steps, deeper pipelines.
D64_SHAPES = [(b, ctx, 32, 8, "16bit", 64) for b, ctx in ((1, 8192), (8, 8192), (32, 2048), (32, 8192), (128, 1024))]
D64_CONFIGS = {"16bit": [(128, 4, 2, True, False), (64, 4, 2, True, False), (64, 4, 3, True, False),
                         (128, 4, 3, True, False), (256, 4, 2, True, False)]}
# FP8 caches whose programs stream few tokens (1.42-1.52x the bf16 peer in run 40, where 1.7x is asked): the large
# caches' 128-token tiles (two programs per SM) against 64-token ones (four per SM), at forced split counts; these
# shapes were never in a quantized-tile sweep.
QUANT_SMALL_SHAPES = [(b, ctx, 32, 8, "fp8") for b, ctx in ((8, 8192), (32, 2048), (128, 1024), (1, 131072))]
QUANT_SMALL_CONFIGS = {"fp8": [(128, 4, 3, True, True), (64, 4, 3, True, True), (64, 4, 4, True, True),
                               (128, 4, 2, True, True)]}
# (block_m, block_n, block_k, warps, stages, split_k[, swap_ab])
GEMM_CONFIGS = [(16, 32, 128, 4, 4, 4), (16, 32, 128, 4, 4, 3),  # plain products (the current M <= 16 pick first)
                # swapped products (c^T = w a^T, the weight tile on the MMA's M side), tuple's last entry True
                (16, 64, 128, 4, 4, 4, True), (16, 64, 128, 4, 4, 2, True), (16, 128, 128, 4, 3, 2, True),
                (16, 128, 64, 4, 4, 2, True), (16, 64, 256, 4, 3, 2, True), (16, 128, 128, 8, 3, 1, True),
                (64, 64, 128, 4, 3, 1), (128, 64, 128, 4, 3, 1), (128, 128, 64, 8, 3, 1)]
# M <= 16 is bound by instruction issue (bf16 M=1 N=K=8192: 470 SASS instructions per K step and program, ~15 us
# at 4 per clock on every SM against 36.8 us measured) with 4 programs of 108 registers per SM: narrower or shorter
# tiles use fewer registers (32 columns: 80, K steps of 64: 72) and so fit more warps to hide the dependent chains,
# and more K slices give the grid those programs. sm_90 builds on the CPU, triton 3.7.
GEMM_OCCUPANCY_CONFIGS = [(16, 64, 128, 4, 4, 4, True), (16, 64, 128, 4, 4, 8, True), (16, 32, 128, 4, 4, 8, True),
                          (16, 32, 128, 4, 4, 16, True), (16, 64, 64, 4, 4, 8, True), (16, 64, 64, 4, 4, 16, True)]
# MLA decode (qv, latent 512 + rotary 64, one KV head): (Hq, b, ctx) and (block_n, warps, stages, trans) per tile
# rows (16: Hq = 16, 64: Hq = 128). sm_90 builds on the CPU (triton 3.7, 64-token steps need under 227 KB of shared
# memory): 64 rows spill 80-336 B at 8 warps (32 tokens, 3 stages: 80 B), 1.3-3.9 KB at 4 warps, 400+ B at 16;
# 16 rows do not spill at 4 or 8 warps except transposed 64-token steps.
MLA_SHAPES = [(128, 32, 4096), (128, 1, 32768), (128, 128, 1024), (16, 32, 4096), (16, 1, 32768), (16, 8, 32768)]
# Transposed products at 64 rows (s^T = K q^T, acc^T = V^T P^T: the 512 latent columns on the MMA's M side, split
# between the warpgroups; sm_90 build, triton 3.7): 32-token 3-stage steps 232 registers, no spills; 64-token 2 / 1
# stages spill 784 / 1032 B, 128-token 1 stage 504 B. Run 128 (`decode-mla-h128`): none beats the plain 64-token
# 2-stage pick (b=32 ctx 4k 189.3 / 245.1 / 195.7 us vs 157.0; b=1 ctx 32k 64.2 / 83.5 / 70.1 vs 60.5).
MLA_CONFIGS = {64: [(32, 8, 2, False), (32, 8, 3, False), (64, 8, 2, False), (16, 8, 4, False), (64, 8, 1, False),
                    (32, 8, 3, True), (64, 8, 2, True), (128, 8, 1, True)],
               16: [(64, 4, 2, False), (64, 8, 3, False), (32, 8, 3, False), (32, 4, 3, True), (64, 8, 2, False),
                    (32, 4, 2, False)]}
MLA_SPLITS = (0, 1, 2, 4, 8, 33, 66, 132)
GEMM_SHAPES = [(1, 4096), (16, 4096), (1, 8192), (16, 8192), (128, 8192), (1024, 8192)]  # (M, N = K)
SMALL_M_SHAPES = GEMM_SHAPES[:4]


def _regs_and_spills():
    """Registers and spilled bytes of the newest compiled dK/dV and dQ programs, as the driver reports them."""
    from tileflash.kernels import attn_bwd

    out = []
    for fn in (attn_bwd.attn_bwd_dkdv_kernel, attn_bwd.attn_bwd_dq_kernel):
        kernels = [k for caches in fn.device_caches.values() for k in caches[0].values()]
        if kernels:
            out.append(f"{getattr(kernels[-1], 'n_regs', '?')}r/{getattr(kernels[-1], 'n_spills', '?')}s")
    return " ".join(out)


def _force(module, name, cfg):
    setattr(module, name, lambda *a, **k: cfg)


def sweep_bwd(rows, dims=(64, 128), softcap=0.0, deterministic=False, seqlens=(4096,), configs=None):
    """TFLOP/s per config. Errors against SDPA's gradients; with softcap (SDPA has none) against the
    default config's gradients, which the test suite checks against the reference."""
    orig = bwd_ops.bwd_config
    for d in dims:
        for causal, s in [(c, n) for n in seqlens for c in (False, True)]:
            h = 2048 // d
            b = 16384 // s
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
            do = torch.randn(b, s, h, d, device="cuda", dtype=BF16)
            if softcap:
                out = tileflash.flash_attn_func(q, k, v, causal=causal, softcap=softcap)
                ref_grads = torch.autograd.grad(out, (q, k, v), do)
            else:
                ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
                ref_grads = torch.autograd.grad(ref, (q, k, v), do.transpose(1, 2))
            for cfg_t in (configs or (BWD_DET_CONFIGS if deterministic else BWD_CONFIGS))[d]:
                cfg = BwdConfig(*cfg_t)
                _force(bwd_ops, "bwd_config", cfg)
                try:
                    out = tileflash.flash_attn_func(q, k, v, causal=causal, softcap=softcap,
                                                    deterministic=deterministic)
                    grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    err = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref_grads))
                    ms = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                    tf = tflops(2.5 * attn_fwd_flops(b, h, s, s, d, causal), ms)
                    label = (f"d{d} {'causal' if causal else 'full'}{' softcap' if softcap else ''}"
                             f"{' det' if deterministic else ''} s={s}")
                    rows.append(["bwd", label, str(cfg_t), f"{tf:.1f} TFLOP/s ({_regs_and_spills()})", f"{err:.1e}"])
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a result
                    rows.append(["bwd", f"d{d} causal={causal}", str(cfg_t), "FAILED", repr(exc)[:60]])
                print(rows[-1], flush=True)
            bwd_ops.bwd_config = orig
    bwd_ops.bwd_config = orig


def quantized_caches(kh, vh, fmt):
    """bf16 caches [B, S, Hkv, D] as stored for fmt ("16bit", "fp8" with per-KV-head scales, "nvfp4"): (k_cache,
    v_cache, the scale keyword arguments of flash_attn_with_kvcache, dequantized K and V in fp32, bytes stored)."""
    if fmt == "16bit":
        return kh, vh, {}, kh.float(), vh.float(), kh.numel() * 4
    if fmt == "fp8":
        ks, vs = (x.float().abs().amax(dim=(0, 1, 3)) / 448.0 for x in (kh, vh))
        kc, vc = ((x.float() / s_[:, None]).to(torch.float8_e4m3fn) for x, s_ in ((kh, ks), (vh, vs)))
        kd, vd = ((x.float() * s_[:, None]) for x, s_ in ((kc, ks), (vc, vs)))
        return kc, vc, dict(k_scale=ks, v_scale=vs), kd, vd, kc.numel() * 2
    (kc, ks, kg), (vc, vs, vg) = tileflash.nvfp4_quantize(kh), tileflash.nvfp4_quantize(vh)
    kw = dict(k_scale=ks, v_scale=vs, k_global_scale=kg.reshape(1), v_global_scale=vg.reshape(1))
    kd, vd = tileflash.nvfp4_dequantize(kc, ks, kg), tileflash.nvfp4_dequantize(vc, vs, vg)
    return kc, vc, kw, kd, vd, 2 * (kc.numel() + ks.numel())


def _decode_inputs(b, ctx, fmt):
    hq, hkv, d = 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=BF16)
    kh, vh = (torch.randn(b, ctx, hkv, d, device="cuda", dtype=BF16) for _ in range(2))
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    kc, vc, kw, kd, vd, nbytes = quantized_caches(kh, vh, fmt)
    ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2),
                                         enable_gqa=True).transpose(1, 2)
    return q, kc, vc, lens, kw, ref, nbytes


def _paged(kc, vc, page, gen):
    """The contiguous caches [B, S, Hkv, D] as a pool of pages in a random order and its block table."""
    b, ctx = kc.shape[:2]
    n = b * ctx // page
    perm = torch.randperm(n, generator=gen).to(kc.device)
    pools = []
    for x in (kc, vc):
        pool = torch.empty((n, page, *x.shape[2:]), dtype=x.dtype, device=x.device)
        pool[perm] = x.reshape(n, page, *x.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], perm.to(torch.int32).view(b, ctx // page)


def sweep_decode(rows, fmts=("16bit", "fp8", "nvfp4"), shapes=DECODE_SHAPES, configs=DECODE_CONFIGS, page=None):
    orig = decode_ops.decode_config
    for fmt in fmts:
        for b, ctx in shapes:
            q, kc, vc, lens, kw, ref, nbytes = _decode_inputs(b, ctx, fmt)
            label = f"decode-{fmt}" + (f"-page{page}" if page else "")
            if page:
                kc, vc, kw["block_table"] = _paged(kc, vc, page, torch.Generator().manual_seed(0))
            for bn, w, st, tma, trans in configs:
                cfg = DecodeConfig(block_m=decode_block_m(4), block_n=bn, num_warps=w, num_stages=st, tma=tma,
                                   trans=trans)
                _force(decode_ops, "decode_config", cfg)
                try:
                    call = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **kw)  # noqa
                    err = (call().float() - ref).abs().max().item()
                    ms = bench_ms(graphed(call))
                    rows.append([label, f"b={b} ctx={ctx}", str((bn, w, st, tma, trans)),
                                 f"{ms * 1e3:.1f} us {nbytes / ms / 1e9:.2f} TB/s", f"{err:.1e}"])
                except Exception as exc:  # noqa: BLE001
                    rows.append([label, f"b={b} ctx={ctx}", str((bn, w, st, tma, trans)), "FAILED",
                                 repr(exc)[:60]])
                print(rows[-1], flush=True)
            del kc, vc
    decode_ops.decode_config = orig


def sweep_decode_small(rows, shapes=SMALL_SHAPES, configs=SMALL_CONFIGS, splits=SMALL_SPLITS):
    """Graph-replay time of each (config, forced split count); the row keeps the best count. A forced config keeps
    its format's split rule (decode_config's resident_per_sm) for count 0."""
    orig = decode_ops.decode_config
    for b, ctx, hq, hkv, fmt, *dim in shapes:  # an optional sixth entry: the head dim (default 128)
        d = dim[0] if dim else 128
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=BF16)
        kh, vh = (torch.randn(b, ctx, hkv, d, device="cuda", dtype=BF16) for _ in range(2))
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        kc, vc, kw, kd, vd, nbytes = quantized_caches(kh, vh, fmt)
        ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2),
                                             enable_gqa=True).transpose(1, 2)
        for cfg_t in configs[fmt]:
            bn, w, st, tma, trans, *more = cfg_t  # an optional sixth entry: the S/P-overlapped loop
            overlap = bool(more and more[0])
            cfg = dataclasses.replace(orig(d, hq // hkv, kv_format=fmt, kv_tokens=b * ctx * hkv), block_n=bn,
                                      num_warps=w, num_stages=st, tma=tma, trans=trans)
            _force(decode_ops, "decode_config", cfg)
            times, err = {}, 0.0
            try:
                for n in splits:
                    if b * hkv * n > 8 * 132 * 4:
                        continue
                    call = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,  # noqa: E731
                                                                     num_splits=n, sp_overlap=overlap, **kw)
                    err = max(err, (call().float() - ref).abs().max().item())
                    times[n] = bench_ms(graphed(call)) * 1e3
                best = min((t, n) for n, t in times.items())
                rows.append([f"{fmt}", f"b={b} ctx={ctx} {hq}/{hkv} d={d}", str(cfg_t),
                             f"best {best[0]:.1f} us @ {best[1]} ({nbytes / best[0] / 1e6:.2f} TB/s); "
                             + " ".join(f"{n}:{t:.1f}" for n, t in times.items()), f"{err:.1e}"])
            except Exception as exc:  # noqa: BLE001
                rows.append([f"{fmt}", f"b={b} ctx={ctx} {hq}/{hkv}", str(cfg_t), "FAILED",
                             repr(exc)[:60]])
            print(rows[-1], flush=True)
        del kc, vc, kh, vh
    decode_ops.decode_config = orig


def sweep_mla(rows, shapes=MLA_SHAPES, configs=MLA_CONFIGS, splits=MLA_SPLITS):
    """MLA decode (qv): graph-replay time per (tile config, forced split count), errors against the fp32 reference
    of the concatenated query and key; the row keeps the best count."""
    orig = decode_ops.mla_decode_config
    for hq, b, ctx in shapes:
        q, qv = (torch.randn(b, 1, hq, d, device="cuda", dtype=BF16) for d in (64, 512))
        kc, vc = (torch.randn(b, ctx, 1, d, device="cuda", dtype=BF16) for d in (64, 512))
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        n = min(b, 2)
        ref = F.scaled_dot_product_attention(torch.cat([q[:n], qv[:n]], -1).float().transpose(1, 2),
                                             torch.cat([kc[:n], vc[:n]], -1).float().transpose(1, 2),
                                             vc[:n].float().transpose(1, 2), enable_gqa=True).transpose(1, 2)
        nbytes = (kc.numel() + vc.numel()) * 2
        flops = 2 * b * hq * ctx * (576 + 512)
        block_m = decode_block_m(hq)
        for cfg_t in configs[block_m]:
            bn, w, st, trans = cfg_t
            _force(decode_ops, "mla_decode_config", DecodeConfig(block_m, bn, w, st, trans=trans))
            times, err = {}, 0.0
            try:
                for ns in splits:
                    if b * ns > 8 * 132 * 4:
                        continue
                    call = lambda: tileflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,  # noqa: E731
                                                                     num_splits=ns, qv=qv)
                    err = max(err, (call()[:n].float() - ref).abs().max().item())
                    times[ns] = bench_ms(graphed(call)) * 1e3
                t, ns = min((t, ns) for ns, t in times.items())
                rows.append(["mla", f"H={hq} b={b} ctx={ctx}", str(cfg_t),
                             f"best {t:.1f} us @ {ns} ({nbytes / t / 1e6:.2f} TB/s, {flops / t / 1e6:.0f} TFLOP/s); "
                             + " ".join(f"{k}:{v:.1f}" for k, v in times.items()), f"{err:.1e}"])
            except Exception as exc:  # noqa: BLE001
                rows.append(["mla", f"H={hq} b={b} ctx={ctx}", str(cfg_t), "FAILED", repr(exc)[:60]])
            print(rows[-1], flush=True)
        del kc, vc
    decode_ops.mla_decode_config = orig


def sweep_gemm(rows, shapes=GEMM_SHAPES, configs=GEMM_CONFIGS):
    """Eager and CUDA-graph times: at decode-sized M an eager call is bound by the host (Python checks and
    launches), so the graph column is the kernel's own speed."""
    orig = gemm_ops.gemm_config
    for m, nk in shapes:
        a = torch.randn(m, nk, device="cuda", dtype=BF16)
        w = torch.randn(nk, nk, device="cuda", dtype=BF16)
        data, scales, g = tileflash.nvfp4_quantize(w)
        ref = a.float() @ tileflash.nvfp4_dequantize(data, scales, g).T
        bf16_ms = bench_ms(lambda: a @ w.T)
        bf16_graph_ms = bench_ms(graphed(lambda: a @ w.T))
        for cfg_t in configs:
            if (m <= 16) != (cfg_t[0] == 16):
                continue
            _force(gemm_ops, "gemm_config", GemmConfig(*cfg_t))
            try:
                call = lambda: tileflash.nvfp4_matmul(a, data, scales, g)  # noqa: E731
                err = ((call().float() - ref).abs().max() / ref.abs().max()).item()
                ms, graph_ms = bench_ms(call), bench_ms(graphed(call))
                rows.append(["gemm", f"M={m} N=K={nk}", str(cfg_t),
                             f"{ms * 1e3:.1f} us eager ({bf16_ms / ms:.2f}x bf16), {graph_ms * 1e3:.1f} us graph "
                             f"({bf16_graph_ms / graph_ms:.2f}x bf16 graph {bf16_graph_ms * 1e3:.1f})", f"{err:.1e}"])
            except Exception as exc:  # noqa: BLE001
                rows.append(["gemm", f"M={m} N=K={nk}", str(cfg_t), "FAILED", repr(exc)[:60]])
            print(rows[-1], flush=True)
    gemm_ops.gemm_config = orig


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("families", nargs="*", default=["bwd", "decode", "gemm"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = []
    for fam in args.families:
        try:
            {"bwd": sweep_bwd, "decode": sweep_decode, "gemm": sweep_gemm,
             "bwd-d64": lambda r: sweep_bwd(r, dims=(64,)),
             "bwd-d128": lambda r: sweep_bwd(r, dims=(128,)),
             "bwd-d256": lambda r: sweep_bwd(r, dims=(256,)),
             "bwd-softcap": lambda r: sweep_bwd(r, dims=(128,), softcap=10.0),
             "bwd-det": lambda r: sweep_bwd(r, dims=(64, 128, 256), deterministic=True),
             "bwd-det-d64": lambda r: sweep_bwd(r, dims=(64,), deterministic=True),
             "bwd-16k": lambda r: sweep_bwd(r, seqlens=(16384,)),
             "bwd-rotate": lambda r: sweep_bwd(r, dims=(128, 256, 64), seqlens=(4096, 16384),
                                               configs=BWD_ROTATE_CONFIGS),
             "bwd-tma": lambda r: sweep_bwd(r, dims=(64, 128), seqlens=(4096, 16384), configs=BWD_TMA_CONFIGS),
             "gemm-small": lambda r: sweep_gemm(r, SMALL_M_SHAPES),
             "gemm-occupancy": lambda r: sweep_gemm(r, SMALL_M_SHAPES, GEMM_OCCUPANCY_CONFIGS),
             "decode-small": sweep_decode_small,
             "decode-mla": sweep_mla,
             "decode-mla-h128": lambda r: sweep_mla(r, [s for s in MLA_SHAPES if s[0] == 128]),
             "decode-mqa": lambda r: sweep_decode_small(r, MQA_SHAPES, MQA_CONFIGS, (0, 4, 8, 16, 33, 66)),
             "decode-d64": lambda r: sweep_decode_small(r, D64_SHAPES, D64_CONFIGS, (0, 1, 2, 4, 16, 33)),
             "decode-quant-small": lambda r: sweep_decode_small(r, QUANT_SMALL_SHAPES, QUANT_SMALL_CONFIGS,
                                                                (0, 1, 2, 4, 8, 16, 33, 66)),
             "decode-large": lambda r: sweep_decode_small(r, LARGE_SHAPES, LARGE_CONFIGS, (0, 1, 2, 4, 8)),
             "decode-quant-overlap": lambda r: sweep_decode_small(r, QUANT_WIDE_SHAPES, QUANT_OVERLAP_CONFIGS,
                                                                  (0, 1, 2, 4, 8, 33)),
             "decode-quant-wide": lambda r: sweep_decode_small(r, QUANT_WIDE_SHAPES, QUANT_WIDE_CONFIGS,
                                                               (0, 1, 2, 4, 8, 16, 33, 66)),
             "decode-quant": lambda r: sweep_decode(r, ("fp8", "nvfp4"), DECODE_SHAPES, QUANT_CONFIGS),
             "decode-paged-tma": lambda r: [sweep_decode(r, ("16bit", "fp8"), PAGED_TMA_SHAPES, PAGED_TMA_CONFIGS, page)
                                            for page in (64, 128)],
             "decode-page16-tma": lambda r: sweep_decode(r, ("16bit",), PAGE16_TMA_SHAPES, PAGE16_TMA_CONFIGS, 16),
             "decode-page16-stages": lambda r: sweep_decode(r, ("16bit",), PAGE16_TMA_SHAPES, PAGE16_STAGES_CONFIGS,
                                                            16),
             "decode-paged": lambda r: [sweep_decode(r, ("16bit",), PAGED_SHAPES, PAGED_CONFIGS, page)
                                        for page in (16, 64)]}[fam](rows)
        except Exception:  # noqa: BLE001 - keep the other families' results
            traceback.print_exc()
    print(format_table(["family", "shape", "config", "time", "err"], rows, title="config sweep (bf16, H200)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
