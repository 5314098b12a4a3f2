"""Prefill forward policy: the Triton forward's tiles, and whether (and with which tiles) the sm_90 Gluon forward
serves a call. Pure functions of shapes, masks and the target (tests/plan/test_plan.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import config
from .._utils import num_sms
from .target import (has_tma, mma_sync_target, tma_4d_ok, padded_head_dim, small_shared_memory, sm90_target,
                     tensor_memory)


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V through TMA tensor descriptors (when strides allow; else pointers)
    trans: bool = False  # transposed products: decode only (DecodeConfig)
    sp_overlap: bool = False  # QK^T of block j+1 issued before the softmax of block j (attn_inner's SP_OVERLAP)
    v_rows: bool = False  # FP8 attention: P V in fp16 over V as stored, as paged pools do (no V^T, no second acc)


@dataclass(frozen=True)
class Mask:
    """Normalised masking: causal is a right window of 0; -1 is unbounded. chunk > 0: FA3's attention_chunk (each
    query sees only its chunk of that many key positions; the Triton forward's CHUNK)."""
    window_left: int
    window_right: int
    softcap: float
    chunk: int = 0

    @staticmethod
    def make(causal: bool, window_size, softcap: float, chunk: int = 0) -> "Mask":
        left, right = window_size
        if causal:
            right = 0
        return Mask(left, right, float(softcap), int(chunk))

    @property
    def at_most_causal(self) -> bool:
        """No window but a causal one, no softcap, no chunks."""
        return self.window_left < 0 and self.window_right <= 0 and self.softcap == 0.0 and self.chunk == 0


# Non-causal d128 takes the one-warpgroup tile up to this many keys (sweep.py, run 36, TFLOP/s, 64x64 vs
# 128x128: s=1k 452 vs 394, 2k 470 vs 452, 4k 487 vs 483 (runs 31-32 at 4k: 493 vs 487, 524 vs 484), 8k 491 vs
# 496, 16k 498 vs 503): short rows of keys leave a 128-row program's prologue and epilogue exposed, which a second
# program per SM hides.
ONE_WARPGROUP_MAX_KEYS = 4096


def _fp8_fwd_config(d: int, causal: bool, seqlen_k: int, paged: bool) -> FwdConfig:
    """FP8 attention's tiles (run 139, `sweep prefill-fp8`, TFLOP/s, 16k tokens): one warpgroup over 128 keys per
    step, e4m3 tiles taking half the shared memory: d128 full 4k 643 vs 507 (64x64) and 320 (8 warps), causal 8k
    605 vs 491; d64 full 8k 491 vs 418 (128x64, 8 warps). d128 full past 4k keys keeps 128x128 on 8 warps (16k:
    634 vs 550). d256: 64x64 on one warpgroup 505 vs 441 (128x64, 8 warps, which spills). Paged pools (V rows,
    P V in fp16) step 64 keys: d128 chunked prefill, pages of 64 / 128 tokens, 480 vs 309 / 472 vs 327 (run 173;
    d64 not measured). d256 with 3 stages (run 189, 4k non-causal / causal, 16k): 474 / 417 / 497 vs 458 / 389 /
    492 with 2; both spill (the two-level P V holds two 64 x 256 fp32 tiles), 8 warps do not and run 345-417.
    Contiguous d256 multiplies P V in fp16 over V as stored, as paged pools do (one fp32 accumulator, no V^T, no
    spill on 128x64 over 8 warps; run 198, 4k / 16k / causal 4k: 510 / 528 / 413 vs 472 / 502 / 416); d64 / d128
    run 0.5-0.8x that way."""
    if paged and d <= 128:
        return FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=True)
    if d <= 128 and not (d == 128 and not causal and seqlen_k > ONE_WARPGROUP_MAX_KEYS):
        return FwdConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, tma=True)
    if d <= 128:
        return FwdConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, tma=True)
    if paged:
        return FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=True)
    return FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, tma=True, v_rows=True)


