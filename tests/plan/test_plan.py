"""Planning (tileflash.plan) as tables: inputs -> expected choices (no kernel runs)."""
import dataclasses

import pytest
import torch

from tileflash.plan import (COMBINE_TILE, MAX_SPLITS, bwd_config, bwd_ws_config, combine_tiles, decode_block_m,
                                  decode_config, fwd_config, fwd_ws_config, num_splits_heuristic, padded_head_dim,
                                  quant_decode_config)
from tileflash.plan import decode as plan_decode


@pytest.mark.parametrize("d, expected", [(8, 16), (40, 64), (64, 64), (80, 128), (128, 128), (136, 256),
                                         (256, 256)])
def test_padded_head_dim(d, expected):
    assert padded_head_dim(d) == expected


@pytest.mark.parametrize("d, causal, seqlen_k, block_m, block_n, warps, stages, tma", [
    (64, False, 8192, 128, 64, 8, 3, True),
    (64, False, 1024, 128, 64, 8, 3, True),
    (64, True, 1024, 64, 64, 4, 3, True),  # causal, short key rows: one warpgroup per program
    (64, True, 4096, 64, 64, 4, 3, True),
    (64, True, 4097, 128, 64, 8, 3, True),
    (128, False, 8192, 128, 128, 8, 3, True),
    (128, False, 4097, 128, 128, 8, 3, True),
    (128, False, 4096, 64, 64, 4, 3, True),  # short key rows: one warpgroup per program, two programs per SM
    (128, False, 1024, 64, 64, 4, 3, True),
    (128, True, 16384, 64, 64, 4, 3, True),  # causal: one warpgroup per program at every length
    (256, False, 1024, 128, 64, 8, 2, True),
    (40, False, 8192, 128, 64, 8, 3, True),  # padded to 64 (descriptors only for 64 itself: launch/tensors.py)
    (72, False, 2048, 64, 64, 4, 3, True),  # padded to 128
])
def test_fwd_config(d, causal, seqlen_k, block_m, block_n, warps, stages, tma):
    c = fwd_config(d, causal, seqlen_k=seqlen_k)
    assert (c.block_m, c.block_n, c.num_warps, c.num_stages, c.tma) == (block_m, block_n, warps, stages, tma)


@pytest.mark.parametrize("d, causal", [(64, False), (64, True), (128, False), (128, True), (256, True), (40, False)])
def test_fwd_config_interpreter_uses_small_tiles_and_the_gpu_load_path(d, causal):
    c = fwd_config(d, causal, interpret=True)
    assert (c.block_m, c.block_n, c.num_stages) == (32, 16, 1)
    assert c.tma == fwd_config(d, causal).tma  # the CPU suite runs the GPU's K/V load path (descriptors or pointers)


@pytest.mark.parametrize("d, causal, seqlen_k, expected", [
    (128, False, 1024, (128, 3, 3, True)),  # d128: the warp-specialised forward at every length, persistent
    (128, True, 1, (128, 3, 3, True)),  # CTAs for short rows (prologue and epilogue overlap the next tile)
    (128, True, 2049, (128, 3, 3, False)),
    (128, True, 16384, (128, 3, 3, False)),
    (64, False, 1024, (128, 3, 3, True)),
    (64, True, 2048, (128, 3, 3, True)),  # d64 causal with short rows: persistent CTAs beat the Triton tile
    (64, True, 4097, (128, 3, 3, False)),
    (256, False, 16384, (64, 3, 2, False)),  # d256: 64 keys per step, a third K stage fills the shared memory
    (256, True, 1024, (64, 2, 2, False)),  # ... except with short rows, where it measured slower
    (96, False, 4096, None),  # head dims other than 64, 128, 256 would need padding inside the Gluon kernel
    (40, True, 4096, None),
])
def test_fwd_ws_config(d, causal, seqlen_k, expected):
    c = fwd_ws_config(d, causal, seqlen_k)
    assert (None if c is None else (c.block_n, c.k_stages, c.v_stages, c.persistent)) == expected


