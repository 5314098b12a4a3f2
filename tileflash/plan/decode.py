"""Decode policy: pack-GQA tiles, MLA tiles, the register-operand quantized decode's tiles, and how many KV splits a
call takes. Pure functions of shapes and the SM count, never of tensor values, so decode calls can be captured in
CUDA graphs (tests/plan/test_plan.py)."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from .. import _utils, config
from .._utils import cdiv, next_pow2
from .prefill import fwd_config, target_tiles, tma_tiles
from .target import padded_head_dim, sm90_target, small_shared_memory, target_arch, tensor_memory, tma_aligned


@dataclass(frozen=True)
class DecodeConfig:
    block_m: int  # packed rows per program: (query heads of one KV group) x (new query tokens)
    block_n: int  # KV tokens per inner-loop step
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V through TMA tensor descriptors: contiguous caches, and page pools whose pages hold whole
    # tiles (page size a multiple of block_n; others, and NVFP4 caches, take pointers)
    trans: bool = False  # s^T = K q^T, acc^T += V^T P^T: KV tokens and head dim on the MMA's M side
    resident_per_sm: int = 0  # programs an SM holds at once when that limits splitting (0: it does not); splits
    fused_combine: bool = False  # split calls merge their splits in the attention launch (merge_tiles), no combine


def decode_block_m(group_rows: int) -> int:
    """Rows of one pack-GQA tile: next power of two of (Hq/Hkv * Sq), at least 16 (tl.dot's minimum M),
    at most 64 (larger groups take several M tiles)."""
    return min(64, max(16, next_pow2(group_rows)))


# (KV tokens per step at head dim 128, pipeline stages, trans, programs an SM holds when that limits splitting)
# by cache format; "-large" from LARGE_TILES_MIN_KV token-heads on. Measured on the H200 (config_sweep.py,
# CUDA-graph replay, 32/8 heads, d=128, 2026-11-30; notebook runs 7-18):
# - 16-bit contiguous: 64 tokens, plain products (b=8 ctx 32k 258 us; trans 261), 3 stages since run 279 (H200,
#   `sweep decode --vary num_stages=2,3,4`, graph replay, us, 2 -> 3 stages at the split rule's count, which stayed
#   the best at 3, run 281): GQA 32/8 b=1 ctx 8k 14.7 -> 14.2, ctx 16k 23.4 -> 23.0, ctx 32k 38.9 -> 37.6, b=4 ctx
#   8k 38.9 -> 37.6, b=64 ctx 1k 76.9 -> 65.2, b=128 ctx 1k 126.8 -> 123.9, b=256 ctx 2k 496.9 -> 468.0; MQA b=1 ctx
#   32k 10.5 -> 10.2, b=8 ctx 32k 40.6 -> 38.7 (b=1 ctx 8k 6.55 -> 6.66); d64 b=1 ctx 32k 24.5 -> 22.9, b=32 ctx 2k
#   37.7 -> 35.5, b=256 ctx 2k 251.6 -> 240.4; 4 stages lost everywhere. (Run 17 had 2 stages best with the kernel
#   of then; the H100 lost 1-2% with the third stage at 256 programs, run 255.) The long tile keeps 2 (b=1 ctx 128k
#   124.4 vs 130.4 with 3, b=8 ctx 32k 240.2 vs 241.7), and so do small paged caches ("16bit-paged", run 280: page
#   16 b=1 ctx 8k 16.4 vs 16.8, b=4 ctx 4k 26.3 vs 27.1, MQA b=8 ctx 8k 16.8 vs 17.4). Split launches of more than
#   two programs per SM (counts planned for three an SM, LONG_SPLIT_PROGRAMS_PER_SM) keep 2 stages too ("16bit-wide":
#   at 3 only two fit an SM, so a second, partial wave). Run 285 (H200, `bench decode` at f9d51c8,
#   graph replay, against run 276 at d0cdd6e with 2 stages; SDPA on each machine beside): b=1 ctx 128k (49 splits,
#   392 programs) 124.5 -> 132.9 us (SDPA 124.8 / 127.4), b=8 ctx 8k (6 splits, 384) 67.6 -> 72.9 (67.3 / 68.4), d64
#   b=8 ctx 8k 37.6 -> 41.4 (36.8 / 37.4), d64 b=1 ctx 128k 66.5 -> 71.9 (66.0 / 66.9); run 279's sweep had b=1 ctx
#   128k at 124.4 with 2 stages vs 130.4 with 3. Counts of two per SM rounded up keep 3 (run 280: d64 b=2 ctx 16k,
#   17 splits, 272 programs, 24.4 -> 23.3), and so do unsplit launches of several waves (b=64 ctx 1k, above).
# - 16-bit paged (pointer gathers), large: 128 tokens, 2 stages, one program per SM (128 KiB of stages): page 16
#   b=32 ctx 8k 262 us vs 322 with 64 tokens, b=64 ctx 4k 255 vs 315 (the contiguous cache: 255, 256). Small paged
#   caches keep 64-token steps ("16bit-paged"; b=1 ctx 8k: 24.7 us with 64-token steps, 26.1 with 128; runs 7, 9,
#   13).
# - fp8 and nvfp4: transposed products (s^T = K q^T on wgmma, the dequantized tile as the register operand), 3 stages:
#   fp8 b=32 ctx 8k 154 us vs 206 plain, b=256 ctx 2k 306 vs 366; nvfp4 b=256 ctx 2k 555 vs 749. Large caches step
#   128 tokens (two programs per SM: ~200 registers per thread), run 18 at each tile's best split count: fp8 b=8 ctx
#   32k 150.6 us vs 155.2 with 64 tokens, b=32 ctx 8k 145.9 vs 154.7, b=256 ctx 2k 288.4 vs 300.9; nvfp4 239.0 vs
#   263.6, 239.1 vs 264.9, 489.8 vs 499.6; 8 warps (two warpgroups per step) lost everywhere (165-992 us).
# - 16-bit paged, large, pages holding whole 64-token steps (read through TMA boxes): 64 tokens, 3 stages, one program
#   per SM (run 193, `sweep decode`, page 64, us): b=1 ctx 128k 129.3 vs 133.0 with the gather tile (contiguous
#   127.3), b=1 ctx 32k 39.6 vs 42.4, b=8 ctx 32k 248.6 vs 250.7; with 2 per SM 301.8 at b=8 ctx 32k. Page 16 (gathers)
#   keeps 128 tokens (132.4-133.4 either way at b=1 ctx 128k).
# - fp8 paged, large: 64 tokens unless a page holds whole 128-token TMA boxes. The 128-token step gathered by
#   pointers (pages of 16..64 tokens) keeps the widened tile in registers across 3 stages and spills: the sm_90
#   SASS of its loop (b=8 ctx 8k, page 16) holds 600 local loads and 600 local stores per step, 3313 instructions
#   per 128 tokens, against 802 per 64 tokens without spills at 64-token steps (page 64: TMA boxes, 441). Run 231
#   (H100, `sweep decode`, us, 64 / 128 tokens at each one's best split count, the planner's or 1, 2, 4): page 16
#   b=32 ctx 8k 210.8 / 216.4, b=128 ctx 1k 125.8 / 128.5; page 64 b=64 ctx 4k 214.8 / 224.5 (PAGED_FP8_MIN_SPLITS).
DECODE_TILES = {"16bit": (64, 3, False, 0), "16bit-paged": (64, 2, False, 0), "16bit-wide": (64, 2, False, 0),
                "16bit-long": (128, 2, False, 1),
                "16bit-paged-large": (128, 2, False, 1), "16bit-paged-tma-large": (64, 3, False, 1),
                "fp8": (64, 3, True, 4), "fp8-large": (128, 3, True, 2), "fp8-paged-large": (64, 3, True, 4),
                "nvfp4": (64, 3, True, 4), "nvfp4-large": (128, 3, True, 2)}


LARGE_TILES_MIN_KV = 2 ** 18  # tokens x KV heads (at d=128): b=1 ctx 32k and up


# 16-bit contiguous caches whose programs each stream this many tokens or more (after splitting) take twice the
# tokens per step ("16bit-long": 128 KiB of stages, one program per SM, so the split count fills whole waves).
# Run 20 (`config_sweep.py decode-large`, us, 128 vs 64 tokens per step at each one's best split count; tokens per
# program in brackets): b=32 ctx 8k 256.6 vs 262.6 (4096), b=64 ctx 4k 253.1 vs 259.0 (4096), b=8 ctx 32k 258.3 vs
# 262.8 (6554); shorter programs lose: b=8 ctx 8k 81.1 vs 79.6 (1638), b=256 ctx 2k 498.6 vs 490.5 (2048), b=128
# ctx 1k 137.9 vs 135.6 (1024).
LONG_PROGRAM_TOKENS = 4096


def decode_config(head_dim: int, group_rows: int, interpret: bool = False, kv_format: str = "16bit",
                  paged: bool = False, kv_tokens: int = 2 ** 30, tokens_per_program: int = 0,
                  arch: int | None = 90, page_size: int = 0, num_splits: int = 0,
                  three_per_sm: bool = False) -> DecodeConfig:
    """Tiles by cache format (DECODE_TILES; "16bit", "fp8", "nvfp4"), layout and size: contiguous caches are read
    through TMA descriptors, paged ones too when a page holds whole tiles (one box per tile, its row from the block
    table), otherwise by per-token pointer gathers (a TMA descriptor covers one strided box, not a page list).
    kv_tokens = batch x cache capacity x KV heads; caches of LARGE_TILES_MIN_KV or more take the "-large" tiles.
    tokens_per_program = cache capacity / KV splits (0: not known yet): 16-bit contiguous caches take the
    "16bit-long" tiles from LONG_PROGRAM_TOKENS on. arch: the compile target (prefill.target_tiles; below sm_90
    steps of at most 64 tokens). page_size: tokens per page of a paged cache (0: not known); large 16-bit pools
    whose pages hold whole "16bit-paged-tma-large" steps take those. num_splits: KV splits (0: not known yet), for
    fused_combine (fused_combine_rule, with the cache's bytes from kv_tokens and kv_format; never for pages read by
    pointer gathers, see MAX_MERGE_LOADS). three_per_sm: the split count plans three programs per SM (more splits
    than two per SM would need, LONG_SPLIT_PROGRAMS_PER_SM): a contiguous 16-bit cache's short tile is "16bit-wide"."""
    block_m = decode_block_m(group_rows)
    fused = fused_combine_rule(num_splits, min(block_m, group_rows), padded_head_dim(head_dim),
                               kv_tokens * head_dim * 2 * KV_ELEMENT_BYTES[kv_format])
    if interpret:  # small steps; K/V through TMA descriptors as on the GPU (NVFP4 caches, and pages smaller than
        # a step, take pointers)
        return DecodeConfig(block_m=block_m, block_n=16, num_warps=4, num_stages=1, tma=True, fused_combine=fused)
    d = padded_head_dim(head_dim)
    key = kv_format
    if kv_tokens * d >= LARGE_TILES_MIN_KV * 128:  # the "-paged-large" tiles where a format has them, else "-large"
        large = [f"{kv_format}-paged-large"] * paged + [f"{kv_format}-large"]
        key = next((k for k in large if k in DECODE_TILES), kv_format)
    if key == "16bit" and paged:
        key = "16bit-paged"
    elif key == "16bit" and tokens_per_program >= LONG_PROGRAM_TOKENS:
        key = "16bit-long"
    elif key == "16bit" and three_per_sm:
        key = "16bit-wide"
    tma_step = _step_tokens(DECODE_TILES["16bit-paged-tma-large"][0], d)
    if key == "16bit-paged-large" and page_size and page_size % tma_step == 0:  # pages hold whole TMA boxes
        key = "16bit-paged-tma-large"
    if key == "fp8-paged-large" and page_size and fp8_pages_hold_boxes(page_size, d):
        key = "fp8-large"
    tokens, stages, trans, resident = DECODE_TILES[key]
    block_n = _step_tokens(tokens, d)
    if arch is not None and arch < 90 and block_n > 64:  # pointer gathers, no TMA: 128-token steps spilled on sm_80
        block_n //= 2
    resident *= tokens * 128 // (block_n * d)
    cfg = target_tiles(DecodeConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=stages, tma=True,
                                    trans=trans, resident_per_sm=resident, fused_combine=fused), arch,
                       sm10x_warps=True)
    if fused and paged and not tma_tiles(cfg, page_size, kv_format == "nvfp4"):  # gathers: the combine launch
        cfg = dataclasses.replace(cfg, fused_combine=False)
    return cfg