def fwd_config(head_dim: int, causal: bool = False, interpret: bool = False, seqlen_k: int = 2 ** 30,
               arch: int | None = 90, fp8: bool = False, paged: bool = False) -> FwdConfig:
    """Measured on the H200 (sweep.py, s=4096, bf16, 2026-11-30; TFLOP/s in brackets).
    seqlen_k: keys per sequence (varlen: the longest). Triton's warp specialisation of this loop measured no gain
    on sm_90 with triton 3.6 (within 1%) and was removed (the Gluon forward is the warp-specialised one).
    fp8: FP8 attention (e4m3 q, k, v; paged: over a page pool): _fp8_fwd_config. Off the H200 (compiled only):
    target_tiles."""
    d = padded_head_dim(head_dim)
    if fp8 and not interpret:
        return target_tiles(_fp8_fwd_config(d, causal, seqlen_k, paged), arch, sm10x_warps=True)
    if d <= 64 and causal and seqlen_k <= ONE_WARPGROUP_MAX_KEYS:
        # One warpgroup per program, as for d128 (run 48, `sweep.py --dims 64`, TFLOP/s, causal s = 2k / 4k / 16k):
        # 346.6 / 380.3 / 391.4 against 325.0 / 364.3 / 394.2 for 128x64 with pointers and 324.8 / 359.6 / 402.0
        # with TMA; a fourth stage 327.3 / 356.3 / 388.8; 64x32 296.0 / 310.0 / 330.2.
        cfg = FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=True)
    elif d <= 64:
        # 128x64 tiles, K/V through TMA (run 48, non-causal s = 2k / 4k / 16k): 409.4 / 409.5 / 423.7 against
        # 396.9 / 400.5 / 409.4 with pointers, 400.1 / 397.7 / 406.1 for 64x64 one-warpgroup tiles; 128x128 fell
        # to 331 / 292 (full / causal, s = 4k, session 1).
        cfg = FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, tma=True)
    elif d <= 128 and (causal or seqlen_k <= ONE_WARPGROUP_MAX_KEYS):
        # One warpgroup per program (64 rows, 64 keys per step, ~2 programs per SM: one program's softmax runs
        # while another's MMAs do): 448 vs 418 (128x128, TMA) and 399 (pointers) (run 18, one-FMA softmax).
        cfg = FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, tma=True)
    elif d <= 128:
        # TMA K/V: 490 vs 458 with pointers; 64x64 one-warpgroup tiles 479 (run 18).
        cfg = FwdConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, tma=True)
    elif d > 256:
        # V's head dim 512 (MLA's latent with FA3's qv, forward only): a 64 x 512 accumulator and qv tile. Compiled
        # only (sm_90, triton 3.6, --res-usage): 96 bytes of stack against 1.9-2.1 KB for the d256 tile, 304 with 64
        # keys a step, 1256 with 4 warps; never timed.
        cfg = FwdConfig(block_m=64, block_n=32, num_warps=8, num_stages=2, tma=True)
        if small_shared_memory(arch):  # 16 keys a step: the 32-key tile took 136 KB on sm_120 (99 KB; compiled only)
            cfg = FwdConfig(block_m=64, block_n=16, num_warps=8, num_stages=2, tma=True)
    else:
        # d = 256: a 128x128 S tile plus a 128x256 accumulator exceeds the register file; 3 stages exceed shared
        # memory. TMA: 524 vs 489.
        cfg = FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, tma=True)
        if small_shared_memory(arch):
            # Under 200 KB per block (compiled only): Q, K and V of 128 x 64 rows take 128 KB at one stage.
            cfg = FwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, tma=True)
    if interpret:
        # Small tiles keep the interpreter fast and put several KV blocks in short test sequences; K/V arrive the
        # GPU's way (TMA descriptors or pointers), so the CPU suite runs that load path too (a zero-row descriptor
        # once failed on the GPU only: tests/ops/test_regressions.py).
        return FwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, tma=cfg.tma and has_tma(arch))
    return target_tiles(cfg, arch)


def target_tiles(cfg, arch: int | None, sm10x_warps: bool = False):
    """A Triton attention tile (FwdConfig or DecodeConfig) for the compile target: 8 warps (and at most 2 stages)
    for a 64-row or larger tile of 4 on mma.sync targets, and pointers instead of TMA descriptors there
    (target.mma_sync_target, target.has_tma). sm10x_warps (decode, MLA and FP8 tiles): 8 warps for a tile of 4 on
    sm_10x too, whose tcgen05 accumulators pass through registers at every softmax step (4 warps spilled 24-416
    bytes there where sm_90 spilled none: the NVFP4 paged decode, FP8 paged prefill, MLA H=16; 16-bit prefill
    tiles did not, and one spilled 8 bytes with 8). Compiled for those targets on the CPU only, never timed."""
    if mma_sync_target(arch) and cfg.block_m >= 64 and cfg.num_warps == 4:
        # and at most 2 stages: with 3, ptxas held sm_120's 40-token extend at 128 registers and spilled 8 bytes
        cfg = replace(cfg, num_warps=8, num_stages=min(cfg.num_stages, 2))
    if sm10x_warps and tensor_memory(arch) and cfg.num_warps == 4:
        cfg = replace(cfg, num_warps=8)
    return cfg if has_tma(arch) else replace(cfg, tma=False)


