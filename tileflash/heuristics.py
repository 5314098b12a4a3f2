"""Pure-Python launch choices: tile shapes, warps, pipeline depth, number of KV splits.

Everything here is a function of shapes and the SM count only (never of tensor values), so decode calls can be
captured in CUDA graphs. Each choice is unit-tested as a table in tests/test_heuristics.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ._utils import cdiv, next_pow2


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V through TMA tensor descriptors (when strides allow; else pointers)
    trans: bool = False  # transposed products: decode only (DecodeConfig)
    sp_overlap: bool = False  # QK^T of block j+1 issued before the softmax of block j (attn_inner's SP_OVERLAP)


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
    # then fill whole waves of resident_per_sm x SMs programs


@dataclass(frozen=True)
class BwdConfig:
    dkdv_block_m: int  # query rows per step of a dK/dV program
    dkdv_block_n: int  # keys owned by a dK/dV program (K, V, dK, dV stay in registers)
    dq_block_m: int  # query rows owned by a dQ program
    dq_block_n: int  # keys per step of a dQ program
    dkdv_warps: int
    dkdv_stages: int
    dq_warps: int
    dq_stages: int
    atomic_dq: bool = True  # dQ added up by the dK/dV programs (fp32 atomics) unless deterministic=True asks otherwise
    rotate: bool = False  # without a right mask bound, dK/dV programs start their query blocks at staggered blocks
    tma: bool = False  # dK/dV programs read unmasked Q/dO blocks through TMA descriptors (power-of-two head dims)


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


def padded_head_dim(d: int) -> int:
    """Head dims are padded inside the kernel to a power of two (>= 16, the smallest tl.dot K)."""
    return max(16, next_pow2(d))


# Non-causal d128 takes the one-warpgroup tile up to this many keys (benchmarks/sweep.py, run 36, TFLOP/s, 64x64 vs
# 128x128: s=1k 452 vs 394, 2k 470 vs 452, 4k 487 vs 483 (runs 31-32 at 4k: 493 vs 487, 524 vs 484), 8k 491 vs
# 496, 16k 498 vs 503): short rows of keys leave a 128-row program's prologue and epilogue exposed, which a second
# program per SM hides.
ONE_WARPGROUP_MAX_KEYS = 4096


def fwd_config(head_dim: int, causal: bool = False, interpret: bool = False, seqlen_k: int = 2 ** 30,
               arch: int | None = 90) -> FwdConfig:
    """Measured on the H200 (benchmarks/sweep.py, s=4096, bf16, 2026-11-30; TFLOP/s in brackets).
    seqlen_k: keys per sequence (varlen: the longest). Triton's warp specialisation of this loop measured no gain
    on sm_90 with triton 3.6 (within 1%) and was removed (the Gluon forward is the warp-specialised one)."""
    d = padded_head_dim(head_dim)
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
        # once failed on the GPU only: tests/test_regressions.py).
        return FwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, tma=cfg.tma)
    return cfg


@dataclass(frozen=True)
class WsFwdConfig:
    """The warp-specialised sm_90 forward (kernels/attn_fwd_ws.py): 128 query rows per tile, always."""
    block_n: int  # keys per step
    k_stages: int  # K blocks in shared memory
    v_stages: int  # V blocks in shared memory
    persistent: bool = False  # one CTA per SM walking pairs of tiles, else one CTA per 128-row tile


def fwd_ws_config(head_dim: int, causal: bool, seqlen_k: int) -> WsFwdConfig | None:
    """Whether prefill takes the warp-specialised forward, by shape (ops/_launch.ws_forward_config adds what the
    tensors and masks allow), measured on the H200 (bf16, 16k tokens, 2048/d heads, TFLOP/s at s = 1k / 2k / 4k /
    8k / 16k, cuDNN in the same run; `benchmarks/ws_sweep.py`):
      d128 (128 keys, 3 + 3 stages): one CTA per tile full 511-610 vs cuDNN 567-622, causal 385-614 vs 418-553
           (run 107). Persistent CTAs (run 108) at 1k / 2k: full 522 / 624 vs 524 / 575, causal 394 / 492 vs
           386 / 481; at 4k-16k within noise or slower (causal 16k 579 vs 617: a static round robin of 1024 units
           over 132 CTAs leaves the last round three-quarters full).
      d64 (128 keys, 3 + 3): persistent at 1k / 2k / 4k (run 108) full 394 / 434 / 448 vs 364 / 420 / 439 with one
           CTA per tile, causal 292 / 369 / 405 vs 254 / 337 / 392 (and the one-warpgroup Triton tile that served
           causal rows <= 2048 keys: 285 / 340, run 58); 64-key steps (4 + 4 stages) ran slower everywhere.
      d256 (64 keys; the K and V rings have their own depth, run 107): 3 K + 2 V stages (224 KB of shared memory)
           full 569-650 vs cuDNN 628-662, causal 385-640 vs 444-596; 2 + 2 stages 576-691 / 429-609, taken at
           <= 1024 keys where the third K stage measured slower causal (385 vs 429); persistent CTAs mixed (run
           108: causal 1k 355 vs 436). The Triton kernel: 440-540 / 263-529. (Run 58, with one ring for K and V:
           465-520 / 347-515 at 2 stages, so not taken then.)
    Run-to-run spread of one kernel is up to 10% on these machines (run 108 timed one kernel twice: d64 full 8k
    452 / 407), so only gains seen at several lengths were taken. Other head dims would need padding inside the
    kernel, which it does not do."""
    if head_dim == 128:
        return WsFwdConfig(block_n=128, k_stages=3, v_stages=3, persistent=seqlen_k <= 2048)
    if head_dim == 64:
        return WsFwdConfig(block_n=128, k_stages=3, v_stages=3, persistent=seqlen_k <= 4096)
    if head_dim == 256:
        return WsFwdConfig(block_n=64, k_stages=3 if seqlen_k > 1024 else 2, v_stages=2)
    return None


# Varlen batches through the warp-specialised Gluon kernels (attn_fwd_ws.py / attn_bwd_ws.py VARLEN): compiled for
# sm_90 on the CPU (session 16) but not yet run on a GPU, so off; tests/test_prefill_ws.py and test_backward_ws.py
# switch it on for their varlen cases. Until it is on, varlen calls take the Triton kernels.
GLUON_VARLEN = False


@dataclass(frozen=True)
class WsBwdConfig:
    """The warp-specialised sm_90 dK/dV kernel (kernels/attn_bwd_ws.py): 128 keys per CTA, always."""
    block_m: int  # query rows per step
    num_stages: int  # Q/dO stages in shared memory
    atomic_dq: bool  # dQ added up by the kernel (TMA reduce-adds into fp32) unless deterministic=True asks otherwise
    # The dQ tile's reduce-add waits for the P/dS fence at the end of the step instead of a fence of its own right
    # after its store (one fence and barrier fewer per step; the reduce-add leaves later).
    one_fence: bool = True
    # S^T = K Q^T instead of S = Q K^T (FA3's SdP_swapAB): P^T and dS^T feed the dV and dK products from registers.
    keys_major: bool = False
    # Each consumer warpgroup computes dQ for half the step's rows over the whole head dim (instead of all rows over
    # half the head dim): its dQ product's N is the head dim, not half of it.
    dq_by_rows: bool = False


def bwd_ws_config(head_dim: int, causal: bool, seqlen_k: int) -> WsBwdConfig | None:
    """Whether the backward takes the warp-specialised dK/dV kernel, by shape (ops/backward.ws_backward_config
    adds what the tensors and masks allow). Measured on the H200 (benchmarks/RESULTS.md, session 11:
    `benchmarks/ws_bwd_sweep.py`, bf16, 16k tokens, 2048/d heads, TFLOP/s at s = 4k / 16k, same run):
      d128, 64 query rows per step: one fence per step vs two: full 504 / 558 vs 531 / 567, causal 475 / 568 vs
           441 / 545 (run 76), so one fence when causal only.
      d64, 128 rows, one fence: full 430 / 457, causal 387 / 463 (two fences 424 / 446, 366 / 433, run 76); 64 rows
           (two fences) 404 / 429 and 344 / 408 (run 72). At 1k keys the Triton kernels' small programs did as well
           or better (session 10: full 304 vs 309, causal 172 vs 226): rows of at most 1024 keys keep them.
    Two Q/dO stages: a third measured no gain at d64 with 64 rows (session 10) and does not fit in shared memory at
    d128 or with 128 rows. 128 rows at d128 do not fit either (the S and dP accumulators double). Head dims other
    than 64 and 128 would need padding inside the kernel, which it does not do; d256's dK/dV accumulators do not
    fit two consumer warpgroups' registers.
    """
    if head_dim == 128:
        return WsBwdConfig(block_m=64, num_stages=2, atomic_dq=True, one_fence=causal)
    if head_dim == 64 and seqlen_k > 1024:
        return WsBwdConfig(block_m=128, num_stages=2, atomic_dq=True, one_fence=True)
    return None


def bwd_config(head_dim: int, interpret: bool = False, arch: int | None = 90) -> BwdConfig:
    """Backward tiles per head dim, measured on the H200 (benchmarks/config_sweep.py bwd-d64 / bwd-d128 / bwd-det,
    bf16, 16k tokens at s = 4096, 2048/d heads, TFLOP/s = 2.5 x forward FLOPs / t, 2026-11-30):
      d64:  the separate dQ pass with (64, 64, 128, 32, warps 4/8, stages 3/3): 298 full / 288 causal (session 2);
            with atomic dQ the best tile, (64, 128 keys, 8 warps, 3 stages), ran 294 / 267 (run 25).
      d128: atomic dQ with (64, 128, 8 warps, 2 stages) 346 full / 312 causal (run 25; the separate dQ pass 335 /
            298, run 26); 32 query rows per step (no spills) 281 / 276, 16 rows 227 / 238.
      d256: atomic dQ with (32, 32, 4 warps, 2 stages) 155 full / 148 causal; the former (32, 32, 8 warps, 1 stage)
            89 / 88 (run 26); the separate dQ pass spills at every dQ tile tried (87-103).
    Staggered starts (rotate; run 30, same run, off / on, atomic dQ): d128 non-causal 4k 330 / 355, 16k 342 / 372;
    d256 161 / 166, 166 / 170; causal (masked on the right, where programs already start at their diagonals) lost
    1-2% (d128 327 / 319, 393 / 387), so the launcher staggers only without a right bound.
    After the predicate-free interiors (run 34, config_sweep.py bwd-d128 / bwd-tma, s = 4096 full / causal): d128
    with a third Q/dO stage (198 KB of shared memory) 377.7 / 328.0 vs 333.5 / 322.6 with two (staggered starts off
    in both); d64's Q/dO through TMA 355.7 / 321.0 vs 336.0 / 308.5 (16k: 374.8 / 363.5 vs 355.8 / 349.9); d128
    with TMA spills (86-92 B) and lost (300.6 vs 354.1), so it keeps pointers.
    Fields: dK/dV (query rows per step, keys per program), dQ (query rows per program, keys per step), then warps
    and stages of each kernel, whether dQ is added up with atomics by default, the staggered starts, and TMA loads
    of Q/dO in the dK/dV interior (power-of-two head dims only; the launcher takes pointers otherwise).
    arch (the target's compute capability): sm_10x (B200) keeps tl.dot accumulators in tensor memory (512 columns
    of 32 bits), which d128's 64-row dK/dV step overflows (576: dK, dV, S^T, dP^T and dQ); it takes 32 rows (448
    columns). Compiled for sm_100 on the CPU only, never timed."""
    if interpret:
        return BwdConfig(16, 16, 16, 16, 4, 1, 4, 1, rotate=True, tma=True)
    d = padded_head_dim(head_dim)
    if d > 64 and small_shared_memory(arch):
        # Under 200 KB of shared memory per block (A100, Ada, consumer Blackwell; compiled only): K, V, Q and dO
        # tiles of half the rows (d128's H200 tile needed 112 KB at one stage, over a 99 KB limit).
        return BwdConfig(32, 64, 64, 64, 4, 2, 4, 2, rotate=True) if d <= 128 else \
            BwdConfig(16, 32, 32, 32, 4, 2, 4, 1, rotate=True)
    if d <= 64:
        return BwdConfig(64, 64, 128, 32, 4, 3, 8, 3, atomic_dq=False, tma=True)
    if d <= 128:
        return BwdConfig(32 if tensor_memory(arch) else 64, 128, 128, 64, 8, 3, 8, 2, rotate=True)
    return BwdConfig(32, 32, 64, 32, 4, 2, 8, 1, rotate=True)


def decode_block_m(group_rows: int) -> int:
    """Rows of one pack-GQA tile: next power of two of (Hq/Hkv * Sq), at least 16 (tl.dot's minimum M),
    at most 64 (larger groups take several M tiles)."""
    return min(64, max(16, next_pow2(group_rows)))


# (KV tokens per step at head dim 128, pipeline stages, trans, programs an SM holds when that limits splitting)
# by cache format; "-large" from LARGE_TILES_MIN_KV token-heads on. Measured on the H200 (benchmarks/config_sweep.py,
# CUDA-graph replay, 32/8 heads, d=128, 2026-11-30; RESULTS.md runs 7-18):
# - 16-bit contiguous: 64 tokens, 2 stages, plain products (b=8 ctx 32k 258 us; 3 stages 303, trans 261); b=1 ctx
#   8k/32k/128k within 1-4% of the best of 64/128 tokens x 2/3/4 stages at their best split counts (run 17; MQA
#   b=1 ctx 32k ran 11% faster with 3 stages, 15.9 vs 17.7 us; not taken: GQA b=8 ctx 8k ran 92.2 vs 79.9 us with
#   3 stages at the split rule's count).
# - 16-bit paged (pointer gathers), large: 128 tokens, 2 stages, one program per SM (128 KiB of stages): page 16
#   b=32 ctx 8k 262 us vs 322 with 64 tokens, b=64 ctx 4k 255 vs 315 (the contiguous cache: 255, 256). Small paged
#   caches keep the contiguous tiles (b=1 ctx 8k: 24.7 us with 64-token steps, 26.1 with 128; runs 7, 9, 13).
# - fp8 and nvfp4: transposed products (s^T = K q^T on wgmma, the dequantized tile as the register operand), 3 stages:
#   fp8 b=32 ctx 8k 154 us vs 206 plain, b=256 ctx 2k 306 vs 366; nvfp4 b=256 ctx 2k 555 vs 749. Large caches step
#   128 tokens (two programs per SM: ~200 registers per thread), run 18 at each tile's best split count: fp8 b=8 ctx
#   32k 150.6 us vs 155.2 with 64 tokens, b=32 ctx 8k 145.9 vs 154.7, b=256 ctx 2k 288.4 vs 300.9; nvfp4 239.0 vs
#   263.6, 239.1 vs 264.9, 489.8 vs 499.6; 8 warps (two warpgroups per step) lost everywhere (165-992 us).
DECODE_TILES = {"16bit": (64, 2, False, 0), "16bit-long": (128, 2, False, 1),
                "16bit-paged-large": (128, 2, False, 1),
                "fp8": (64, 3, True, 4), "fp8-large": (128, 3, True, 2),
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
                  paged: bool = False, kv_tokens: int = 2 ** 30, tokens_per_program: int = 0) -> DecodeConfig:
    """Tiles by cache format (DECODE_TILES; "16bit", "fp8", "nvfp4"), layout and size: contiguous caches are read
    through TMA descriptors, paged ones too when a page holds whole tiles (one box per tile, its row from the block
    table), otherwise by per-token pointer gathers (a TMA descriptor covers one strided box, not a page list).
    kv_tokens = batch x cache capacity x KV heads; caches of LARGE_TILES_MIN_KV or more take the "-large" tiles.
    tokens_per_program = cache capacity / KV splits (0: not known yet): 16-bit contiguous caches take the
    "16bit-long" tiles from LONG_PROGRAM_TOKENS on."""
    block_m = decode_block_m(group_rows)
    if interpret:  # small steps; K/V through TMA descriptors as on the GPU (NVFP4 caches, and pages smaller than
        # a step, take pointers)
        return DecodeConfig(block_m=block_m, block_n=16, num_warps=4, num_stages=1, tma=True)
    d = padded_head_dim(head_dim)
    key = kv_format
    if kv_tokens * d >= LARGE_TILES_MIN_KV * 128:  # the "-paged-large" tiles where a format has them, else "-large"
        large = [f"{kv_format}-paged-large"] * paged + [f"{kv_format}-large"]
        key = next((k for k in large if k in DECODE_TILES), kv_format)
    if key == "16bit" and not paged and tokens_per_program >= LONG_PROGRAM_TOKENS:
        key = "16bit-long"
    tokens, stages, trans, resident = DECODE_TILES[key]
    # K+V bytes per step held constant across head dims (d=64 at 64 tokens per step ran 0.71-0.93x the peer);
    # below 64 a step holds fewer bytes and registers, and an SM proportionally more programs.
    block_n = tokens * 128 // d if d >= 64 else 2 * tokens
    resident *= tokens * 128 // (block_n * d)
    return DecodeConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=stages, tma=True, trans=trans,
                        resident_per_sm=resident)


# MLA decode (qv; a latent of up to 512 that is both V and most of the key, DeepSeek-V2/V3): (KV tokens per step,
# warps, stages, programs an SM holds) by tile rows. The [rows, 512] fp32 accumulator takes two warpgroups at 64
# rows; qv stays in shared memory. Pointer loads (a TMA box spans at most 256 elements). Run 125 (`config_sweep.py
# decode-mla`, graph replay, us at the best split count / at the split rule's): 64 rows (H=128) b=32 ctx 4k 155.9
# with 64-token 2-stage steps vs 181.8-292.4 for 16/32-token steps or 1 stage, b=1 ctx 32k 60.4 (at 66 splits: one
# 221 KB program per SM, hence resident 1; the rule's 132 ran 84.0), b=128 ctx 1k 154.3; 16 rows (H=16) with 64
# tokens, 4 warps, 2 stages: b=32 ctx 4k 59.8, b=1 ctx 32k 29.9, b=8 ctx 32k 95.2 at the rule's count (best of
# six configs within 4-11%: 8 warps 3 stages took b=32 57.7 at 4 splits, but 103.1 at b=8). 32 rows take the
# 16-row steps (not measured).
MLA_TILES = {16: (64, 4, 2, 0), 32: (64, 4, 2, 0), 64: (64, 8, 2, 1)}


def mla_decode_config(group_rows: int, interpret: bool = False, arch: int | None = 90) -> DecodeConfig:
    """MLA's pack-GQA tiles: decode_block_m rows (16..64), MLA_TILES's steps. Off the H200 (compiled on the CPU,
    never timed): sm_10x takes 32-token steps at 64 rows (Blackwell's MMA keeps its operands in shared memory,
    where the 64-token tile needed 281 KB), and targets with under 200 KB of shared memory per block take 16-row
    tiles (a 64-row tile's qv alone is 64 KB) of 32 tokens."""
    block_m = decode_block_m(group_rows)
    if interpret:
        return DecodeConfig(block_m=block_m, block_n=16, num_warps=4, num_stages=1)
    if small_shared_memory(arch):
        return DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)
    block_n, warps, stages, resident = MLA_TILES[block_m]
    if tensor_memory(arch) and block_m == 64:
        block_n = 32
    return DecodeConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                        resident_per_sm=resident)