@pytest.mark.parametrize("d, causal, seqlen_k, expected", [
    # d128: 64 query rows per step; one fence per step only when causal (it measured slower non-causal)
    (128, False, 1024, (64, 2, True, False)), (128, True, 16384, (64, 2, True, True)),
    (64, False, 4096, (128, 2, True, True)), (64, True, 1025, (128, 2, True, True)),  # d64: 128 rows per step
    (64, True, 1024, None), (64, False, 512, None),  # d64 with short rows: the Triton kernels
    (256, False, 4096, None),  # two consumer warpgroups cannot hold d256's dK/dV accumulators
    (96, True, 4096, None), (40, False, 4096, None),  # other head dims would need padding inside the Gluon kernel
])
def test_bwd_ws_config(d, causal, seqlen_k, expected):
    c = bwd_ws_config(d, causal, seqlen_k)
    assert (None if c is None else (c.block_m, c.num_stages, c.atomic_dq, c.one_fence)) == expected


@pytest.mark.parametrize("rows, expected", [(1, 16), (4, 16), (17, 32), (64, 64), (128, 64), (512, 64)])
def test_decode_block_m(rows, expected):
    assert decode_block_m(rows) == expected


@pytest.mark.parametrize("d, fmt, paged, kv_tokens, block_n, stages, trans, resident", [
    (32, "16bit", False, 2 ** 30, 128, 2, False, 0), (64, "16bit", False, 2 ** 30, 128, 2, False, 0),
    (128, "16bit", False, 2 ** 30, 64, 2, False, 0), (256, "16bit", False, 2 ** 30, 32, 2, False, 0),
    # paged, large: twice the tokens per step, one program per SM; small paged caches keep the contiguous tiles
    (128, "16bit", True, 2 ** 30, 128, 2, False, 1), (64, "16bit", True, 2 ** 30, 256, 2, False, 1),
    (128, "16bit", True, 8192 * 8, 64, 2, False, 0), (128, "16bit", True, 32768 * 8, 128, 2, False, 1),
    (128, "16bit", True, 32 * 2048 * 8, 128, 2, False, 1),
    # quantized caches: one more stage and the transposed products, paged or not; large ones step 128 tokens
    (128, "fp8", False, 2 ** 30, 128, 3, True, 2), (128, "nvfp4", True, 2 ** 30, 128, 3, True, 2),
    (64, "fp8", False, 2 ** 30, 256, 3, True, 2), (128, "fp8", False, 8192 * 8, 64, 3, True, 4),
    (128, "nvfp4", True, 8192 * 8, 64, 3, True, 4),
    # below d=64 a step holds half the bytes (twice the tokens at a quarter or half the width): twice the programs
    (32, "16bit", True, 2 ** 30, 256, 2, False, 2), (32, "fp8", False, 2 ** 30, 256, 3, True, 4),
])
def test_decode_config(d, fmt, paged, kv_tokens, block_n, stages, trans, resident):
    c = decode_config(d, 4, kv_format=fmt, paged=paged, kv_tokens=kv_tokens)
    assert (c.block_n, c.num_warps, c.num_stages, c.tma, c.trans, c.resident_per_sm) == \
        (block_n, 4, stages, True, trans, resident)


@pytest.mark.parametrize("d, fmt, programs, capacity, expected", [
    (128, "nvfp4", 8, 8192, (32, 2)), (128, "nvfp4", 8, 131072, (32, 2)),  # b=1 x 8 KV heads: 32-token steps
    (128, "nvfp4", 64, 8192, (16, 3)), (128, "nvfp4", 512, 4096, (16, 3)),  # b=8 ctx 8k, b=64 ctx 4k
    (128, "nvfp4", 256, 2048, (32, 2)),  # b=32 ctx 2k: short caches keep the long steps ...
    (128, "nvfp4", 1024, 1024, (16, 3)),  # ... until b=128 (no split either way)
    (64, "nvfp4", 8, 8192, (32, 2)),
    (256, "nvfp4", 8, 8192, None),  # its accumulator would spill
    (32, "nvfp4", 8, 8192, None),
    (128, "fp8", 64, 8192, None),  # FP8: the Triton kernel, within 5% everywhere (run 93)
    (128, "16bit", 64, 8192, None),
])
def test_quant_decode_config(d, fmt, programs, capacity, expected):
    c = quant_decode_config(d, fmt, programs, capacity)
    assert (None if c is None else (c.block_n, c.programs_per_sm)) == expected
    if c is not None:
        assert c.step == c.block_n * c.num_warps == c.block_n * 4