@dataclass(frozen=True)
class WsFwdConfig:
    """The warp-specialised sm_90 forward (kernels/gluon/attn_fwd.py): 128 query rows per tile, always."""
    block_n: int  # keys per step
    k_stages: int  # K blocks in shared memory
    v_stages: int  # V blocks in shared memory
    persistent: bool = False  # one CTA per SM walking pairs of tiles, else one CTA per 128-row tile
    q_bufs: int = 1  # persistent: Q buffers per warpgroup (2: the next tile's Q loads a whole tile ahead)


WS_TILE_ROWS = 128  # query rows per tile of the warp-specialised forward (two warpgroups of 64)


def fwd_ws_config(head_dim: int, causal: bool, seqlen_k: int, head_dim_v: int | None = None,
                  fp8: bool = False) -> WsFwdConfig | None:
    """Whether prefill takes the warp-specialised forward, by shape (ws_forward_config adds what the
    tensors and masks allow), measured on the H200 (bf16, 16k tokens, 2048/d heads, TFLOP/s at s = 1k / 2k / 4k /
    8k / 16k, cuDNN in the same run; `ws_sweep.py`):
      d128 (128 keys, 3 + 3 stages): one CTA per tile full 511-610 vs cuDNN 567-622, causal 385-614 vs 418-553
           (run 107). Persistent CTAs (run 108) at 1k / 2k: full 522 / 624 vs 524 / 575, causal 394 / 492 vs
           386 / 481; at 4k-16k within noise or slower (causal 16k 579 vs 617: a static round robin of 1024 units
           over 132 CTAs leaves the last round three-quarters full).
      d64 (128 keys, 3 + 3): persistent at 1k / 2k / 4k (run 108) full 394 / 434 / 448 vs 364 / 420 / 439 with one
           CTA per tile, causal 292 / 369 / 405 vs 254 / 337 / 392 (and the one-warpgroup Triton tile that served
           causal rows <= 2048 keys: 285 / 340, run 58); 64-key steps (4 + 4 stages) ran slower everywhere.
           Two Q buffers per warpgroup (the next tile's Q a tile ahead, run 190): 1k 410.9 vs 401.7, causal 1k
           300.9 vs 291.5, causal 4k 427.0 vs 418.8, 2k 445.1 vs 442.6; d128 needs a K stage less for them and
           measured within noise (2 K stages + 2 Q buffers 555.8 / 404.5 / 597.4 / 505.0 vs 550.2 / 398.5 / 589.6 /
           496.1 at 1k / causal 1k / 2k / causal 2k).
      d256 (64 keys; the K and V rings have their own depth, run 107): 3 K + 2 V stages (224 KB of shared memory)
           full 569-650 vs cuDNN 628-662, causal 385-640 vs 444-596; 2 + 2 stages 576-691 / 429-609, taken at
           <= 1024 keys where the third K stage measured slower causal (385 vs 429); persistent CTAs mixed (run
           108: causal 1k 355 vs 436). The Triton kernel: 440-540 / 263-529. (Run 58, with one ring for K and V:
           465-520 / 347-515 at 2 stages, so not taken then.)
      d192 with V's head dim 128 (DeepSeek-V3's prefill; head_dim_v, else V's is q's): Q and K as 128 + 64
           columns (split_head_dim), 128 keys, 2 + 2 stages (208 KB), d128's persistent rule (H100, run 240,
           probe/ds_sweep.py, 16 heads, at 1k / 4k / 16k): full 551 / 639 / 677 vs cuDNN 516 / 588 / 616, causal
           420 / 566 / 650 vs 405 / 529 / 558; the Triton kernel (QK^T padded to 256) 296 / 366 / 346 and 227 / 314
           / 358. 64-key steps (3 + 3, 4 + 4, 3 + 2 stages) ran 5-15% slower; persistent CTAs won causal 4k (598
           vs 558) and lost at 16k (621 vs 687), as for d128.
    (Those rules were measured at 16k tokens, many waves of tiles; ws_forward_config keeps one CTA per tile
    wherever all tiles fit one wave: one_wave_rule.)
    Run-to-run spread of one kernel is up to 10% on these machines (run 108 timed one kernel twice: d64 full 8k
    452 / 407), so only gains seen at several lengths were taken. Other head dims would need padding inside the
    kernel, which it does not do."""
    if fp8:
        if head_dim_v not in (None, head_dim):
            return None
        if head_dim == 256:
            return None if causal and seqlen_k <= FP8_D256_TRITON_CAUSAL_KEYS else WsFwdConfig(64, 4, 4)
        if head_dim != 128 or seqlen_k < FP8_WS_MIN_KEYS:
            return None
        return WsFwdConfig(block_n=128, k_stages=4, v_stages=4)
    if head_dim_v not in (None, head_dim):
        if (head_dim, head_dim_v) == (192, 128):
            return WsFwdConfig(block_n=128, k_stages=2, v_stages=2, persistent=seqlen_k <= 2048)
        return None
    if head_dim == 128:
        return WsFwdConfig(block_n=128, k_stages=3, v_stages=3, persistent=seqlen_k <= 2048)
    if head_dim == 64:
        persistent = seqlen_k <= 4096
        return WsFwdConfig(block_n=128, k_stages=3, v_stages=3, persistent=persistent, q_bufs=2 if persistent else 1)
    if head_dim == 256:
        return WsFwdConfig(block_n=64, k_stages=3 if seqlen_k > 1024 else 2, v_stages=2)
    return None