MAX_SPLITS = 256
# Small paged caches read by per-token pointer gathers (pages shorter than a step) aim at three programs per SM
# instead of two: shorter programs, each of whose first K/V loads waits on its block-table entries. Run 48
# (`splits_sweep.py`, graph replay, 32/8 heads, b=1 ctx 8k, us): page 16 22.9 at 48 splits (3 of the 128 blocks per
# split, as at the rule's 50), 23.3 at 33 and 40 (4 blocks), 24.6 at 66 (2); the contiguous cache 20.9 at 33 (21.3 at
# 48), page 64 (TMA boxes) 21.6 at 33 (21.8 at 48). `bench decode` (run 50): 23.2 against 23.5 in run 42, a gain
# near the run-to-run spread.
GATHER_PROGRAMS_PER_SM = 3
# Long splits of a contiguous 16-bit cache aim at three programs per SM (as many as its 64-token, two-stage tiles
# let an SM hold), rounded down, instead of two rounded up. Run 105 (graph replay, read flush, 32/8 heads, us, the
# former count then this one, two timings each): b=1 ctx 128k 135.8 / 135.7 at 33 splits vs 128.8 / 129.6 at 49;
# b=2 ctx 32k 73.8 / 73.7 at 17 vs 71.4 / 71.5 at 24; b=4 ctx 32k 137.4 / 137.2 at 9 vs 129.4 / 129.7 at 12; b=8
# ctx 8k 71.8 / 71.9 at 5 vs 70.8 / 71.0 at 6; d=64 b=1 ctx 128k 75.3 vs 70.0. Splits of <= SHORT_SPLIT_TOKENS keep
# the nearest count at two per SM: b=1 ctx 8k and b=4 ctx 8k tied, b=1 ctx 32k ran 41.7 / 41.6 at 33 vs 41.2 / 41.3.
LONG_SPLIT_PROGRAMS_PER_SM = 3
MIN_SPLIT_TOKENS = 512  # shorter caches are not split
SHORT_SPLIT_TOKENS = 1024  # splits this short or shorter are not worth rounding the program count up for
COMBINE_TILE = 4096  # fp32 partials per combine program: 32 registers per thread at 4 warps