def fp8_pages_hold_boxes(page_size: int, d: int) -> bool:
    """Whether pages of page_size tokens hold whole 128-token TMA boxes of an FP8 cache at (padded) head dim d:
    the "fp8-large" tile reads them; smaller pages take "fp8-paged-large"'s 64-token steps."""
    return page_size % _step_tokens(DECODE_TILES["fp8-large"][0], d) == 0


def _step_tokens(tokens: int, d: int) -> int:
    """Tokens per step at head dim d (padded) for a DECODE_TILES entry of `tokens` at d=128: K+V bytes per step
    held constant across head dims (d=64 at 64 tokens per step ran 0.71-0.93x the peer); below 64 a step holds
    fewer bytes and registers, and an SM proportionally more programs."""
    return tokens * 128 // d if d >= 64 else 2 * tokens


# MLA decode (qv; a latent of up to 512 that is both V and most of the key, DeepSeek-V2/V3): (tile rows, KV tokens per
# step, warps, stages, programs an SM holds, transposed products) by the pack-GQA rows decode_block_m gives. The [rows,
# 512] fp32 accumulator takes two warpgroups at 64 rows; qv stays in shared memory. Pointer loads (a TMA box spans at
# most 256 elements). Run 125 (`config_sweep.py decode-mla`, graph replay, us at the best split count / at the split
# rule's): 64 rows (H=128) b=32 ctx 4k 155.9 with 64-token 2-stage steps vs 181.8-292.4 for 16/32-token steps or 1
# stage, b=1 ctx 32k 60.4 (at 66 splits: one 221 KB program per SM, hence resident 1; the rule's 132 ran 84.0), b=128
# ctx 1k 154.3; 16 rows (H=16) with 64 tokens, 4 warps, 2 stages: b=32 ctx 4k 59.8, b=1 ctx 32k 29.9, b=8 ctx 32k 95.2
# at the rule's count (best of six configs within 4-11%: 8 warps 3 stages took b=32 57.7 at 4 splits, but 103.1 at b=8).
# 32 rows take the 16-row steps (not measured).
MLA_TILES = {16: (16, 64, 4, 2, 0, False), 32: (32, 64, 4, 2, 0, False), 64: (64, 64, 8, 2, 1, False)}
# FP8 latents on the Triton kernel (which serves the FP8 calls the Gluon ones decline: 64 rows, whose seesaw reads
# 16-bit caches only, and calls with the Triton kernel's extras), as MLA_TILES. At most 32 rows take
# 16-row tiles in 128-token steps: half the bytes of a 16-bit step. Run 266 (H100, `sweep decode-mla --shapes
# 8,32768,16,fp8 128,4096,16,fp8`, graph replay, us): H=16 b=8 ctx 32k 104.6 vs 126.2 with MLA_TILES's, b=128 ctx 4k
# 183.1 vs 232.6 (3 stages 103.8 / 183.3, 64 tokens at 3 stages 106.0 / 190.8, 8 warps 108.4 / 191.0). Runs 269-270
# (`--shapes 32,4096,32,fp8 8,32768,32,fp8 128,4096,32,fp8 --vary block_m=16,32 block_n=64,128 ...`): H=32 as two
# 16-row tiles 99.8 / 177.4 / 343.8 us vs 156.7 / 269.5 / 512.3 at MLA_TILES's 32-row tile (32 rows at 128 tokens
# 126.1 / 206.8; 8 warps or 3 stages within 1%). 64 rows (H=64 lost as 16-row tiles: b=32 ctx 4k 163.0 vs 135.9,
# b=8 ctx 32k 319.0 vs 245.9) step 32 tokens transposed (s^T = K q^T, the dequantized tile as wgmma's register
# operand) in 3 stages, whose sm_90 compile holds 104-128 bytes of stack a thread where every untransposed tile
# spilled ~1.2 KB. Runs 268-269 (`--shapes 32,4096,128,fp8 1,32768,128,fp8 128,1024,128,fp8 --vary trans=1
# block_n=32,64 num_stages=2,3,4 num_warps=4,8`): 244.5 / 74.8 / 245.2 us vs 252.2 / 80.8 / 270.5 untransposed
# (2 stages 261.4 / 79.5 / 274.6; 64 tokens 434-464; 4 warps 244-1001). 16 rows at 128 tokens lost there too
# (311.8 / 87.0).
MLA_FP8_TILES = {16: (16, 128, 4, 2, 0, False), 32: (16, 128, 4, 2, 0, False), 64: (64, 32, 8, 3, 1, True)}