# FP8 attention (e4m3 q, k, V^T; P through shared memory, each block's P V added into the fp32 acc) on the Gluon
# forward: d128 from 8k keys, 128 keys, 4 + 4 stages (H100, run 240: probe/fp8_sweep.py and fp8_sweep2.py, 16k
# tokens, TFLOP/s, Gluon vs the Triton FP8 kernel): 8k 764 vs 659 (causal 688 vs 669), 16k 765-770 vs 673-678
# (769-776 vs 722-735), 32k 762 vs 687 (796 vs 783); at 4k 714 vs 726 (581 vs 629) and 1k 472 vs 529. d64 lost
# everywhere (16k 487-496 vs 584, 1k 324 vs 458) and 64-key steps ran 10-20% slower. The needle test (65,536 keys,
# tests/ops/test_fp8_prefill.py) runs on it. What holds it back: P's shared-memory round trip each step, which a
# register P would keep as triton's conversion to the 8-bit A layout (benchmarks/NEXT.md).
FP8_WS_MIN_KEYS = 8192
# d256 FP8 on the Gluon forward (the block product P V in two 128-column parts, attn_fwd._add_part): 64 keys, 4 + 4
# stages (H100, runs 304-305, `sweep prefill-fp8-ws`, 16k tokens, 8 heads, TFLOP/s against the Triton FP8 kernel's
# fp16 P V over V as stored, which served it before): 1k 505.6 vs 429.1, 4k 731.5 vs 524.4, 16k 829.5 vs 526.2,
# causal 4k 563.6 vs 438.4, causal 16k 754.5 vs 528.8 (our bf16 d256 in the same call: 4k 669.6, 16k 658.9, causal
# 16k 683.0). 32-key steps (no stack under triton 3.6) ran 606.7 / 647.4 at 4k / 16k; 3 or 5 stages within 3% of 4
# (run 305). The 64-key tile holds 64-104 bytes of stack a thread under triton 3.6. Causal calls of at most
# FP8_D256_TRITON_CAUSAL_KEYS keys keep the Triton kernel (run 307, Triton vs Gluon: causal 512 243.6 vs 238.5, 1k
# 321.2 vs 299.9; causal 2k 386.1 vs 429.8, full 1k 429.5 vs 502.3).
FP8_D256_TRITON_CAUSAL_KEYS = 1024


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """(main, tail): the Gluon forward reads q's and k's columns as a power-of-two block and, past it, a narrower
    power-of-two tail (0: none), so a head dim of 192 multiplies 128 + 64 columns, not 256 with padding."""
    main = 1 << (head_dim.bit_length() - 1)
    return main, head_dim - main


def ws_call_ok(dtype: torch.dtype, mask: Mask, alibi: bool, fp8: bool = False) -> bool:
    """What both warp-specialised Gluon kernels (forward and dK/dV) need of a call beyond shapes and layouts: a
    16-bit dtype (or, fp8: the forward's e4m3), at most a causal mask (no left window, no softcap), no ALiBi (they
    have no bias) and an sm_90 target. A learnable sink is fine: the forward folds it in, the dK/dV kernel sees it
    only through the lse (the preprocess adds d sink)."""
    plain_mask = mask.window_left < 0 and mask.window_right in (-1, 0) and mask.softcap == 0.0 and mask.chunk == 0
    dtypes = (torch.float16, torch.bfloat16) + ((torch.float8_e4m3fn,) if fp8 else ())
    return plain_mask and not alibi and dtype in dtypes and sm90_target()