def combine_tiles(num_splits: int, head_dim_pad: int) -> tuple[int, int]:
    """(splits per load, head-dim columns per program) of the split-KV combine: every split of a row in one load
    (one memory round trip), the head dim cut so the [splits, columns] tile stays at COMBINE_TILE values."""
    split_chunk = max(2, min(next_pow2(num_splits), COMBINE_TILE // 16))
    return split_chunk, max(16, min(head_dim_pad, COMBINE_TILE // split_chunk))


def num_splits_heuristic(batch: int, nheads_kv: int, m_tiles: int, max_seqlen_k: int, block_n: int,
                         num_sms: int, resident_per_sm: int = 0, per_sm: int = 2, long_per_sm: int = 0) -> int:
    """How many programs share one sequence's KV.

    Without splitting there are batch*Hkv*m_tiles programs; at batch 1 that is 8 on a 132-SM GPU, which is how the
    sm_90 peer ends up at 0.4 TB/s. Split until about per_sm programs per SM are in flight, each split at least one
    block long; caches under MIN_SPLIT_TOKENS are not split (the combine's launch would cost more than the blocks
    a split saves). Measured (benchmarks/splits_sweep.py --lengths, graph replay, H200, run 38): MQA (8/1 heads) at
    b=1 gains down to one-block splits: ctx 8k 11.5 us at 128 splits vs 15.6 at 32 (the former 256-token floor), 16k
    12.8 at 256 vs 15.6, 32k 15.5 at 256 vs 17.4, 64k/128k unchanged at 256 (21.3 / 32.1); GQA (32/8 heads) b=1 ctx
    8k 20.8 at 33 vs 21.6 at 32, ctx 32k 49.6 at 33 (48.5 at 64), b=8 ctx 32k 262.5 at 5 (259.8 at 8).
    The SM target is rounded up unless that leaves splits of SHORT_SPLIT_TOKENS or fewer; then to the nearest
    count (run 37, `--small`): b=32 ctx 2k (256 programs) 78.5 us at 1 split vs 79.4 at 2, d=64 48.1 vs 50.2, MQA
    b=256 ctx 2k 78.8 vs 80.8, MQA b=128 ctx 1k 32.7 at 2 vs 34.4 at 3; long splits keep the count rounded up (b=32
    ctx 8k 260.3 at 2 vs 265.6 at 1, run 9; b=8 ctx 8k 80.0 at 5 vs 81.2 at 4, run 38).
    long_per_sm (0: per_sm): when the splits are longer than SHORT_SPLIT_TOKENS, as many as long_per_sm programs
    per SM hold (rounded down) if that is more; ops.decode asks 3 for contiguous 16-bit caches, whose tiles an SM
    holds three of (LONG_SPLIT_PROGRAMS_PER_SM).
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
    by_length = cdiv(max_seqlen_k, block_n) if max_seqlen_k >= MIN_SPLIT_TOKENS else 1
    if not resident_per_sm:
        target = per_sm * num_sms
        splits = cdiv(target, base)
        if max_seqlen_k <= splits * SHORT_SPLIT_TOKENS:
            splits = (2 * target + base) // (2 * base)  # target / base rounded to the nearest count
        elif long_per_sm:
            splits = max(splits, long_per_sm * num_sms // base)
        return max(1, min(splits, by_length, MAX_SPLITS))
    splits = max(1, min(per_sm * num_sms // base, by_length, MAX_SPLITS))
    if resident_per_sm < per_sm:
        wave = resident_per_sm * num_sms
        for n in range(splits, 0, -1):
            if base * n >= 0.9 * cdiv(base * n, wave) * wave:
                return n
    return splits


@dataclass(frozen=True)
class QuantDecodeConfig:
    """Tiles of the register-operand quantized-cache decode (kernels/decode_quant_mma.py): tokens per warp per
    step, warps per program (each its own tokens) and the programs an SM is meant to hold (the split target)."""
    block_n: int
    num_warps: int
    programs_per_sm: int

    @property
    def step(self) -> int:  # tokens per program per loop trip
        return self.block_n * self.num_warps


QUANT_MMA_HEAD_DIMS = (64, 128)  # d256's 16 x 256 fp32 accumulator per warp spills (CPU compile)
QUANT_MMA_MAX_ROWS = 16  # one mma.sync M tile of query rows (Hq/Hkv x Sq)
# Measured on the H200 (benchmarks/decode_quant_sweep.py, graph replay of the whole call, 32/8 heads, d=128, us;
# RESULTS.md runs 89 and 93; variants (tokens per warp step, programs per SM), all with q in shared memory and the
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
    """The register-operand decode's tiles for an "nvfp4" cache (see above for "fp8") with programs = batch x KV
    heads and capacity tokens per sequence, or None where the Triton kernel (decode_config) serves the call."""
    if kv_format != "nvfp4" or head_dim not in QUANT_MMA_HEAD_DIMS:
        return None
    if programs >= QUANT_MMA_SMALL_STEP_PROGRAMS and (capacity >= QUANT_MMA_SMALL_STEP_MIN_TOKENS or
                                                       programs >= QUANT_MMA_SMALL_STEP_SHORT_PROGRAMS):
        return QuantDecodeConfig(block_n=16, num_warps=4, programs_per_sm=3)
    return QuantDecodeConfig(block_n=32, num_warps=4, programs_per_sm=2)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # slices of K per output tile (decode-sized M); fp32 partials, summed in a fixed order
    swap_ab: bool = False  # c^T = w a^T: the weight tile on the MMA's M side (decode-sized M)


@dataclass(frozen=True)
class GemmMmaConfig:
    """The register-operand NVFP4 GEMM for M <= 16 (kernels/gemm_nvfp4_mma.py)."""
    block_n: int  # weight rows (output columns) per tile
    block_k: int  # K values per step
    split_k: int  # K slices; each program stages its slice of a (<= GEMM_MMA_SLICE_STEPS steps) in shared memory
    programs_n: int  # programs per K slice; each computes the N tiles p, p + programs_n, ...


GEMM_MMA_MAX_M = 16  # one mma.sync M tile of activation rows
# K steps (of 256 values) staged per program, 32 KiB of shared memory (raw + fp16 copies of 16 rows), and the most
# N tiles a program takes. Run 79 (benchmarks/gemm_mma_sweep.py, graph replay, us, M = 1 / 16, split x tiles per
# program): N=K=8192 16x4 28.1 / 32.8, 16x2 31.5 / 36.1, 32x4 31.9 / 37.2, 8x3 (4 steps) 34.2 / 39.1; N=K=4096 all
# within 17.6-18.1 / 18.9-20.1 (8x1: 17.3 / 19.2 in run 78).
GEMM_MMA_SLICE_STEPS = 2
GEMM_MMA_MAX_TILES = 4
GEMM_MMA_PROGRAMS_PER_SM = 3


def gemm_mma_config(m: int, n: int, k: int, num_sms: int = 132, tiles_per_program: int = 0,
                    split_k: int = 0) -> GemmMmaConfig | None:
    """Tiles of the register-operand NVFP4 GEMM (None above GEMM_MMA_MAX_M rows: the Triton kernel). K is cut into
    the fewest slices of at most GEMM_MMA_SLICE_STEPS steps; then each program takes as many N tiles as it needs
    for the programs to fit GEMM_MMA_PROGRAMS_PER_SM per SM, at most GEMM_MMA_MAX_TILES (staging a's slice is
    paid once per program).
    tiles_per_program / split_k > 0 force those choices (benchmarks/gemm_mma_sweep.py)."""
    if m > GEMM_MMA_MAX_M:
        return None
    block_n, block_k = 64, 256
    steps = -(-k // block_k)
    split = split_k or -(-steps // GEMM_MMA_SLICE_STEPS)
    split = min(split, steps)
    tiles = -(-n // block_n)
    per_program = tiles_per_program or max(1, min(GEMM_MMA_MAX_TILES,
                                                  -(-tiles * split // (GEMM_MMA_PROGRAMS_PER_SM * num_sms))))
    return GemmMmaConfig(block_n=block_n, block_k=block_k, split_k=split, programs_n=-(-tiles // per_program))


def gemm_config(m: int, n: int, k: int, interpret: bool = False, num_sms: int = 132) -> GemmConfig:
    """Tile shape from the problem shape only (CUDA-graph safe). Measured on the H200 (benchmarks/config_sweep.py
    gemm / gemm-small, graph replay). M <= 16: swapped products (c^T = w a^T, the weight tile on wgmma's M side)
    over 64-column weight tiles, K split into up to 4 slices until ~3 programs per SM are in flight (4 K steps per
    slice at least): M=1 N=K=4096 19.8 us with 4 slices, 23.5 with 2 (bf16 matmul 19.6); N=K=8192 40.1 us (bf16
    44.8); 128-column tiles ran 31-49 us; the earlier plain 32-column tiles 22.1 / 54.0 us. Eager calls at this
    size are bound by the host, not the kernel. M = 128: (128, 64, 128, 4 warps) 138 us vs 156-250; M = 1024:
    (128, 128, 64, 8 warps) 649 us vs 1001-1161 (session 1 sweep)."""
    if interpret:
        # Small tiles: the interpreter's cost is per program and per K step, and tests use M <= 33, N, K <= 96;
        # K >= 64 takes the split-K path so the CPU tests cover it.
        return GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1,
                          split_k=2 if m <= 16 and k >= 64 else 1)
    if m <= 16:
        block_n, block_k = 64, 128
        tiles = -(-n // block_n)
        split = max(1, min(-(-3 * num_sms // tiles), k // (4 * block_k), 4))  # 4: the most measured
        return GemmConfig(block_m=16, block_n=block_n, block_k=block_k, num_warps=4, num_stages=4, split_k=split,
                          swap_ab=True)
    if m <= 64:  # not measured at this M: the M = 128 runner-up, with a tile that wastes fewer rows
        return GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if m <= 256:
        return GemmConfig(block_m=128, block_n=64, block_k=128, num_warps=4, num_stages=3)
    return GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