def mla_decode_config(group_rows: int, interpret: bool = False, arch: int | None = 90,
                      fp8: bool = False) -> DecodeConfig:
    """MLA's pack-GQA tiles: decode_block_m rows (16..64) with MLA_TILES's steps, or for FP8 latents (fp8)
    MLA_FP8_TILES's tile. Off the H200 (compiled on the CPU,
    never timed): sm_10x takes 32-token steps at 64 rows (Blackwell's MMA keeps its operands in shared memory,
    where the 64-token tile needed 281 KB), and targets with under 200 KB of shared memory per block take 16-row
    tiles (a 64-row tile's qv alone is 64 KB) of 32 tokens."""
    block_m = decode_block_m(group_rows)
    if interpret:
        return DecodeConfig(block_m=block_m, block_n=16, num_warps=4, num_stages=1)
    if small_shared_memory(arch):
        return target_tiles(DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=2), arch, sm10x_warps=True)
    block_m, block_n, warps, stages, resident, trans = (MLA_FP8_TILES if fp8 else MLA_TILES)[block_m]
    if tensor_memory(arch) and block_m == 64:
        block_n = 32
    return target_tiles(DecodeConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                                     trans=trans, resident_per_sm=resident), arch, sm10x_warps=True)


MLA_GLUON_ROWS = 64  # the seesaw's query rows per CTA (wgmma's M)


# The sm_90 Gluon MLA decode (kernels/gluon/mla_decode.py, FlashMLA's seesaw): 64-token blocks in two buffers
# (72 KB each; q and qv 72 KB), the only shape its schedule takes (the kernel asserts it). Run 211 (H100, `bench
# decode --only mla-h`, graph replay, us, vs the 32-token 4-stage ring kernel before it): H=128 b=1 ctx 4k 17.1 vs
# 20.5, b=32 ctx 4k / 16k 96.8 / 302.2 vs 100.9 / 327.0, b=128 ctx 1k / 4k 100.7 / 312.2 vs 108.8 / 338.7; H=16
# b=128 ctx 1k 61.0 vs 67.8, b=32 ctx 4k 72.5 vs 62.8, other H=16 rows within 3%.
@dataclass(frozen=True)
class MlaGluonConfig:
    block_n: int = 64
    stages: int = 2
    rows: int = MLA_GLUON_ROWS  # query rows per CTA: 64 the seesaw, 8 / 16 / 32 the narrow kernel (mla_gluon_rows)
    ahead: bool = False  # the narrow kernel on e4m3 caches: block j + 1 widened while block j's P V runs

    @property
    def narrow(self) -> bool:  # kernels/gluon/mla_decode_narrow.py, else the seesaw (mla_decode.py)
        return self.rows != MLA_GLUON_ROWS

    @property
    def split_block(self) -> int:  # tokens a split's share is counted in: the seesaw's warpgroups alternate blocks
        return self.block_n * (1 if self.narrow else 2)


# Run 149 (session 25: S_{j+1} issued before the softmax of step j; `bench decode --only mla` and `sweep
# decode-mla-gluon`, graph replay, us, Gluon vs the Triton MLA kernel): H=128 b=1 ctx 4k / 32k 19.3 / 38.0 vs 20.9 /
# 56.2, b=32 ctx 4k / 16k 95.1 / 318.1 vs 151.7 / 538.8, b=128 ctx 1k / 4k 103.0 / 329.5 vs 146.7 / 518.5, page 64
# b=32 ctx 4k 95.6 vs 165.4; H=16 (16 rows of the 64-row tile) b=1 ctx 32k 21.6 vs 23.4, b=8 ctx 32k 87.9 vs 87.7,
# b=32 ctx 4k 49.7 vs 51.3, b=128 ctx 4k 160.4 vs 180.3 (run 146, before the change, H=16 had been 0.93-1.06x).
# Run 151 (`bench decode --only mla-h16`, H=16 on it by default): 1.01-1.09x the Triton kernel but at b=8 ctx 32k
# (0.94x; page 64 0.92x; the sweeps of runs 149-150 had it at 0.97-1.00x there). Since run 217 calls of 8 to 15
# rows take the narrow kernel too (below); fewer rows (not measured) keep the Triton kernel's 16-row tile.
MLA_GLUON_MIN_ROWS = 8
MLA_ROPE_DIM, MLA_LATENT_DIM = 64, 512  # the Gluon MLA decode's head dims (DeepSeek-V2/V3, Kimi K2)