def ws_forward_config(q4, k4, v4, out4, softmax_scale: float, mask: Mask, max_seqlen_k: int | None = None,
                      alibi: bool = False, vt_gap: int = 0) -> WsFwdConfig | None:
    """The warp-specialised forward's tiles when it serves this call (sm_90, a shape fwd_ws_config takes, at most a
    causal mask, no ALiBi, a positive scale, TMA-addressable tensors), else None (the Triton kernel). max_seqlen_k:
    given for varlen batches (packed [1, total, H, D] tensors), which take one CTA per tile. FP8 (e4m3 q, k): only
    with V^T's wide gap (vt_gap, values_t_gap): a sequence's last key block then reads zeros past its end, never the
    next sequence's values, which a TMA box cannot mask (a NaN there would survive P = 0)."""
    fp8 = q4.dtype == torch.float8_e4m3fn
    if not (softmax_scale > 0 and ws_call_ok(q4.dtype, mask, alibi, fp8=True)):
        return None
    if fp8 and vt_gap < VALUES_T_WIDE_GAP:
        return None
    cfg = fwd_ws_config(q4.shape[3], mask.window_right == 0, k4.shape[1] if max_seqlen_k is None else max_seqlen_k,
                        head_dim_v=v4.shape[3], fp8=fp8)
    if cfg is not None and max_seqlen_k is None:
        cfg = one_wave_rule(cfg, q4.shape[0] * q4.shape[2] * -(-q4.shape[1] // WS_TILE_ROWS), num_sms(q4.device))
    cfg = config.chosen("fwd_ws", cfg)
    if cfg is None or not all(tma_4d_ok(t) for t in (q4, k4, v4, out4)):
        return None
    return cfg if max_seqlen_k is None else replace(cfg, persistent=False)


def one_wave_rule(cfg: WsFwdConfig, tiles: int, sms: int = 132) -> WsFwdConfig:
    """One CTA per tile where every tile gets its own SM at once (tiles <= sms), persistent CTAs only past that:
    a persistent CTA walks two tiles of a head (the heaviest with the lightest causal one), so one wave of them
    runs on half the SMs for the sum of two tiles' blocks, where one CTA per tile finishes with the heaviest
    (b=1 s=512 32 heads: 64 CTAs of 4 + 1 causal blocks, or 8 full ones, against 128 of at most 4). Run 249 (H100,
    graph replay, us, persistent -> one CTA a tile, cuDNN): d128 b=1 s=512 32 heads causal 18.2 -> 11.9 (12.9),
    full 21.7 -> 11.2 (12.5); s=256 causal 15.3 -> 9.0 (9.1); s=128 8.7 -> 6.8 (7.5); s=1024 16 heads causal
    23.5 -> 17.4 (19.0); s=2048 8 heads causal 35.5 -> 29.3 (31.9); d64 s=512 causal 13.9 -> 9.5 (9.9), full
    15.9 -> 9.2 (9.7). Past one wave the pairs win: s=1024 32 heads (256 tiles) 25.0 vs 31.3."""
    if cfg.persistent and tiles <= sms:
        return replace(cfg, persistent=False, q_bufs=1)
    return cfg


# FP8 attention's V^T keeps each sequence's columns this far apart when it can (launch/tensors.values_t_column):
# zeros then fill every sequence's last key block (BLOCK_N <= 128 keys, so at least BLOCK_N + 14 columns), whose V^T
# tile needs no mask (inner.FP8_V_T_ZEROS). The wide gap costs 144 columns of D x Hkv bytes per sequence, written
# by values_t_kernel: taken while that stays under a quarter of the tokens (mean length >= 576), else the narrow
# gap, which only keeps every sequence's first column 16-byte aligned.
VALUES_T_WIDE_GAP = 144
VALUES_T_GAP = 16


def values_t_gap(rows: int, seqs: int) -> int:
    """Columns per sequence in FP8 attention's V^T for `rows` key rows in `seqs` sequences."""
    return VALUES_T_WIDE_GAP if 4 * VALUES_T_WIDE_GAP * seqs <= rows else VALUES_T_GAP


def tma_tiles(cfg, page_size: int, nvfp4: bool) -> bool:
    """Whether K/V tiles are asked for through TMA descriptors (row_descriptors may still decline the layout):
    NVFP4 tiles are decoded from bytes, not loaded as values, and a paged tile must lie inside one page (page_size
    0: a contiguous cache). Otherwise K/V rows are gathered by pointers."""
    return cfg.tma and not nvfp4 and (page_size == 0 or page_size % cfg.block_n == 0)
