"""NVFP4 GEMM policy: the Triton kernel's tiles and split-K, the register-operand kernel's slices for decode-sized M
(tests/plan/test_plan.py)."""
from __future__ import annotations

from dataclasses import dataclass

from .target import mma_sync_target


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # slices of K per output tile (decode-sized M); fp32 partials, summed in a fixed order
    swap_ab: bool = False  # c^T = w a^T: the weight tile on the MMA's M side (decode-sized M)
    weights_first: bool = False  # each K step loads b's codes before a's tile (see gemm_config)


@dataclass(frozen=True)
class GemmMmaConfig:
    """The register-operand NVFP4 GEMM for M <= 16 (lowp/kernels/gemm_mma.py)."""
    block_n: int  # weight rows (output columns) per tile
    block_k: int  # K values per step
    split_k: int  # K slices; each program stages its slice of a (<= GEMM_MMA_SLICE_STEPS steps) in shared memory
    programs_n: int  # programs per K slice; each computes the N tiles p, p + programs_n, ...


GEMM_MMA_MAX_M = 16  # one mma.sync M tile of activation rows


# K steps (of 256 values) staged per program, 32 KiB of shared memory (raw + fp16 copies of 16 rows), and the most
# N tiles a program takes. Run 79 (gemm_mma_sweep.py, graph replay, us, M = 1 / 16, split x tiles per
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
    tiles_per_program / split_k > 0 force those choices (gemm_mma_sweep.py)."""
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


@dataclass(frozen=True)
class GemmWgmmaConfig:
    """The wgmma NVFP4 GEMM for sm_90 (lowp/kernels/gemm_wgmma.py): persistent CTAs over work units of (64 x
    consumers weight rows, block_m activation rows, one K slice)."""
    block_m: int  # activation rows per unit: wgmma's N (16, 32, 64 or 128)
    consumers: int  # consumer warpgroups per CTA, 64 weight rows each (1 or 2)
    stages: int  # stages in the TMA ring
    split_k: int  # K slices (fp32 partials summed in order) of whole stages, an even number when steps == 1
    steps: int = 2  # MMA steps of 128 K values per stage (a stage of two reads 128-byte weight rows)
    prefetch: int = 1  # stages whose weights are requested before the prep wait (run 163: 1 beats the ring by 2-8%)


# Rows up to which the wgmma kernel beats the decoded weight + cuBLAS (H100, graph replay, us, wgmma vs decoded;
# runs 235-236, `sweep gemm-wgmma` with the cap lifted / `sweep gemm-decoded`): N=K=8192 M=512 117 vs 158,
# M=768 172 vs 210, M=1024 240-259 vs 248-264, M=1536 351 vs 356, M=2048 470 vs 438, M=4096 999 vs 823;
# N=28672 K=4096 M=1024 423 vs 461, M=2048 809 vs 794.
GEMM_WGMMA_MAX_M = 1024
GEMM_WGMMA_K_MULTIPLE = 256  # whole 16-byte scale boxes; slices of whole stages of one or two 128-value steps
GEMM_WGMMA_STAGE_BYTES = 208 * 1024  # of the H200's 227 KB, what the ring may take
GEMM_WGMMA_MAX_STAGES = 6
# 16-row activation tiles (M <= 16) keep fewer stages in flight: runs 246-247 (H100, graph replay, us, 4 vs 6
# stages): N=K=8192 M=1 21.7 / 21.1 vs 22.2-22.8 / 21.6-22.1, M=16 23.3 / 22.5 vs 23.6-24.5; N=28672 K=4096 M=1
# 30.9 vs 31.4, M=16 32.8 / 31.8 vs 32.4-33.2 (3 stages: within 1% of 6 or worse, except N=K=4096 M=16 10.9 vs 11.5).
GEMM_WGMMA_DECODE_STAGES = 4
GEMM_WGMMA_MIN_SLICE_STEPS = 8
# What a work unit costs beyond its MMA steps (its epilogue, the ring's turn to the next unit), in steps. Fitted to
# run 246 (H100, graph replay, us, split 1 / 2 / 4 slices): N=28672 K=4096 M=1 31.2 / 34.3 / 33.3 (four slices, the
# estimate without it, were 7% slower than one), N=K=8192 M=1 27.2 / 22.1 / 22.9, M=16 27.9 / 23.5 / 24.4.
GEMM_WGMMA_UNIT_STEPS = 2.6


def gemm_wgmma_split(units: int, steps: int, m: int, n: int, k: int, num_sms: int = 132) -> int:
    """K slices of the persistent wgmma GEMM: the count with the lowest estimate of (the busiest CTA's work:
    ceil(units x split / CTAs) x (steps / split + GEMM_WGMMA_UNIT_STEPS)) x (1 + the fp32 partials' traffic, 2 x
    split x M x N x 4 bytes, over the weight's bytes); slices of an even number of 128-value steps, at least
    GEMM_WGMMA_MIN_SLICE_STEPS; ties take fewer slices."""
    weight_bytes = n * k * 9 // 16
    best, best_split = None, 1
    split = 1
    while steps % (2 * split) == 0 and steps // split >= GEMM_WGMMA_MIN_SLICE_STEPS:
        busiest = -(-units * split // num_sms) * (steps // split + GEMM_WGMMA_UNIT_STEPS)
        cost = busiest * (1 + (8 * split * m * n / weight_bytes if split > 1 else 0))
        if best is None or cost < best:
            best, best_split = cost, split
        split *= 2
    return best_split


def wgmma_shape_ok(m: int, k: int) -> bool:
    """Whether the wgmma kernel takes a W4A16 call of M rows and K values (its operands permitting)."""
    return 0 < m <= GEMM_WGMMA_MAX_M and k % GEMM_WGMMA_K_MULTIPLE == 0


def gemm_wgmma_config(m: int, n: int, k: int, num_sms: int = 132, block_m: int = 0, consumers: int = 0,
                      split_k: int = 0) -> GemmWgmmaConfig | None:
    """Tiles of the wgmma NVFP4 GEMM (None above GEMM_WGMMA_MAX_M rows, where the decoded weight and cuBLAS take
    the call, or when K is not a multiple of GEMM_WGMMA_K_MULTIPLE: the Triton kernel). The activation rows are
    wgmma's N: 16 up to M = 16, 32 up to 32, 64 up to 64, else 128; K slices by gemm_wgmma_split; stages of two MMA
    steps up to block_m 64, of one above (a 128-row activation tile makes a two-step stage 82 KB: two of them hold
    too few steps in flight); the stages fill GEMM_WGMMA_STAGE_BYTES, at most GEMM_WGMMA_MAX_STAGES (at 16 rows
    GEMM_WGMMA_DECODE_STAGES). block_m / consumers / split_k > 0 force those
    choices (the sweep).
    Measured (`sweep gemm-wgmma`, graph replay over inputs rotated past the L2, us): two consumers beat one by
    1.17-1.24x everywhere (run 154), three are 1.1-1.3x slower than two at M <= 16 (run 162); block_m 64 / 128 as
    chosen are the best of block_m 64/128 x split 1/2/4 at M = 64, 128 and N=28672 M=128 (run 154, again with
    persistent CTAs in run 163: block_m 64 is 1.2-1.4x slower at M = 96 .. 256); block_m 32 at M = 17 .. 32 is
    1.07-1.18x faster than 64 and 1.3-1.4x faster than two 16-row tiles (run 166: N=K=8192 M=32 21.9 vs 24.6 us,
    N=28672 K=4096 M=32 30.8 vs 36.4). M = 512 .. 4096 take one slice (one wave of 128-row units already): two
    slices lose 6-20% (run 235)."""
    if not wgmma_shape_ok(m, k):
        return None
    block_m = block_m or next((b for b in (16, 32, 64) if m <= b), 128)
    consumers = consumers or 2
    steps = k // 128
    m_pad = -(-m // block_m) * block_m
    units = -(-n // (64 * consumers)) * (m_pad // block_m)
    split = split_k or gemm_wgmma_split(units, steps, m, n, k, num_sms)
    per_stage = 2 if block_m <= 64 else 1
    stage_bytes = per_stage * (2 * block_m * 64 * 2 + consumers * 64 * 64) + consumers * 64 * 16
    stages = min(GEMM_WGMMA_DECODE_STAGES if block_m == 16 else GEMM_WGMMA_MAX_STAGES,
                 GEMM_WGMMA_STAGE_BYTES // stage_bytes)
    return GemmWgmmaConfig(block_m=block_m, consumers=consumers, stages=stages, split_k=split, steps=per_stage)


@dataclass(frozen=True)
class GemmDecodedConfig:
    """Large M: the weight decoded into the output's 16-bit dtype, chunk_rows rows at a time (into the workspace; a
    W4A4 call's a whole, before, into a buffer of the call), each chunk then multiplied by cuBLAS's 16-bit GEMM."""
    chunk_rows: int


GEMM_DECODED_MIN_M = 257  # past the register-operand and Triton kernels' small-M tiles
GEMM_DECODED_CHUNK_ELEMENTS = 32 * 1024 * 1024  # 64 MiB of decoded 16-bit weight at most (128-row chunks at least)


def gemm_decoded_config(m: int, n: int, k: int, native_fp4: bool = False,
                        wgmma: bool = False) -> GemmDecodedConfig | None:
    """Large M: the NVFP4 weight (and a W4A4 call's NVFP4 a) decoded once into the output's 16-bit dtype and multiplied
    by cuBLAS (None: the fused kernels). From GEMM_DECODED_MIN_M rows, except where the wgmma kernel takes the call
    (wgmma: W4A16 on sm_90 with TMA-addressable weights; then wgmma_shape_ok: K a multiple of 256, M up to
    GEMM_WGMMA_MAX_M); never for W4A4 on a target with the native block-scaled FP4 MMA (native_fp4). There the GEMM is
    bound by the tensor cores and the decoded weight's traffic (N K (2 + 2 + 0.56) bytes: decode, write, read) costs
    less than a fused decode per tile. Measured on the H100 (graph replay, us, N=K=8192, W4A16): the Triton kernel vs
    decoded at M = 512 / 1024 / 4096 202 / 414 / 1593 vs 158-163 / 248-264 / 823-837 (runs 234-235; cuBLAS bf16 alone
    198 / 758 at 1024 / 4096); for the wgmma kernel see GEMM_WGMMA_MAX_M. W4A4 off Blackwell decodes both operands per
    tile in the Triton kernel, more work than W4A16's: the same route serves it (a decoded whole, M K 16-bit values).
    Each operand is decoded with its global scale folded in and rounded once to the output dtype: the 2x rule's
    low-precision reference (a @ w.to(a.dtype).T; W4A4 a.to(dtype) @ w.to(dtype).T). Chunks bound the transient weight
    at GEMM_DECODED_CHUNK_ELEMENTS (whole 128-row multiples, so cuBLAS keeps full tiles; 128 rows at least, which
    exceeds the bound only for K > 256k): 2048-row chunks cost 4-20% at N=K=8192 (run 234)."""
    if native_fp4 or m < GEMM_DECODED_MIN_M or (wgmma and wgmma_shape_ok(m, k)):
        return None
    rows = max(128, GEMM_DECODED_CHUNK_ELEMENTS // k // 128 * 128)
    return GemmDecodedConfig(chunk_rows=min(n, rows))


def gemm_config(m: int, n: int, k: int, interpret: bool = False, num_sms: int = 132, a_nvfp4: bool = False,
                native_fp4: bool = False, arch: int | None = None) -> GemmConfig:
    """Tile shape from the problem shape only (CUDA-graph safe). Measured on the H200 (config_sweep.py
    gemm / gemm-small, graph replay). M <= 16: swapped products (c^T = w a^T, the weight tile on wgmma's M side)
    over 64-column weight tiles, K split into up to 4 slices until ~3 programs per SM are in flight (4 K steps per
    slice at least): M=1 N=K=4096 19.8 us with 4 slices, 23.5 with 2 (bf16 matmul 19.6); N=K=8192 40.1 us (bf16
    44.8); 128-column tiles ran 31-49 us; the earlier plain 32-column tiles 22.1 / 54.0 us. Eager calls at this
    size are bound by the host, not the kernel. M = 128, plain tiles (what W4A4 and mma.sync targets keep; W4A16
    on wgmma-class targets takes the swapped tiles below): (128, 64, 128, 4 warps) 138 us vs 156-250; M = 1024:
    (128, 128, 64, 8 warps) 649 us vs 1001-1161 (session 1 sweep). a_nvfp4 (W4A4 decoding both operands) takes 8
    warps for the 128x64 tile: with 4 it spills 296 bytes on sm_90 (compile check, --res-usage); not timed. So do
    targets whose MMA is mma.sync (arch < 90 or sm_12x: operands and accumulator in registers, no wgmma): 4 warps
    spill 144 bytes on sm_120.
    native_fp4: W4A4 on Blackwell's block-scaled MMA (native_fp4_config).
    weights_first (the K step's load order), run 143 side by side (graph replay, us, a first / b first): M > 256
    loads b first, N=K=4096 M=1024 112.1 / 107.7, M=4096 436.4 / 404.9, N=K=8192 M=1024 419.8 / 401.1, M=4096
    1681.3 / 1667.0; M = 128 a first: N=K=4096 41.2 / 44.4, N=K=8192 72.8 / 81.3."""
    if interpret:
        # Small tiles: the interpreter's cost is per program and per K step, and tests use M <= 33, N, K <= 96;
        # K >= 64 takes the split-K path so the CPU tests cover it.
        return GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1,
                          split_k=2 if m <= 16 and k >= 64 else 1)
    if native_fp4:
        return native_fp4_config(m, n, k, num_sms)
    if m <= 16:
        block_n, block_k = 64, 128
        tiles = -(-n // block_n)
        split = max(1, min(-(-3 * num_sms // tiles), k // (4 * block_k), 4))  # 4: the most measured
        return GemmConfig(block_m=16, block_n=block_n, block_k=block_k, num_warps=4, num_stages=4, split_k=split,
                          swap_ab=True)
    if m <= 256 and not a_nvfp4 and not mma_sync_target(arch):
        # Swapped products on wgmma-class targets (sm_90 takes the wgmma kernel first where it applies), run 153
        # (`sweep gemm`, graph replay over rotated inputs, N=K=8192, us, plain / swapped): M=32 50.7 / 33.4 (32
        # rows, 128-row weight tiles, 4 K slices), M=64 53.1 / 49.3, M=128 69.8 / 57.8, M=256 137.1 / 90.0,
        # N=28672 K=4096 M=64 98.3 / 77.3, M=128 141.5 / 91.2; 256-row activation tiles ran 1.6-3x slower.
        if m <= 32:
            return GemmConfig(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=3, split_k=4,
                              swap_ab=True)
        return GemmConfig(block_m=64 if m <= 64 else 128, block_n=64, block_k=128, num_warps=4, num_stages=3,
                          swap_ab=True)
    if m <= 64:  # W4A4 and mma.sync targets (not measured at this M): a tile that wastes fewer rows
        return GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if m <= 256:
        return GemmConfig(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3)
    return GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, weights_first=True)


def native_fp4_config(m: int, n: int, k: int, num_sms: int = 132) -> GemmConfig:
    """W4A4 on Blackwell's block-scaled MMA (tl.dot_scaled over e2m1 codes), compiled for sm_100 and sm_120 on the
    CPU only, never timed (no such GPU here): the shapes that compile there without spills (--res-usage). Decode-
    sized M swaps the operands so the weight rows fill the MMA's M side (sm_100 rejects a 16- or 64-row tile of
    a), with the dequantizing kernel's split-K rule; above, 128x64 tiles with 8 warps (4 warps or 128x128 tiles
    spill up to 2 KB on sm_120 when K has a tail) and K steps of 128 codes (two of the MMA's 64)."""
    if m <= 16:
        tiles = -(-n // 128)
        split = max(1, min(-(-3 * num_sms // tiles), k // (4 * 128), 4))
        return GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3, split_k=split,
                          swap_ab=True)
    return GemmConfig(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3)