# The narrow kernel's 16-row tiles against the seesaw's 64 (run 214, H100, `sweep decode-mla-gluon --vary
# rows=16,32,64`, graph replay over cache copies, us): H=16 b=1 ctx 32k 22.5 vs 25.9, b=32 ctx 4k 60.1 vs 63.6, b=8
# ctx 32k 110.4 vs 113.2, b=128 ctx 4k 203.9 vs 206.1; H=32 (two 16-row tiles, the second reading the blocks the
# first brought into L2) b=32 ctx 4k 61.5 vs 66.3 at 32 rows and 67.7 at 64, b=8 ctx 32k 111.2 vs 115.0 / 117.2.
# More rows (H=64, or H=16 x 4 tokens) keep the seesaw (not measured narrow). H=8 (Kimi K2 at tensor parallel 8;
# run 217, H100, `sweep decode-mla-gluon --vary rows=8,16`, us, against the Triton kernel's 16-row tile then the
# default): b=1 ctx 32k 20.4 / 20.9 vs 26.0, b=8 ctx 32k 108.4 / 108.3 vs 116.9, b=128 ctx 4k 202.0 / 202.1 vs 230.6:
# the narrow kernel on 8-row tiles (wgmma's N = 8, half the tensor work of 16).
MLA_NARROW_MAX_ROWS = 32
MLA_NARROW_ROWS = (8, 16)  # tile heights the planner picks: the smallest that holds a sequence's rows
# FP8 caches (each CTA widens every block it reads to fp16, so a second 16-row tile widens them again): H=32 as one
# 32-row tile, run 273 (H100, `sweep decode-mla-gluon --shapes 8,32768,16,fp8 128,4096,16,fp8 32,4096,32,fp8
# 8,32768,32,fp8 --vary rows=16,32`, graph replay, us): b=32 ctx 4k 61.7 vs 90.7 as two 16-row tiles, b=8 ctx 32k
# 109.8 vs 172.0; H=16 keeps 16 rows (b=8 ctx 32k 89.4 vs 106.8 at 32, b=128 ctx 4k 169.0 vs 191.9). Against the
# Triton kernel's FP8 tiles (MLA_FP8_TILES; `bench decode --only mla-h16-fp8`, run 273): H=16 b=8 ctx 32k 89.6 vs
# 103.0, b=128 ctx 4k 172.0 vs 183.4.
MLA_FP8_NARROW_ROWS = (8, 16, 32)
# e4m3 caches on 8- and 16-row tiles widen block j + 1 while block j's P V runs (MlaGluonConfig.ahead; 220 KB of
# shared memory at 16 rows, so not the 32-row tile). Run 282 (H100, `sweep decode-mla-gluon --vary ahead=0,1`, graph
# replay over cache copies, us, off -> on): H=16 b=128 ctx 4k 168.5 -> 158.1, b=8 ctx 32k 89.2 -> 87.4, b=32 ctx 4k
# 50.1 -> 49.1, b=1 ctx 32k 20.7 -> 20.1; H=8 b=128 ctx 4k 155.9 -> 146.8.
MLA_FP8_AHEAD_MAX_ROWS = 16


def mla_gluon_rows(rows: int, fp8: bool = False) -> int:
    """Query rows per CTA of the Gluon MLA decode for calls of `rows` (Sq x H) rows per sequence: the narrow
    kernel's 8- or 16-row tiles up to MLA_NARROW_MAX_ROWS (two or more 16-row tiles above 16; FP8 caches one
    32-row tile: MLA_FP8_NARROW_ROWS), else the seesaw's 64."""
    if rows > MLA_NARROW_MAX_ROWS:
        return MLA_GLUON_ROWS
    tiles = MLA_FP8_NARROW_ROWS if fp8 else MLA_NARROW_ROWS
    return next((t for t in tiles if rows <= t), tiles[-1])