@pytest.mark.parametrize("sq, hq, page, sp_overlap, extras, taken", [
    (1, 32, None, False, False, True), (4, 32, 16, False, False, True),  # contiguous, pages 16
    (1, 32, 1, False, False, True),  # pages of 1
    (5, 32, None, False, False, False),  # 20 rows > 16
    (1, 32, 12, False, False, False),  # a non-power-of-two page
    (1, 32, None, True, False, False),  # the S/P-overlapped loop is the Triton kernel's
    (1, 32, None, False, True, False),  # rotary, cache_batch_idx, cache_leftpad, ALiBi: the Triton kernel's
])
def test_quant_mma_dispatch(sq, hq, page, sp_overlap, extras, taken, monkeypatch):
    """plan.decode.quant_mma_config on shapes (CPU tensors, an sm_90 target assumed)."""
    monkeypatch.setattr(plan_decode, "sm90_target", lambda: True)
    ctx, hkv, d = 32768, 8, 128
    shape = (1, ctx, hkv) if page is None else (ctx // page, page, hkv)
    cache = torch.zeros(*shape, d // 2, dtype=torch.uint8)
    table = None if page is None else torch.zeros(1, ctx // page, dtype=torch.int32)
    q = torch.zeros(1, sq, hq, d, dtype=torch.bfloat16)
    cfg = plan_decode.quant_mma_config(q, cache, cache, table, ctx, sp_overlap, extras)
    assert (cfg is not None) == taken


@pytest.mark.parametrize("d, fmt, paged, tokens_per_program, block_n", [
    (128, "16bit", False, 4096, 128),  # long programs (b=32 ctx 8k at 2 splits): twice the tokens per step
    (128, "16bit", False, 4095, 64),
    (128, "16bit", False, 0, 64),  # not known yet (before the split count)
    (64, "16bit", False, 8192, 256),  # the same bytes per step at half the width
    (128, "16bit", True, 8192, 128),  # paged: the large tiles decide (already 128 tokens at this size)
    (128, "fp8", False, 8192, 128),  # quantized caches keep their own tiles
])
def test_decode_config_long_programs(d, fmt, paged, tokens_per_program, block_n):
    c = decode_config(d, 4, kv_format=fmt, paged=paged, kv_tokens=32 * 8192 * 8, tokens_per_program=tokens_per_program)
    assert c.block_n == block_n
    if fmt == "16bit" and not paged and tokens_per_program >= 4096:
        assert c.resident_per_sm == 1  # 128 KiB of stages: the split count must fill whole waves of one per SM


# (batch, Hkv, m_tiles, max_seqlen_k, block_n, sms) -> splits
@pytest.mark.parametrize("args, expected", [
    ((1, 8, 1, 8192, 64, 132), 33),  # b=1: 8 programs -> the SM target cdiv(264, 8) = 33 (run 38: 20.8 us; 32: 21.6)
    ((1, 8, 1, 32768, 64, 132), 33),
    ((1, 8, 1, 131072, 64, 132), 33),
    ((8, 8, 1, 32768, 64, 132), 5),  # 64 programs -> cdiv(264, 64)
    ((32, 8, 1, 2048, 64, 132), 1),  # 256 programs: 2 splits of 1024 tokens would only round the target up
    ((32, 8, 1, 8192, 64, 132), 2),  # the same, with long splits: rounded up (run 9: 260.3 us vs 265.6 unsplit)
    ((128, 1, 1, 1024, 64, 132), 2),  # MQA b=128 ctx 1k: 264 / 128 -> 2 (run 37: 32.7 us; 3 splits 34.4)
    ((8, 8, 1, 8192, 64, 132), 5),  # splits of 1638 tokens: rounded up (run 38: 80.0 us; 4 splits 81.2)
    ((32, 1, 1, 2048, 64, 132), 8),  # MQA b=32 ctx 2k: 8.25 -> 8 (run 37: best at 8)
    ((64, 8, 1, 4096, 64, 132), 1),  # enough programs already
    ((1, 1, 1, 8192, 64, 132), 128),  # MQA at batch 1: 128 blocks -> 128 one-block splits (run 38: 11.5 us)
    ((1, 1, 1, 32768, 64, 132), MAX_SPLITS),  # run 38: 15.5 us at 256, 17.3 at 128
    ((1, 1, 1, 512, 64, 132), 8),  # MIN_SPLIT_TOKENS: split, one block each
    ((1, 1, 1, 511, 64, 132), 1),  # shorter: not split
    ((1, 8, 1, 100, 64, 132), 1),  # 2 blocks: too short to split
    ((1, 1, 1, 10 ** 7, 64, 132), MAX_SPLITS),  # capped
    # one program per SM (paged 128-token tiles): programs fill >= 90% of whole waves of 132
    ((8, 8, 1, 32768, 128, 132, 1), 4),  # 4 = 256 programs = 1.94 waves (5 = 320 = 2.4 waves was 28% slower)
    ((1, 8, 1, 8192, 128, 132, 1), 33),  # 264 programs = two full waves
    ((1, 8, 1, 32768, 128, 132, 1), 33),  # 264 = two full waves
    ((32, 8, 1, 8192, 128, 132, 1), 1),  # 256 programs: 1.94 waves, no combine
    ((1, 1, 1, 2 ** 20, 128, 132, 1), MAX_SPLITS),  # capped: 256 programs, 1.94 waves
    # 128-token quantized tiles (two per SM): never more than 2 programs per SM (the count rounded down)
    ((8, 8, 1, 32768, 128, 132, 2), 4),  # run 18's best count (150.6 us; 8: 154.4)
    ((32, 8, 1, 8192, 128, 132, 2), 1),  # run 18's best (145.9 us; 2: 153.7)
    ((256, 8, 1, 2048, 128, 132, 2), 1),  # run 18's best (288.4 us; 2: 320.5)
    ((1, 8, 1, 32768, 128, 132, 2), 33),  # run 18's best (35.1 us; 66: 39.4)
    ((5, 8, 1, 32768, 128, 132, 2), 6),  # 40 programs a split: 6 = 240 programs; 7 = 280 would spill past 264
    ((8, 8, 1, 32768, 64, 132, 4), 4),  # 64-token tiles hold 4 per SM: not limiting at 2 per SM, same floor
    # long_per_sm = 3 (contiguous 16-bit caches): long splits as many as three per SM hold, rounded down
    ((1, 8, 1, 131072, 64, 132, 0, 2, 3), 49),  # run 105: 129.2 us vs 135.8 at 33
    ((8, 8, 1, 8192, 64, 132, 0, 2, 3), 6),  # 1365-token splits (run 105: 70.9 us vs 71.9 at 5)
    ((8, 8, 1, 4096, 64, 132, 0, 2, 3), 4),  # <= 1024-token splits: the nearest count at two per SM
    ((200, 1, 1, 8192, 64, 132, 0, 2, 3), 2),  # three per SM rounds down to 1: never fewer than two per SM give
])
def test_num_splits_heuristic(args, expected):
    assert num_splits_heuristic(*args) == expected


@pytest.mark.parametrize("d, expected", [
    (64, (64, 64, 128, 32, 4, 3, 8, 3, False, False, True)),  # d64: 4-warp dK/dV programs, separate dQ pass, TMA
    (128, (64, 128, 128, 64, 8, 3, 8, 2, True, True, False)),  # d128: atomic dQ, staggered (see bwd_config)
    (256, (32, 32, 64, 32, 4, 2, 8, 1, True, True, False)),
    (40, (64, 64, 128, 32, 4, 3, 8, 3, False, False, True)),  # padded to 64 (the launcher takes pointers: no TMA)
])
def test_bwd_config(d, expected):
    c = bwd_config(d)
    assert dataclasses.astuple(c) == expected
    assert c.dkdv_block_n * padded_head_dim(d) <= 128 * 128  # K, V, dK, dV of one program fit 8 warps' registers


@pytest.mark.parametrize("arch", [100, 103])
def test_bwd_config_fits_blackwell_tensor_memory(arch):
    """sm_10x keeps the dK/dV program's accumulators in 512 columns of tensor memory: dK and dV (D each), S^T and
    dP^T (query rows each) and the atomic dQ step (D) must fit; other targets keep the H200's tiles."""
    for d in (64, 128):
        c = bwd_config(d, arch=arch)
        assert 3 * d + 2 * c.dkdv_block_m <= 512 or not c.atomic_dq
        assert 2 * d + 2 * c.dkdv_block_m <= 512
    assert bwd_config(128, arch=None) == bwd_config(128)


@pytest.mark.parametrize("arch", [80, 89, 120])
def test_small_shared_memory_targets_take_smaller_tiles(arch):
    """Under 200 KB of shared memory per block the d128/d256 dK/dV tiles and the d256 forward tile shrink (the
    H200's needed 112-128 KB at one stage); d64 and the d128 forward keep the H200's."""
    from tileflash.plan import SHARED_MEM_PER_BLOCK

    assert SHARED_MEM_PER_BLOCK[arch] < 200 * 1024
    for d in (128, 256):
        small, big = bwd_config(d, arch=arch), bwd_config(d)
        assert small.dkdv_block_m * small.dkdv_block_n < big.dkdv_block_m * big.dkdv_block_n
    assert bwd_config(64, arch=arch) == bwd_config(64)
    assert fwd_config(256, arch=arch).block_m < fwd_config(256).block_m
    assert fwd_config(128, arch=arch) == fwd_config(128)


# (num_splits, padded head dim) -> (splits per load, columns per program): every split in one load, 4096 values
@pytest.mark.parametrize("args, expected", [
    ((2, 128), (2, 128)),  # two splits: whole rows
    ((33, 128), (64, 64)),  # batch 1, 8 KV heads: 33 splits -> two programs per row
    ((128, 128), (128, 32)),  # MQA at batch 1
    ((256, 256), (256, 16)),  # MAX_SPLITS: still one load
    ((3, 32), (4, 32)),
])
def test_combine_tiles(args, expected):
    assert combine_tiles(*args) == expected


@pytest.mark.parametrize("splits", [1, 2, 3, 33, 100, MAX_SPLITS])
@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_combine_tiles_load_every_split_at_once_within_the_tile_budget(splits, d):
    split_chunk, d_chunk = combine_tiles(splits, d)
    assert split_chunk >= splits and split_chunk * d_chunk <= max(COMBINE_TILE, split_chunk * 16)


# (batch, ctx, Hq, Hkv, head dim, page size or 0, num_splits asked) -> (tokens per step, splits) as the GPU plans them
@pytest.mark.parametrize("shape, expected", [
    ((1, 8192, 32, 8, 128, 0, 0), (64, 33)),
    ((1, 32768, 32, 8, 128, 0, 0), (64, 33)),  # 993-token splits: the nearest count at two programs per SM
    ((1, 131072, 32, 8, 128, 0, 0), (64, 49)),  # long splits: three per SM, rounded down (2675 tokens each)
    ((4, 32768, 32, 8, 128, 0, 0), (64, 12)),
    ((4, 8192, 32, 8, 128, 0, 0), (64, 8)),  # splits of <= 1024 tokens: the nearest count at two per SM
    ((8, 8192, 32, 8, 128, 0, 0), (64, 6)),
    ((8, 32768, 32, 8, 128, 0, 0), (128, 4)),  # long programs: 128-token steps, splits counted again for waves
    ((32, 8192, 32, 8, 128, 0, 0), (128, 1)),
    ((64, 4096, 32, 8, 128, 0, 0), (128, 1)),
    ((128, 1024, 32, 8, 128, 0, 0), (64, 1)),
    ((1, 8192, 8, 1, 128, 0, 0), (64, 128)),  # MQA: one-block splits
    ((128, 1024, 8, 1, 128, 0, 0), (64, 2)),  # nearest count, not rounded up
    ((32, 8192, 32, 8, 64, 0, 0), (256, 1)),  # head dim 64: the same bytes per step
    ((8, 32768, 32, 8, 64, 0, 0), (256, 4)),
    ((32, 8192, 32, 8, 128, 0, 2), (128, 2)),  # a forced count is kept; its programs are long
    ((8, 32768, 32, 8, 128, 16, 0), (128, 4)),  # paged: the paged-large tiles
    ((1, 8192, 32, 8, 128, 16, 0), (64, 50)),  # small, pages shorter than a step: three programs per SM
    ((1, 8192, 32, 8, 128, 64, 0), (64, 33)),  # pages of whole steps (TMA boxes): two, like the contiguous cache
])
def test_decode_plan(shape, expected, monkeypatch):
    from tileflash import _utils

    b, ctx, hq, hkv, d, page, num_splits = shape
    monkeypatch.setattr(_utils, "is_interpreter", lambda: False)
    q = torch.empty(b, 1, hq, d, device="meta", dtype=torch.bfloat16)
    if page:
        k_cache = torch.empty(b * ctx // page, page, hkv, d, device="meta", dtype=torch.bfloat16)
        table = torch.empty(b, ctx // page, device="meta", dtype=torch.int32)
    else:
        k_cache, table = torch.empty(b, ctx, hkv, d, device="meta", dtype=torch.bfloat16), None
    cfg, splits, capacity = plan_decode.split_plan(q, k_cache, table, num_splits)
    assert (cfg.block_n, splits, capacity) == (*expected, ctx)


def test_mla_decode_tiles_and_splits():
    """MLA (qv) tiles by rows (plan.decode.MLA_TILES, run 125), and the split counts they lead to: the 64-row tile
    (one program per SM) takes one wave: at b=1 ctx 32k 66 splits of its two M tiles, the measured best."""
    from tileflash.plan import mla_decode_config

    got = [(c.block_m, c.block_n, c.num_warps, c.num_stages, c.resident_per_sm)
           for c in map(mla_decode_config, (16, 32, 128))]
    assert got == [(16, 64, 4, 2, 0), (32, 64, 4, 2, 0), (64, 64, 8, 2, 1)]
    assert mla_decode_config(128, interpret=True).block_n == 16
    big = mla_decode_config(128)
    one_wave = dict(resident_per_sm=1, per_sm=1)  # plan.decode.split_plan's MLA count
    assert num_splits_heuristic(1, 1, 2, 32768, big.block_n, 132, **one_wave) == 66
    assert num_splits_heuristic(32, 1, 2, 4096, big.block_n, 132, **one_wave) == 2
    assert num_splits_heuristic(128, 1, 2, 1024, big.block_n, 132, **one_wave) == 1


def test_mla_decode_tiles_off_the_h200():
    """Compiled-only targets: sm_10x takes 32-token steps at 64 rows; targets under 200 KB of shared memory per
    block (A100, Ada, consumer Blackwell) take 16-row tiles whatever the head count."""
    from tileflash.plan import SHARED_MEM_PER_BLOCK, mla_decode_config

    assert mla_decode_config(128, arch=100).block_n == 32 and mla_decode_config(16, arch=100) == mla_decode_config(16)
    for arch in (80, 89, 120):
        assert SHARED_MEM_PER_BLOCK[arch] < 200 * 1024
        assert {mla_decode_config(rows, arch=arch).block_m for rows in (16, 64, 128)} == {16}
    assert mla_decode_config(128, arch=None) == mla_decode_config(128)