def mla_gluon_config(q, k_cache, v_cache, block_table, extras: bool, plain_mask: bool) -> MlaGluonConfig | None:
    """The Gluon MLA decode's tiles when it serves an MLA (qv) call, else None (the Triton decode kernel): at least
    MLA_GLUON_MIN_ROWS query rows per sequence (Sq x H; config can force it for fewer), an sm_90 target, 16-bit
    caches in q's dtype or (the narrow kernel's tiles only) e4m3 caches, a 64-wide rotary key and a 512-wide
    latent, no mask beyond causal and no softcap (plain_mask), none of the Triton kernel's extras
    (cache_batch_idx, cache_leftpad, rotary, ALiBi, learnable_sink), a contiguous cache or pages of 8..32 tokens
    or a multiple of the step, and rows TMA can read: 16-byte aligned bases and strides, unit stride along the
    head dim, a cache's batch (or page) stride its tokens' (rows of one [rows, D] view)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if (extras or not plain_mask or not sm90_target() or q.dtype not in (torch.bfloat16, torch.float16)
            or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn) or v_cache.dtype != k_cache.dtype
            or k_cache.shape[-1] != MLA_ROPE_DIM or v_cache.shape[-1] != MLA_LATENT_DIM or k_cache.shape[2] != 1):
        return None
    rows = q.shape[1] * q.shape[2]
    tile = mla_gluon_rows(rows, fp8)
    cfg = config.chosen("mla_gluon", MlaGluonConfig(rows=tile, ahead=fp8 and tile <= MLA_FP8_AHEAD_MAX_ROWS)
                        if rows >= MLA_GLUON_MIN_ROWS else None)
    if cfg is None or (fp8 and not cfg.narrow):  # the seesaw reads 16-bit caches only
        return None
    page = k_cache.shape[1]
    if block_table is not None and not (page in (8, 16, 32) and page <= cfg.block_n or page % cfg.block_n == 0):
        return None
    for t in (k_cache, v_cache):
        rows_merge = t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)
        rows = t.shape[0] * t.shape[1]
        if not (rows_merge and tma_aligned(t, dims=(1,)) and 0 < rows < 2 ** 31):
            return None
    return cfg


MAX_SPLITS = 256


# Small paged caches read by per-token pointer gathers (pages shorter than a step) aim at three programs per SM
# instead of two: shorter programs, each of whose first K/V loads waits on its block-table entries. Run 48
# (`splits_sweep.py`, graph replay, 32/8 heads, b=1 ctx 8k, us): page 16 22.9 at 48 splits (3 of the 128 blocks per
# split, as at the rule's 50), 23.3 at 33 and 40 (4 blocks), 24.6 at 66 (2); the contiguous cache 20.9 at 33 (21.3 at
# 48), page 64 (TMA boxes) 21.6 at 33 (21.8 at 48). `bench decode` (run 50): 23.2 against 23.5 in run 42, a gain
# near the run-to-run spread.
GATHER_PROGRAMS_PER_SM = 3


# Long splits of a contiguous 16-bit cache aim at three programs per SM (as many as its 64-token tiles let an SM hold
# at two stages; at three, since run 279, two: the counts were kept, run 281 found none better), rounded down,
# instead of two rounded up. Run 105 (graph replay, read flush, 32/8 heads, us, the
# former count then this one, two timings each): b=1 ctx 128k 135.8 / 135.7 at 33 splits vs 128.8 / 129.6 at 49;
# b=2 ctx 32k 73.8 / 73.7 at 17 vs 71.4 / 71.5 at 24; b=4 ctx 32k 137.4 / 137.2 at 9 vs 129.4 / 129.7 at 12; b=8
# ctx 8k 71.8 / 71.9 at 5 vs 70.8 / 71.0 at 6; d=64 b=1 ctx 128k 75.3 vs 70.0. Splits of <= SHORT_SPLIT_TOKENS keep
# the nearest count at two per SM: b=1 ctx 8k and b=4 ctx 8k tied, b=1 ctx 32k ran 41.7 / 41.6 at 33 vs 41.2 / 41.3.
LONG_SPLIT_PROGRAMS_PER_SM = 3


MIN_SPLIT_TOKENS = 512  # shorter caches are not split


# Paged FP8 caches on the 64-token tiles ("fp8-paged-large": pages that hold no whole 128-token box) take at least
# two splits where each is MIN_SPLIT_TOKENS or longer, even when the batch alone fills every SM. Run 231 (`sweep
# decode`, H100, graph replay, 32/8 heads d128, us at 1 -> 2 splits): page 64 b=64 ctx 4k 241.0 -> 214.8, page 16
# b=32 ctx 8k 239.0 -> 210.8, page 16 b=128 ctx 1k 133.0 -> 125.8 (4 splits: 218.9 / 218.6 / 140.5; the 128-token
# gather tile at its best count 224.5 / 216.4 / 128.5); run 232: page 16 b=256 ctx 2k 493.4 -> 424.1. Not the
# contiguous cache's 128-token tile (run 232: b=64 ctx 4k 194.2 at 1 split, 203.3 at 2).
PAGED_FP8_MIN_SPLITS = 2


SHORT_SPLIT_TOKENS = 1024  # splits this short or shorter are not worth rounding the program count up for


# Contiguous 16-bit caches whose batch x KV heads x M tiles already fill WHOLE_CACHE_MIN_WAVE of the SMs (at most one
# wave): one program per sequence-head streams the whole cache with a stage more, instead of splitting it (sm_90).
# Run 255 (H100, `sweep decode`, graph replay over copies past the L2, us, the split rule's count at 2 stages vs one
# split at 3): MQA b=128 ctx 1k (128 programs) 29.8 vs 27.4, its d64 17.9 vs 15.9, GQA b=16 ctx 4k (128) 96.0 vs
# 91.5; b=12 ctx 4k (96) 74.4 vs 74.2; 64 programs gained too (b=8 ctx 8k 95.7 vs 90.6, ctx 32k 354.6 vs 344.3, MQA
# b=64 ctx 4k 53.1 vs 49.4), but 32 lost (b=4 ctx 8k 50.9 vs 67.2: too few SMs to pull HBM's rate, ~50 GB/s each);
# the H200's 4.8 TB/s needs ~96 SMs at that rate, hence three quarters of them. At 256 programs (one split
# already) the third stage lost 1-2%.
WHOLE_CACHE_MIN_WAVE = 0.75
WHOLE_CACHE_STAGES = 3  # the long tile's 2 and a stage more (the short tile has 3 of its own)


def whole_cache_programs(programs: int, sms: int) -> bool:
    """Whether programs (batch x KV heads x M tiles) take one split each with a stage more (WHOLE_CACHE_MIN_WAVE)."""
    return WHOLE_CACHE_MIN_WAVE * sms <= programs <= sms


COMBINE_TILE = 4096  # fp32 partials per combine program: 32 registers per thread at 4 warps


def combine_tiles(num_splits: int, head_dim_pad: int) -> tuple[int, int]:
    """(splits per load, head-dim columns per program) of the split-KV combine: every split of a row in one load
    (one memory round trip), the head dim cut so the [splits, columns] tile stays at COMBINE_TILE values."""
    split_chunk = max(2, min(next_pow2(num_splits), COMBINE_TILE // 16))
    return split_chunk, max(16, min(head_dim_pad, COMBINE_TILE // split_chunk))


MERGE_TILE = 8192  # fp32 partials per load of the fused merge: 64 registers a thread at 4 warps, in the epilogue


# The fused merge's limits: eager calls only (captured ones take the combine launch: launch/direct.Counters). The merge
# trades GPU time for host time: the last split of a tile merges alone after every other has finished, ~3-5 us a load
# (run 217, torch.profiler, H100: b=1 ctx 8k 32/8 heads, 33 splits in 3 loads, attention kernel 27.0 us fused vs 14.5 +
# 4.9 for attention + combine; MQA b=8 ctx 8k, 33 splits in 5 loads, 41.1 vs 14.8 + 2.3), so it pays only where the
# host's time for the call (~30-50 us eager) covers the attention and the merge's tail: a small cache (at most
# MERGE_MAX_KV_BYTES of capacity: a plan sees shapes, not cache_seqlens) in a few loads. Measured fused against the
# combine launch (run 217, eager wall time): b=1 ctx 8k 32/8 heads (32 MiB, 3 loads) 33.0 vs 38.7 us. Past the limits,
# eager calls against graph replays with the combine launch (`bench decode`, runs 228 and 232; the eager side also pays
# the host's time, as SDPA's, which costs 13-14 us more eager than replayed there): MQA b=1 ctx 8k (4 MiB, 16 loads)
# 71.4 / 71.1 vs 6.9, MQA b=8 ctx 8k (32 MiB, 5 loads) 52.6 vs 17.6, GQA b=1 ctx 32k (128 MiB, 3 loads) 70.8 vs 51.7 and
# ctx 128k (4 loads) 205.7 vs 181.9. The paged 16 + append row of `bench host` (32 MiB, 50 splits in 4 loads) keeps the
# merge. Run 200's `sweep decode --vary fused_combine=0,1`, which had set 16 loads, timed graph replays that both took
# the combine launch.
MAX_MERGE_LOADS = 4
MERGE_MAX_KV_BYTES = 32 << 20
# Paged caches read by pointer gathers (pages shorter than a step; three programs per SM, so more splits to merge)
# take the combine launch: run 282 (H100, probe/fused_merge_host_ab.py, eager wall per call, us, merge fused -> the
# combine launch) page 16 b=1 ctx 8k 32/8 heads d128 over cache copies past the L2 32.1 -> 24.9 (warm 25.5 -> 25.0);
# TMA-read pages (64) 27.7 -> 26.4 cold but 24.9 -> 26.0 warm, contiguous d64 23.4 -> 30.9: those keep the merge.
# Cache bytes per K or V value (NVFP4: 4 bits, and an e4m3 scale per 16)
KV_ELEMENT_BYTES = {"16bit": 2, "fp8": 1, "nvfp4": 0.5625}


def merge_tiles(rows: int, head_dim_pad: int) -> tuple[int, int]:
    """(rows, splits) per load of the fused merge (kernels/triton/combine.merge_tile_splits) of a tile of `rows`
    rows: every row at once where MERGE_TILE allows, at least two splits per load. Not a function of the split
    count, so the kernel's variants are not either (a load's unused splits are masked)."""
    merge_rows = min(next_pow2(rows), max(1, MERGE_TILE // (2 * head_dim_pad)))
    return merge_rows, MERGE_TILE // (merge_rows * head_dim_pad)


def fused_combine_rule(num_splits: int, rows: int, head_dim_pad: int, kv_bytes: float) -> bool:
    """Whether a split call of the Triton decode kernel merges its splits itself (the last split of a tile to
    finish), saving the combine's launch: where the cache holds at most MERGE_MAX_KV_BYTES (kv_bytes: K and V at
    the cache's capacity) and the merge takes at most MAX_MERGE_LOADS loads."""
    if num_splits <= 1 or kv_bytes > MERGE_MAX_KV_BYTES:
        return False
    merge_rows, merge_splits = merge_tiles(rows, head_dim_pad)
    return cdiv(rows, merge_rows) * cdiv(num_splits, merge_splits) <= MAX_MERGE_LOADS


def num_splits_heuristic(batch: int, nheads_kv: int, m_tiles: int, max_seqlen_k: int, block_n: int,
                         num_sms: int, resident_per_sm: int = 0, per_sm: int = 2, long_per_sm: int = 0) -> int:
    """How many programs share one sequence's KV.

    Without splitting there are batch*Hkv*m_tiles programs; at batch 1 that is 8 on a 132-SM GPU, which is how the
    sm_90 peer ends up at 0.4 TB/s. Split until about per_sm programs per SM are in flight, each split at least one
    block long; caches under MIN_SPLIT_TOKENS are not split (the combine's launch would cost more than the blocks
    a split saves). Measured (splits_sweep.py --lengths, graph replay, H200, run 38): MQA (8/1 heads) at
    b=1 gains down to one-block splits: ctx 8k 11.5 us at 128 splits vs 15.6 at 32 (the former 256-token floor), 16k
    12.8 at 256 vs 15.6, 32k 15.5 at 256 vs 17.4, 64k/128k unchanged at 256 (21.3 / 32.1); GQA (32/8 heads) b=1 ctx
    8k 20.8 at 33 vs 21.6 at 32, ctx 32k 49.6 at 33 (48.5 at 64), b=8 ctx 32k 262.5 at 5 (259.8 at 8).
    The SM target is rounded up as far as the splits stay longer than SHORT_SPLIT_TOKENS, and never below the
    nearest count (run 37, `--small`): b=32 ctx 2k (256 programs) 78.5 us at 1 split vs 79.4 at 2, d=64 48.1 vs 50.2, MQA
    b=256 ctx 2k 78.8 vs 80.8, MQA b=128 ctx 1k 32.7 at 2 vs 34.4 at 3; long splits keep the count rounded up (b=32
    ctx 8k 260.3 at 2 vs 265.6 at 1, run 9; b=8 ctx 8k 80.0 at 5 vs 81.2 at 4, run 38).
    long_per_sm (0: per_sm): when the splits are longer than SHORT_SPLIT_TOKENS, as many as long_per_sm programs
    per SM hold (rounded down) if that is more; plan.decode.split_plan asks 3 for contiguous 16-bit caches, whose tiles
    an SM holds three of (LONG_SPLIT_PROGRAMS_PER_SM).
    resident_per_sm (how many programs of the tile an SM holds; 0: more than per_sm, so not limiting): never more
    than per_sm programs per SM (rounding the count up would put a few programs into one more wave, each costing a
    whole program's time: fp8 64-token tiles at b=8 ctx 32k ran 9 splits = 576 programs for 528 slots in 191.4 us,
    8 splits in 155.5, runs 17-18); 128-token fp8 tiles (two per SM), run 18: b=8 ctx 32k 150.6 us at 4 splits
    (8: 154.4), b=32 ctx 8k 145.9 at 1 (2: 153.7). When an SM holds fewer than per_sm (one program per SM: the
    paged 128-token tiles), the count is lowered until the programs fill at least 90% of whole waves (or kept when
    no count does): b=8 ctx 32k ran 5 splits = 320 programs in 2.4 waves at 332 us against the contiguous cache's
    259 (run 12), 4 splits 260 (run 13).
    """
    base = batch * nheads_kv * m_tiles
    if base == 0:  # an empty batch launches nothing
        return 1
    by_length = cdiv(max_seqlen_k, block_n) if max_seqlen_k >= MIN_SPLIT_TOKENS else 1
    if not resident_per_sm:
        target = per_sm * num_sms
        nearest = (2 * target + base) // (2 * base)  # target / base rounded to the nearest count
        long_count = max(cdiv(target, base), long_per_sm * num_sms // base)
        # Up to long_count while the splits stay longer than SHORT_SPLIT_TOKENS, else the nearest count: each
        # term falls with the batch, so more sequences never get more splits each (the former either/or, judged at
        # one count and then taking another, gave b=5 9 splits against b=4's 8 at 32/8 heads ctx 8k).
        splits = max(nearest, min(long_count, (max_seqlen_k - 1) // SHORT_SPLIT_TOKENS))
        return max(1, min(splits, by_length, MAX_SPLITS))
    splits = max(1, min(per_sm * num_sms // base, by_length, MAX_SPLITS))
    if resident_per_sm < per_sm:
        wave = resident_per_sm * num_sms
        for n in range(splits, 0, -1):
            if base * n >= 0.9 * cdiv(base * n, wave) * wave:
                return n
    return splits


def nonempty_splits(splits: int, blocks: int) -> int:
    """The split count without empty splits: the kernels give each split cdiv(blocks, splits) blocks, which can
    cover the blocks before the last splits (66 splits of 512 blocks: 64 of 8, two of none), and an empty split
    still writes a partial the combine reads. Run 263 (H100, one process, MLA b=1, old -> new count): the combine
    6.6-6.8 -> 5.2-5.5 us at H=128 (66 -> 64 splits), 3.3 -> 2.7 at H=16 (132 -> 128), the kernel unchanged; graph
    replay ctx 16k 30.7 -> 29.2 us, 128k 92.1 -> 90.2, H=16 ctx 32k 24.1 -> 23.4. MLA's counts only: the 16-bit
    decode lost with it (run 264, graph replay: GQA 32/8 b=1 ctx 8k 17.5-18.0 us at 33 splits, one empty, vs
    19.1-19.2 at 32; MQA b=8 ctx 8k 17.9-18.1 vs 19.5). Not the combine's columns per program (run 265, H100: at a
    fixed count, 16..512 columns ran the MLA combine in 5.3-5.4 us at H=128, 2.7 at H=16, the graph replays within
    1%): the MLA gain is the empty splits and 66 splits' load padded to 128; the 16-bit difference is unexplained."""
    return cdiv(blocks, cdiv(blocks, splits)) if splits > 1 and blocks > 0 else splits


@dataclass(frozen=True)
class QuantDecodeConfig:
    """Tiles of the register-operand quantized-cache decode (kernels/gluon/decode_mma.py): tokens per warp per
    step, warps per program (each its own tokens) and the programs an SM is meant to hold (the split target)."""
    block_n: int
    num_warps: int
    programs_per_sm: int

    @property
    def step(self) -> int:  # tokens per program per loop trip
        return self.block_n * self.num_warps


QUANT_MMA_HEAD_DIMS = (64, 128)  # d256's 16 x 256 fp32 accumulator per warp spills (CPU compile)


QUANT_MMA_MAX_ROWS = 16  # one mma.sync M tile of query rows (Hq/Hkv x Sq)


# Measured on the H200 (decode_quant_sweep.py, graph replay of the whole call, 32/8 heads, d=128, us;
# notebook runs 89 and 93; variants (tokens per warp step, programs per SM), all with q in shared memory and the
# transposed PV product):
# - NVFP4, (32, 2) vs (16, 3): b=1 ctx 8k 19.0 vs 21.7, ctx 32k 32.6 vs 36.8, ctx 128k 80.4 vs 97.8, b=32 ctx 2k 45.9
#   vs 50.1; but b=8 ctx 8k 60.6 vs 52.1, ctx 32k 175.0 vs 157.2, b=128 ctx 1k 94.0 vs 86.4, b=256 ctx 2k 292.6 vs
#   278.4 (b=32 ctx 8k, b=64 ctx 4k within 0.3%). The Triton kernel: 20.2, 43.1, 128.2, 69.7, 71.8, 241.0, 137.5,
#   490.3. So (16, 3) from QUANT_MMA_SMALL_STEP_PROGRAMS sequence-heads on, except short caches (b=32 ctx 2k:
#   two splits of 1k put 512 programs into 1.3 waves of 396), which keep (32, 2).
# - FP8: within +-5% of the Triton kernel at every shape at its best variant (b=1 ctx 8k 19.8 vs 18.2, b=8 ctx 32k
#   143.6 vs 149.0, b=64 ctx 4k 142.3 vs 148.5, b=128 ctx 1k 92.2 vs 90.0), so FP8 caches keep the Triton kernel;
#   the register kernel's FP8 path stays for the sweep and its tests.
QUANT_MMA_SMALL_STEP_PROGRAMS = 64


QUANT_MMA_SMALL_STEP_MIN_TOKENS = 4096  # shorter caches take the small steps only from ...


QUANT_MMA_SMALL_STEP_SHORT_PROGRAMS = 1024  # ... this many sequence-heads (b=128 ctx 1k: no split either way)


def quant_decode_config(head_dim: int, kv_format: str, programs: int, capacity: int) -> QuantDecodeConfig | None:
    """The register-operand decode's tiles for an "nvfp4" cache (it has no FP8 path) with programs = batch x KV
    heads and capacity tokens per sequence, or None where the Triton kernel (decode_config) serves the call."""
    if kv_format != "nvfp4" or head_dim not in QUANT_MMA_HEAD_DIMS:
        return None
    if programs >= QUANT_MMA_SMALL_STEP_PROGRAMS and (capacity >= QUANT_MMA_SMALL_STEP_MIN_TOKENS or
                                                       programs >= QUANT_MMA_SMALL_STEP_SHORT_PROGRAMS):
        return QuantDecodeConfig(block_n=16, num_warps=4, programs_per_sm=3)
    return QuantDecodeConfig(block_n=32, num_warps=4, programs_per_sm=2)


def cache_capacity(k_cache, block_table) -> int:
    """Tokens a sequence's KV cache holds: its pages (block_table [B, max_pages]), or the contiguous cache's length."""
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


# More new query tokens than this per sequence (an extend / chunked prefill through flash_attn_with_kvcache) take
# the prefill tiles, one query head per program and no split, instead of pack-GQA decode tiles.
MAX_DECODE_TOKENS = 16


KV_FORMATS = {torch.float8_e4m3fn: "fp8", torch.uint8: "nvfp4"}  # cache dtype -> format; others are 16-bit


def split_plan(q, k_cache, block_table, num_splits: int, mla: bool = False):
    """(config, num_splits, capacity) from shapes only: the tile, the split count, then the tile again knowing how
    many tokens each program streams. mla: MLA's tiles (qv; mla_decode_config)."""
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    rows = sq * (hq // hkv)
    capacity = cache_capacity(k_cache, block_table)
    sms = _utils.num_sms(q.device)
    if mla:  # a 64-row tile fills an SM: one wave of splits at most (run 125: a second ran 84.0 us vs 60.4, its
        # extra partials being [rows, 512] fp32 each)
        cfg = config.chosen("mla_decode", mla_decode_config(rows, _utils.is_interpreter(), target_arch(),
                                                            fp8=k_cache.dtype == torch.float8_e4m3fn))
        return cfg, num_splits or nonempty_splits(
            num_splits_heuristic(b, hkv, _utils.cdiv(rows, cfg.block_m), capacity, cfg.block_n, sms,
                                 cfg.resident_per_sm, per_sm=cfg.resident_per_sm or 2),
            cdiv(capacity, cfg.block_n)), capacity
    tiles = functools.partial(decode_config, d, rows, _utils.is_interpreter(),
                              kv_format=KV_FORMATS.get(k_cache.dtype, "16bit"), paged=block_table is not None,
                              kv_tokens=b * capacity * hkv, arch=target_arch(),
                              page_size=k_cache.shape[1] if block_table is not None else 0)

    # the 64-token paged FP8 tiles (decode_config), on any target
    fp8_small_pages = (block_table is not None and k_cache.dtype == torch.float8_e4m3fn
                       and not fp8_pages_hold_boxes(k_cache.shape[1], padded_head_dim(d)))

    def count(cfg):  # the asked count, else the heuristic's for this tile
        if num_splits:
            return num_splits
        gathers = (block_table is not None and not cfg.resident_per_sm
                   and not tma_tiles(cfg, k_cache.shape[1], k_cache.dtype == torch.uint8))
        splits = num_splits_heuristic(b, hkv, _utils.cdiv(rows, cfg.block_m), capacity, cfg.block_n, sms,
                                      cfg.resident_per_sm, per_sm=GATHER_PROGRAMS_PER_SM if gathers else 2,
                                      long_per_sm=LONG_SPLIT_PROGRAMS_PER_SM if block_table is None else 0)
        if fp8_small_pages and capacity >= PAGED_FP8_MIN_SPLITS * MIN_SPLIT_TOKENS:
            splits = max(splits, PAGED_FP8_MIN_SPLITS)
        return splits

    cfg = config.chosen("decode", tiles())
    splits = count(cfg)
    m_tiles = _utils.cdiv(rows, cfg.block_m)
    if (splits > 1 and not num_splits and block_table is None and k_cache.dtype not in KV_FORMATS
            and sm90_target() and whole_cache_programs(b * hkv * m_tiles, sms)):
        whole = tiles(tokens_per_program=capacity, num_splits=1)
        return config.chosen("decode", dataclasses.replace(whole, num_stages=WHOLE_CACHE_STAGES)), 1, capacity
    two_per_sm = num_splits_heuristic(b, hkv, m_tiles, capacity, cfg.block_n, sms)  # without the long-split rule

    def split_tiles(n):  # the tile for n splits, knowing what each streams and how many programs an SM is to hold
        return tiles(tokens_per_program=capacity // n, num_splits=n, three_per_sm=n > two_per_sm)

    long_cfg = config.chosen("decode", split_tiles(splits))
    if dataclasses.replace(long_cfg, fused_combine=cfg.fused_combine) != cfg:  # another tile: count again (never
        recount = count(long_cfg)  # more splits than before: its programs may fill an SM sooner)
        if recount != splits:
            long_cfg = config.chosen("decode", split_tiles(recount))
        splits = recount
    return long_cfg, splits, capacity


def combine_pdl(block_table) -> bool:
    """Whether the split combine is a programmatic dependent launch of the attention kernel (sm_90; its launch then
    overlaps the attention's tail): for contiguous caches, where it was timed (notebook, session 14, run 102:
    -0.5 to -1.2 us at batch 1, neutral from b=8). Paged caches are slower with it (run 107, `benchmarks/
    splits_sweep.py --pdl --flush-read`: page 16 b=8 ctx 8k 79.1 vs 74.7 us, page 64 b=1 ctx 32k 46.5 vs 44.7).
    Every split attention kernel lets it start at once (griddepcontrol.launch_dependents first); the Gluon MLA
    kernels' trigger (session 66) is not yet timed: `sweep decode-mla-gluon --vary combine_pdl=0,1`."""
    return block_table is None


def decode_after_prior() -> bool:
    """Whether the decode kernel (the Triton kernel, or the Gluon MLA kernels) is launched as a programmatic dependent
    of the kernel before it on the stream (sm_90): its programs start during that kernel's tail and wait
    (griddepcontrol.wait) before reading anything, and the split combine lets the next call's kernel start once its
    own programs have (LET_NEXT). Run 285 (H200, probe/after_prior_ab.py, graph replay of back-to-back calls over cache
    copies past the L2, us, off -> on, outputs bitwise equal): GQA 32/8 d128 b=1 ctx 8k 14.45 -> 13.94, ctx 32k 38.37
    -> 38.07, page 16 b=1 ctx 8k 16.35 -> 16.00, MQA b=1 ctx 8k 6.66 -> 6.07; b=8 ctx 8k 73.1 -> 73.0 and b=64 ctx 1k
    66.5 -> 66.3 (neutral). MLA, run 287 (H100, probe/mla_after_prior_ab.py, the same timing): H=16 b=1 ctx 32k 21.8 ->
    20.9, H=128 b=1 ctx 32k 37.5 -> 37.0 (mean of two), b=32 ctx 4k and H=16 b=32 / b=128 within 1%. The register-
    operand NVFP4 decode (qcfg) is launched plainly."""
    return sm90_target()


def quant_mma_config(q, k_cache, v_cache, block_table, capacity: int, sp_overlap: bool, extras: bool):
    """The register-operand decode's tiles (kernels/gluon/decode_mma.py) when it serves this call, else None: a
    cache quant_decode_config takes on sm_90, at most 16 query rows per KV head, a contiguous cache or
    power-of-two pages, 16-byte aligned K/V rows with equal K and V strides (it reads rows as 16-byte words), and
    the plain loop (sp_overlap=True asks for the Triton kernel's S/P-overlapped loop). extras (cache_batch_idx,
    cache_leftpad, rotary, ALiBi, learnable_sink): only the Triton kernel has them."""
    if k_cache.dtype != torch.uint8 or q.shape[3] not in QUANT_MMA_HEAD_DIMS:  # NVFP4 only; d256 would spill
        return None
    cfg = config.chosen("quant_decode", quant_decode_config(q.shape[3], "nvfp4", q.shape[0] * k_cache.shape[2],
                                                           capacity))
    if cfg is None or sp_overlap or extras or not sm90_target():
        return None
    if q.shape[1] * (q.shape[2] // k_cache.shape[2]) > QUANT_MMA_MAX_ROWS:
        return None
    page = k_cache.shape[1]
    if block_table is not None and page & (page - 1):
        return None
    aligned = all(t.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in t.stride()[:3]) for t in (k_cache, v_cache))
    return cfg if aligned and k_cache.stride() == v_cache.stride() else None


@dataclass(frozen=True)
class DecodeSchedule:
    """What a decode call launches, from shapes alone (so a plan can hold it): the register-operand kernel's
    tiles (qcfg) or the Triton kernel's (cfg: decode tiles, or prefill tiles when `prefill`), the split count, and
    the fp32 workspace it needs (split partials, and the lse when the caller does not take it)."""
    cfg: object
    qcfg: object
    num_splits: int
    capacity: int
    s_new: int
    pdl: bool
    workspace: int
    prefill: bool = False
    max_seqlen_q: int = 0  # > 0: q is packed [total_q, Hq, D] with cu_seqlens_q (FA3's varlen queries)
    varlen_new: bool = False  # k, v are packed [total_new, Hkv, D] with cu_seqlens_k_new (s_new is then 0)
    mla: bool = False  # qv given: MLA's tiles, V (and out) v_cache's head dim wide
    mcfg: object = None  # MlaGluonConfig: the Gluon MLA decode serves the call (cfg is then None)
    counters: int = 0  # int32 arrival counters of the fused merge (cfg.fused_combine): one per attention tile
    fused_append: bool = False  # the attention programs append k, v themselves (append_in_kernel): one launch less
    after_prior: bool = False  # the decode kernel is a programmatic dependent of the kernel before it


def append_in_kernel(k_cache, k, v, cfg, rows: int, plain_append: bool) -> bool:
    """Whether the Triton decode kernel's programs append the new tokens k, v [B, Snew, Hkv, D] themselves instead
    of a kv_append launch: 16-bit k, v into a cache of their dtype (a copy) or an FP8 cache (quantized with the
    cache's scales, bit for bit as kv_append does; NVFP4 caches and rotated keys take the append kernel),
    plain_append (no rotary tables, no cache_leftpad, and no left window: the programs' key ranges then cover every
    new token, which a left window narrower than the append would not), pack-GQA tiles of one M tile (rows =
    Hq/Hkv x Sq <= cfg.block_m: one program per KV head and split reads each position, so it writes what it reads),
    k and v of equal strides."""
    return (plain_append and k is not None and k.dtype in (torch.float16, torch.bfloat16)
            and k_cache.dtype in (k.dtype, torch.float8_e4m3fn) and v.dtype == k.dtype
            and v.stride()[:3] == k.stride()[:3] and rows <= cfg.block_m)


def decode_schedule(q, k_cache, v_cache, k, block_table, num_splits: int, sp_overlap: bool, lse_in_workspace: bool,
              extras: bool = False, causal_tiles: bool = False, max_seqlen_q: int = 0,
              varlen_new: bool = False, mla: bool = False, plain_mask: bool = False, v=None,
              plain_append: bool = False) -> DecodeSchedule:
    """causal_tiles: the mask has a right bound (prefill tiles differ for causal calls). max_seqlen_q > 0: packed
    queries, which take the prefill tiles (their rows are ragged: no pack-GQA tile or split partial layout).
    mla: qv is given (its calls are checked to be decode-sized: at most MAX_DECODE_TOKENS, not ragged).
    plain_mask: no window beyond causal and no softcap (what the Gluon MLA decode takes). v, plain_append: the new
    values and whether the append is a plain copy (append_in_kernel)."""
    hq = q.shape[-2]
    dv = v_cache.shape[-1] if mla else q.shape[-1]  # the partials' width
    s_new = k.shape[1] if k is not None and not varlen_new else 0
    capacity = cache_capacity(k_cache, block_table)
    rows = q.shape[:-1].numel()
    if hq == 0:  # nothing to attend with: only the append launches
        return DecodeSchedule(None, None, 1, capacity, s_new, False, 0, varlen_new=varlen_new)
    if max_seqlen_q or q.shape[1] > MAX_DECODE_TOKENS:
        cfg = config.chosen("fwd", fwd_config(q.shape[-1], causal=causal_tiles, interpret=_utils.is_interpreter(),
                                              seqlen_k=capacity, arch=target_arch()))
        return DecodeSchedule(cfg, None, 1, capacity, s_new, False, rows if lse_in_workspace else 0, prefill=True,
                              max_seqlen_q=max_seqlen_q, varlen_new=varlen_new)
    b = q.shape[0]
    cfg = None
    qcfg = None if mla else quant_mma_config(q, k_cache, v_cache, block_table, capacity, sp_overlap, extras)
    mcfg = mla_gluon_config(q, k_cache, v_cache, block_table, extras, plain_mask) if mla else None
    if mcfg is not None:  # one CTA of 160-225 KB per SM: one wave of splits at most, the seesaw's of whole block
        # pairs (its warpgroups alternate blocks: b=1 ctx 4k would otherwise take 64 one-block splits)
        num_splits = num_splits or nonempty_splits(
            num_splits_heuristic(b, 1, cdiv(q.shape[1] * hq, mcfg.rows), capacity, mcfg.split_block,
                                 _utils.num_sms(q.device), resident_per_sm=1, per_sm=1),
            cdiv(capacity, mcfg.split_block))
    elif qcfg is not None:
        num_splits = num_splits or num_splits_heuristic(b, k_cache.shape[2], 1, capacity, qcfg.step,
                                                        _utils.num_sms(q.device), per_sm=qcfg.programs_per_sm)
    else:
        cfg, num_splits, _ = split_plan(q, k_cache, block_table, num_splits, mla)
    workspace = (num_splits * rows * (dv + 1) if num_splits > 1 else 0) + (rows if lse_in_workspace else 0)
    pdl = config.chosen("combine_pdl", combine_pdl(block_table))
    counters, fused_append = 0, False
    if cfg is not None:
        hkv = k_cache.shape[2]
        rows_per_kv = q.shape[1] * (hq // hkv)
        if cfg.fused_combine and num_splits > 1:
            counters = b * hkv * cdiv(rows_per_kv, cfg.block_m)
        fused_append = bool(s_new) and not mla and append_in_kernel(k_cache, k, v, cfg, rows_per_kv, plain_append)
    after_prior = qcfg is None and decode_after_prior() and config.chosen("decode_after_prior", True)
    return DecodeSchedule(cfg, qcfg, num_splits, capacity, s_new, pdl, workspace,
                          varlen_new=varlen_new, mla=mla, mcfg=mcfg, counters=counters, fused_append=fused_append,
                          after_prior=after_prior)
