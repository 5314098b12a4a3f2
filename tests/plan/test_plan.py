"""Planning (tileflash.plan): properties every choice must have over a broad grid of shapes, plus a few anchor rows
(the measured choices that matter most; their reasons are in the planners' docstrings). No kernel runs."""
import dataclasses
import itertools

import pytest
import torch

from tileflash import _utils, config
from tileflash.plan import (COMBINE_TILE, KV_ELEMENT_BYTES, LONG_SPLIT_PROGRAMS_PER_SM, MAX_MERGE_LOADS, MAX_SPLITS,
                            MERGE_MAX_KV_BYTES, MERGE_TILE, MIN_SPLIT_TOKENS, PAGED_FP8_MIN_SPLITS, QUANT_MMA_HEAD_DIMS,
                            WsFwdConfig,
                            SHARED_MEM_PER_BLOCK, bwd_config, bwd_ws_config, combine_tiles, decode_block_m,
                            decode_config, fused_combine_rule, fwd_config, fwd_ws_config, has_tma, merge_tiles,
                            mla_decode_config, mma_sync_target, num_splits_heuristic, padded_head_dim,
                            quant_decode_config, small_shared_memory, split_head_dim, tensor_memory)
from tileflash.plan import decode as plan_decode
from tileflash.plan.backward import WS_BWD_KEYS, one_launch_rule
from tileflash.plan.prefill import one_wave_rule, tma_tiles

H200_SMS = 132
H200_SMEM = SHARED_MEM_PER_BLOCK[90]
ARCHS = (*SHARED_MEM_PER_BLOCK, None)  # None: the interpreter / no driver, planned as the H200
HEAD_DIMS = (8, 32, 40, 64, 72, 96, 128, 136, 192, 256)  # powers of two and dims that pad up to one
# both sides of each length threshold
KEY_LENGTHS = (1, 256, 257, 512, 513, 1024, 2048, 2049, 4096, 4097, 16384, 2 ** 30)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _frozen(cfg) -> None:
    assert dataclasses.is_dataclass(cfg) and type(cfg).__dataclass_params__.frozen, cfg


def _smem(arch) -> int:
    return SHARED_MEM_PER_BLOCK.get(arch, H200_SMEM)


# ---------------------------------------------------------------------------------------------------- head dims


def test_padded_head_dim_is_the_smallest_power_of_two_from_16():
    for d in range(1, 513):
        p = padded_head_dim(d)
        assert _pow2(p) and p >= max(d, 16) and (p == 16 or p // 2 < d), (d, p)


@pytest.mark.parametrize("d, expected", [(8, 16), (80, 128), (136, 256)])
def test_padded_head_dim_anchors(d, expected):
    assert padded_head_dim(d) == expected


# ---------------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("arch", ARCHS)
def test_fwd_config_properties(arch):
    """Frozen, power-of-two tiles of at least tl.dot's 16, 4 or 8 warps; chosen by the padded head dim only; the
    interpreter's tiles are small and load K/V the GPU's way."""
    for d, causal, seqlen_k in itertools.product(HEAD_DIMS, (False, True), KEY_LENGTHS):
        c = fwd_config(d, causal, seqlen_k=seqlen_k, arch=arch)
        _frozen(c)
        assert _pow2(c.block_m) and _pow2(c.block_n) and min(c.block_m, c.block_n) >= 16, c
        assert c.num_warps in (4, 8) and c.num_stages >= 1, c
        assert c == fwd_config(padded_head_dim(d), causal, seqlen_k=seqlen_k, arch=arch)
        small = fwd_config(d, causal, interpret=True, seqlen_k=seqlen_k, arch=arch)
        assert small.block_m * small.block_n <= 32 * 32 and small.num_stages == 1 and small.tma == c.tma, small


@pytest.mark.parametrize("arch", ARCHS)
def test_fwd_config_fits_shared_memory(arch):
    """Q plus the K and V stages, (block_m + 2 * stages * block_n) * D * 2 bytes (the model the d256 docstring
    reasons with), fit the target's shared memory per block.
    Not asserted: d128 on targets under 200 KB, which keep the H200's tiles (64x64 x 3 stages: 112 KiB by this model;
    128x128 x 3: 224 KiB) against 99 KB (sm_86/89/120) or 163 KB (sm_80): reported, not measured."""
    for d, causal, seqlen_k in itertools.product(HEAD_DIMS, (False, True), KEY_LENGTHS):
        dp = padded_head_dim(d)
        if dp == 128 and small_shared_memory(arch):
            continue
        c = fwd_config(d, causal, seqlen_k=seqlen_k, arch=arch)
        assert (c.block_m + 2 * c.num_stages * c.block_n) * dp * 2 <= _smem(arch), (d, causal, seqlen_k, c)


def test_fwd_config_wide_values_on_small_shared_memory():
    """V's 512-wide latent (qv) takes 16 keys a step under 200 KB of shared memory: the 32-key tile asked sm_120 for
    136 KB (tests/sm90_compile_check.py --arch 120, "prefill qv d64 v512"); sm_90 keeps 32."""
    assert (fwd_config(512, True, seqlen_k=1024, arch=120).block_n, fwd_config(512, True, seqlen_k=1024).block_n) == \
        (16, 32)


@pytest.mark.parametrize("d, causal, seqlen_k, tile", [
    (128, False, 8192, (128, 128, 8, 3)),  # the H200 d128 prefill tile (TMA K/V: 490 TFLOP/s vs 458, run 18)
    (128, False, 4096, (64, 64, 4, 3)),  # short key rows / causal: one warpgroup per program, two per SM
    (64, True, 4097, (128, 64, 8, 3)),  # d64 causal past ONE_WARPGROUP_MAX_KEYS: 128x64
    (256, True, 1024, (128, 64, 8, 2)),  # d256: a third stage would exceed shared memory
    (512, True, 1024, (64, 32, 8, 2)),  # V's 512-wide latent (qv): 96 bytes of stack vs 2 KB for the d256 tile
])
def test_fwd_config_anchors(d, causal, seqlen_k, tile):
    c = fwd_config(d, causal, seqlen_k=seqlen_k)
    assert (c.block_m, c.block_n, c.num_warps, c.num_stages, c.tma) == (*tile, True)


@pytest.mark.parametrize("d, causal, seqlen_k, tile", [
    (128, False, 4096, (64, 128, 4, 3)),  # FP8 (run 139): one warpgroup over 128 keys, 643 vs 507 TFLOP/s
    (128, False, 16384, (128, 128, 8, 3)),  # long full rows keep 128x128 on 8 warps (634 vs 550)
    (128, True, 16384, (64, 128, 4, 3)),  # causal: one warpgroup (8k: 605 vs 491)
    (40, False, 8192, (64, 128, 4, 3)),  # d <= 64 (d64 8k: 491 vs 418)
    (256, False, 8192, (128, 64, 8, 2)),  # d256: P V in fp16 over V rows on 8 warps, no spill (run 198: +5-8%)
])
def test_fwd_config_fp8_anchors(d, causal, seqlen_k, tile):
    c = fwd_config(d, causal, seqlen_k=seqlen_k, fp8=True)
    assert fwd_config(d, causal, seqlen_k=seqlen_k, fp8=True, paged=True).block_n == 64  # run 173: 480 vs 309
    assert (c.block_m, c.block_n, c.num_warps, c.num_stages, c.tma) == (*tile, True)
    assert fwd_config(d, causal, interpret=True, seqlen_k=seqlen_k, fp8=True).block_m == 32  # small tiles


def test_fwd_ws_config_properties():
    """Only head dims the Gluon kernel needs no padding for (V's equal to q's, or DeepSeek-V3's 192 / 128); 128 query
    rows + K and V rings fit the H200's shared memory; persistent CTAs only for short rows (once not persistent,
    longer rows are not either)."""
    for (d, dv), causal in itertools.product([(d, None) for d in HEAD_DIMS] + [(d, d) for d in HEAD_DIMS]
                                             + [(192, 128), (128, 64), (192, 192)], (False, True)):
        persistent = True
        for seqlen_k in KEY_LENGTHS:
            c = fwd_ws_config(d, causal, seqlen_k, head_dim_v=dv)
            if (d, dv or d) not in ((64, 64), (128, 128), (256, 256), (192, 128)):
                assert c is None
                continue
            _frozen(c)
            assert _pow2(c.block_n) and c.k_stages >= 2 and c.v_stages >= 2, c
            smem = (128 * c.q_bufs * d + c.k_stages * c.block_n * d + c.v_stages * c.block_n * (dv or d)) * 2
            assert smem <= H200_SMEM, (d, dv, seqlen_k, c)
            assert persistent or not c.persistent, (d, causal, seqlen_k)
            assert c.q_bufs == 1 or c.persistent, c  # one tile per CTA loads one Q
            persistent = c.persistent


@pytest.mark.parametrize("d, causal, seqlen_k, expected", [
    (128, True, 2048, (128, 3, 3, True, 1)),  # d128: persistent CTAs up to 2k keys (run 108) ...
    (128, True, 2049, (128, 3, 3, False, 1)),  # ... one CTA per tile from there
    (64, False, 4096, (128, 3, 3, True, 2)),  # d64: persistent up to 4k keys, Q a tile ahead (run 190)
    (256, False, 16384, (64, 3, 2, False, 1)),  # d256: 3 K + 2 V stages (224 KB)
    (256, True, 1024, (64, 2, 2, False, 1)),  # ... 2 + 2 with short rows
])
def test_fwd_ws_config_anchors(d, causal, seqlen_k, expected):
    c = fwd_ws_config(d, causal, seqlen_k)
    assert (c.block_n, c.k_stages, c.v_stages, c.persistent, c.q_bufs) == expected


@pytest.mark.parametrize("tiles, sms, persistent", [
    (128, 132, False),  # b=1 s=512 32 heads: every tile on its own SM at once
    (132, 132, False),
    (133, 132, True),  # past one wave: persistent pairs keep the causal blocks balanced
    (256, 132, True),  # b=1 s=1024 32 heads
    (80, 78, True),  # a smaller GPU: the rule counts its SMs
])
def test_one_wave_rule(tiles, sms, persistent):
    for c in (WsFwdConfig(128, 3, 3, persistent=True), WsFwdConfig(128, 3, 3, persistent=True, q_bufs=2)):
        got = one_wave_rule(c, tiles, sms)
        assert got.persistent == persistent and (got.q_bufs == 1 or got.persistent)
        assert one_wave_rule(dataclasses.replace(c, persistent=False, q_bufs=1), tiles, sms).persistent is False


def test_fwd_ws_config_deepseek_and_split_head_dims():
    """q, k 192 / v 128: 128 keys, 2 + 2 stages (208 KB), d128's persistent rule; q's and k's columns as a power of
    two and a tail."""
    assert fwd_ws_config(192, True, 2048, head_dim_v=128) == WsFwdConfig(128, 2, 2, persistent=True)
    assert fwd_ws_config(192, False, 4096, head_dim_v=128) == WsFwdConfig(128, 2, 2, persistent=False)
    assert [split_head_dim(d) for d in (64, 128, 192, 256, 96)] == [(64, 0), (128, 0), (128, 64), (256, 0), (64, 32)]


def test_fwd_ws_config_fp8():
    """FP8 on the Gluon forward: d128 from 8k keys on 128 x 4 + 4 stages, d256 on 64 x 4 + 4 but causal up to 1024
    keys, else (d64, d192, V's head dim not q's) the Triton kernel."""
    for causal in (False, True):
        assert fwd_ws_config(128, causal, 8192, fp8=True) == WsFwdConfig(128, 4, 4)
        assert fwd_ws_config(128, causal, 8191, fp8=True) is None
        assert all(fwd_ws_config(256, causal, s, fp8=True) == WsFwdConfig(64, 4, 4) for s in (1025, 16384))
        assert (fwd_ws_config(256, causal, 1024, fp8=True) is None) == causal
        assert all(fwd_ws_config(d, causal, 16384, fp8=True) is None for d in (64, 192))
        assert fwd_ws_config(192, causal, 16384, head_dim_v=128, fp8=True) is None
        assert fwd_ws_config(256, causal, 16384, head_dim_v=128, fp8=True) is None


# ---------------------------------------------------------------------------------------------------- backward


def test_bwd_ws_config_properties():
    """d64 and d128 only (d256's accumulators do not fit; others need padding), d64 only past 256 keys (512 causal);
    K/V of 128 keys plus the Q/dO stages fit the H200's shared memory."""
    for d, causal, seqlen_k in itertools.product(HEAD_DIMS, (False, True), KEY_LENGTHS):
        c = bwd_ws_config(d, causal, seqlen_k)
        if d not in (64, 128) or (d == 64 and seqlen_k <= (512 if causal else 256)):
            assert c is None, (d, seqlen_k, c)
            continue
        _frozen(c)
        assert _pow2(c.block_m) and c.block_m >= 64 and c.num_stages >= 2, c
        assert (2 * 128 + 2 * c.num_stages * c.block_m) * d * 2 <= H200_SMEM, (d, c)


@pytest.mark.parametrize("d, causal, seqlen_k, expected", [
    (128, False, 1024, (64, 2, True, False)),  # d128: 64 rows per step, one fence per step only when causal
    (128, True, 16384, (64, 2, True, True)),
    (64, False, 4096, (128, 2, True, True)),  # d64: 128 rows per step
    (64, False, 512, (128, 2, True, True)),  # d64 full rows past 256 keys, causal past 512 (runs 235-236)
    (64, True, 1024, (128, 2, True, True)),
])
def test_bwd_ws_config_anchors(d, causal, seqlen_k, expected):
    c = bwd_ws_config(d, causal, seqlen_k)
    assert (c.block_m, c.num_stages, c.atomic_dq, c.one_fence) == expected


def test_bwd_ws_config_one_launch():
    """An eager call's one launch (one_launch_rule) takes the kernel at every head dim it has, d64's short rows
    included (run 257), with the tiles of its longer rows."""
    for d, causal in itertools.product((64, 128), (False, True)):
        c = bwd_ws_config(d, causal, 128, one_launch=True)
        assert c.one_launch and c == dataclasses.replace(bwd_ws_config(d, causal, 1 << 20), one_launch=True)
    assert bwd_ws_config(64, True, 128) is None and bwd_ws_config(96, True, 128, one_launch=True) is None


@pytest.mark.parametrize("rows, ctas, expected", [
    (128, 32, True), (512, 128, True), (513, 128, False),  # fwd+bwd eager at s=128 / 512 is host-bound (run 257)
    (512, 132, True), (512, 133, False),  # one wave of an H100 / H200's 132 SMs
    (128, 2048, False), (512, 256, False),  # 128 query rows over 8k keys at 32 heads; b=2 s=512
])
def test_one_launch_rule(rows, ctas, expected):
    """rows per (batch, KV head) = query rows x group; ctas = batch x KV heads x 128-key blocks."""
    assert one_launch_rule(rows, ctas, 132) is expected


def test_ws_bwd_keys_is_the_kernel_block():
    gluon_bwd = pytest.importorskip("tileflash.kernels.gluon.attn_bwd")
    assert WS_BWD_KEYS == gluon_bwd.BLOCK_KEYS


@pytest.mark.parametrize("arch", ARCHS)
def test_bwd_config_properties(arch):
    """Frozen, power-of-two tiles; chosen by the padded head dim; a dK/dV program's K, V, dK, dV fit 8 warps'
    registers; at least the resident tiles plus the streamed stages of each kernel fit the target's shared memory
    (dK/dV: K, V + stages of Q, dO; dQ: Q, dO + stages of K, V; a lower bound of the real footprint); the
    interpreter's tiles are 16 x 16 at one stage."""
    tiles = ("dkdv_block_m", "dkdv_block_n", "dq_block_m", "dq_block_n")
    for d in HEAD_DIMS:
        dp = padded_head_dim(d)
        c = bwd_config(d, arch=arch)
        _frozen(c)
        assert all(_pow2(getattr(c, f)) and getattr(c, f) >= 16 for f in tiles), c
        assert c == bwd_config(dp, arch=arch)
        assert c.dkdv_block_n * dp <= 128 * 128, c
        assert (2 * c.dkdv_block_n + 2 * c.dkdv_stages * c.dkdv_block_m) * dp * 2 <= _smem(arch), (d, c)
        assert (2 * c.dq_block_m + 2 * c.dq_stages * c.dq_block_n) * dp * 2 <= _smem(arch), (d, c)
        small = bwd_config(d, interpret=True, arch=arch)
        assert {getattr(small, f) for f in tiles} == {16} and small.dkdv_stages == small.dq_stages == 1


@pytest.mark.parametrize("d, expected", [
    (64, (64, 64, 128, 32, 4, 3, 8, 3, False, False, True)),  # d64: 4-warp dK/dV programs, separate dQ pass, TMA
    (128, (64, 128, 128, 64, 8, 3, 8, 2, True, True, False)),  # d128: atomic dQ, staggered (see bwd_config)
    (256, (32, 32, 64, 32, 4, 2, 8, 1, True, True, False)),
])
def test_bwd_config_anchors(d, expected):
    assert dataclasses.astuple(bwd_config(d)) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_bwd_config_dropout_adds_dq_atomically(arch):
    """With dropout every head dim adds dQ up in the dK/dV kernel (d64's own dQ pass would regenerate the keep
    pattern: run 215); the tiles are the same."""
    for d in HEAD_DIMS:
        plain, drop = bwd_config(d, arch=arch), bwd_config(d, arch=arch, dropout=True)
        assert drop == dataclasses.replace(plain, atomic_dq=True)


# ---------------------------------------------------------------------------------------------------- targets


def test_target_predicates():
    """small_shared_memory: under 200 KB per block (None counts as the H200); tensor_memory: sm_10x only."""
    for arch in ARCHS:
        assert small_shared_memory(arch) == (_smem(arch) < 200 * 1024)
        assert tensor_memory(arch) == (arch in (100, 103))
    assert {a for a in SHARED_MEM_PER_BLOCK if small_shared_memory(a)} == {80, 86, 89, 120}


@pytest.mark.parametrize("arch", [100, 103])
def test_bwd_config_fits_blackwell_tensor_memory(arch):
    """sm_10x keeps the dK/dV program's accumulators in 512 columns of tensor memory: dK and dV (D each), S^T and
    dP^T (query rows each) and the atomic dQ step (D) must fit; other targets keep the H200's tiles."""
    for d in (64, 128):
        c = bwd_config(d, arch=arch)
        assert 3 * d + 2 * c.dkdv_block_m <= 512 or not c.atomic_dq
        assert 2 * d + 2 * c.dkdv_block_m <= 512
    assert bwd_config(128, arch=arch).dkdv_block_m == 16  # anchor: 416 columns (64 rows took 576; 32 x 128 spilled)
    assert bwd_config(128, arch=None) == bwd_config(128)


def _tile(c):
    return dataclasses.replace(c, num_warps=0, tma=False)


@pytest.mark.parametrize("arch", [80, 89, 120])
def test_small_shared_memory_targets_take_smaller_tiles(arch):
    """Under 200 KB of shared memory per block the d128/d256 dK/dV tiles and the d256 forward tile shrink (the
    H200's needed 112-128 KB at one stage); d64 and the d128 forward keep the H200's tile shapes."""
    assert small_shared_memory(arch)
    for d in (128, 256):
        small, big = bwd_config(d, arch=arch), bwd_config(d)
        assert small.dkdv_block_m * small.dkdv_block_n < big.dkdv_block_m * big.dkdv_block_n
    b64, b64_h200 = bwd_config(64, arch=arch), bwd_config(64)
    assert (b64.dkdv_block_n, b64.dq_block_m, b64.dq_block_n) == \
        (b64_h200.dkdv_block_n, b64_h200.dq_block_m, b64_h200.dq_block_n)
    assert fwd_config(256, arch=arch).block_m < fwd_config(256).block_m
    assert _tile(fwd_config(128, arch=arch)) == _tile(fwd_config(128))
    # anchors: the tiles these targets compile with
    f, b = fwd_config(256, arch=arch), bwd_config(128, arch=arch)
    assert (f.block_m, f.block_n, f.num_warps, f.num_stages) == (64, 32, 8, 2)
    assert (b.dkdv_block_m, b.dkdv_block_n, b.dq_block_m, b.dq_block_n) == (16, 64, 64, 64)


@pytest.mark.parametrize("arch", sorted(SHARED_MEM_PER_BLOCK))
def test_mma_sync_targets_take_8_warps_and_pre_hopper_pointers(arch):
    """mma.sync targets (sm_8x, sm_12x: MMA operands and accumulators in registers) run every Triton forward and
    decode tile of >= 64 rows, and both backward kernels, with 8 warps, dK/dV in steps of <= 32 query rows (16
    above d64; larger spilled: compile check --res-usage); sm_10x every decode and FP8 tile;
    on them tiles take pointers, not TMA descriptors. Elsewhere the H200's choices stand."""
    mma_sync = arch < 90 or arch >= 120
    assert mma_sync_target(arch) == mma_sync and has_tma(arch) == (not mma_sync)
    assert not mma_sync_target(None) and has_tma(None)
    for d, causal, seqlen_k in itertools.product(HEAD_DIMS, (False, True), KEY_LENGTHS):
        c, h200 = fwd_config(d, causal, seqlen_k=seqlen_k, arch=arch), fwd_config(d, causal, seqlen_k=seqlen_k)
        if mma_sync and c.block_m >= 64:
            assert c.num_warps == 8 and (c.num_stages <= 2 or h200.num_warps == 8), (d, causal, seqlen_k, c)
        if tensor_memory(arch):
            assert c == h200, (d, causal, seqlen_k, c)  # 16-bit prefill tiles: the H200's
            assert fwd_config(d, causal, seqlen_k=seqlen_k, arch=arch, fp8=True).num_warps == 8
        assert c.tma == (h200.tma and not mma_sync)
    for d in HEAD_DIMS:
        b = bwd_config(d, arch=arch)
        rows = 32 if padded_head_dim(d) <= 64 else 16
        assert (b.dkdv_warps == b.dq_warps == 8 and b.dkdv_block_m <= rows) if mma_sync else b.dkdv_warps in (4, 8)
        assert not b.tma or not mma_sync
    for d, rows in itertools.product((64, 128), (1, 4, 64)):
        c, h200 = decode_config(d, rows, arch=arch), decode_config(d, rows)
        assert c.num_warps == (8 if mma_sync and c.block_m >= 64 or tensor_memory(arch) else h200.num_warps)
        block_n = h200.block_n // 2 if arch < 90 and h200.block_n > 64 else h200.block_n  # pointer gathers
        stages = min(h200.num_stages, 2) if mma_sync and c.block_m >= 64 else h200.num_stages  # (8 warps)
        assert c.tma == (not mma_sync) and (c.block_m, c.block_n, c.num_stages) == (h200.block_m, block_n, stages)


# ---------------------------------------------------------------------------------------------------- decode tiles


def test_decode_block_m_properties():
    """A power of two in [16, 64] that covers the rows up to 64 (more take several M tiles), no larger than needed."""
    for rows in range(1, 600):
        m = decode_block_m(rows)
        assert _pow2(m) and 16 <= m <= 64 and m >= min(rows, 64) and (m == 16 or m // 2 < rows), (rows, m)


@pytest.mark.parametrize("rows, expected", [(1, 16), (17, 32), (128, 64)])
def test_decode_block_m_anchors(rows, expected):
    assert decode_block_m(rows) == expected


DECODE_GRID = list(itertools.product((16, 32, 64, 128, 256), ("16bit", "fp8", "nvfp4"), (False, True),
                                     (1, 8192 * 8, 2 ** 18, 2 ** 30), (0, 1024, 4095, 4096, 2 ** 20)))


def test_decode_config_properties():
    """Frozen, pack-GQA rows from decode_block_m, power-of-two steps through TMA with 4 warps; Q plus the K/V stages
    (16-bit, or dequantized to 16 bits) fit the H200; the K/V bytes of a step, times the programs an SM holds, are
    the same at every head dim; the transposed products are the quantized caches'; the interpreter takes 16-token
    single-stage steps."""
    for d, fmt, paged, kv_tokens, tpp in DECODE_GRID:
        for rows in (1, 4, 16, 64):
            c = decode_config(d, rows, kv_format=fmt, paged=paged, kv_tokens=kv_tokens, tokens_per_program=tpp)
            _frozen(c)
            assert c.block_m == decode_block_m(rows) and _pow2(c.block_n) and c.block_n >= 16, c
            assert c.num_warps == 4 and c.tma and c.trans == (fmt != "16bit") and c.resident_per_sm >= 0, c
            assert (c.block_m + 2 * c.num_stages * c.block_n) * d * 2 <= H200_SMEM, (d, fmt, paged, c)
            small = decode_config(d, rows, True, kv_format=fmt, paged=paged, kv_tokens=kv_tokens)
            assert (small.block_m, small.block_n, small.num_stages, small.tma) == (c.block_m, 16, 1, True)
        # the same step bytes at every head dim (kv_tokens scaled so that the large-tile rule sees the same bytes)
        ref = decode_config(128, 4, kv_format=fmt, paged=paged, kv_tokens=kv_tokens * d // 128, tokens_per_program=tpp)
        if d >= 64:
            assert (c.block_n * d, c.resident_per_sm) == (ref.block_n * 128, ref.resident_per_sm), (d, fmt, c, ref)
        else:  # below 64 a step holds fewer bytes, and an SM proportionally more programs
            assert c.block_n * d < ref.block_n * 128 and c.resident_per_sm * c.block_n * d == \
                ref.resident_per_sm * ref.block_n * 128, (d, fmt, c, ref)


def test_decode_config_steps_grow_with_the_cache():
    """Larger caches (kv_tokens) and longer programs (tokens_per_program) never take shorter steps; only
    16-bit contiguous caches look at the program length."""
    for d, fmt, paged in itertools.product((32, 64, 128, 256), ("16bit", "fp8", "nvfp4"), (False, True)):
        if fmt != "16bit" or paged:
            for kv_tokens in (1, 2 ** 30):
                tiles = [decode_config(d, 4, kv_format=fmt, paged=paged, kv_tokens=kv_tokens, tokens_per_program=tpp)
                         for tpp in (0, 4096, 2 ** 20)]
                assert tiles[0] == tiles[1] == tiles[2], (d, fmt, paged, kv_tokens)
        for tpp in (0, 4095, 4096, 2 ** 20):
            prev = 0
            for kv_tokens in (1, 8192 * 8, 2 ** 18 - 1, 2 ** 18, 2 ** 30):
                n = decode_config(d, 4, kv_format=fmt, paged=paged, kv_tokens=kv_tokens, tokens_per_program=tpp).block_n
                assert n >= prev, (d, fmt, paged, kv_tokens, tpp)
                prev = n
        for kv_tokens in (1, 2 ** 30):
            prev = 0
            for tpp in (0, 1024, 4095, 4096, 2 ** 20):
                n = decode_config(d, 4, kv_format=fmt, paged=paged, kv_tokens=kv_tokens, tokens_per_program=tpp).block_n
                assert n >= prev, (d, fmt, paged, kv_tokens, tpp)
                prev = n


@pytest.mark.parametrize("fmt, paged, kv_tokens, tokens_per_program, page_size, expected", [
    ("16bit", False, 2 ** 30, 0, 0, (64, 3, False, 0)),  # 16-bit contiguous: 64 tokens, 3 stages, plain products
    ("16bit", True, 8192 * 8, 0, 0, (64, 2, False, 0)),  # small paged caches: 2 stages (run 280)
    ("16bit", False, 2 ** 30, 4096, 0, (128, 2, False, 1)),  # long programs: 128 tokens, one program per SM
    ("16bit", True, 32768 * 8, 0, 0, (128, 2, False, 1)),  # paged, large (b=1 ctx 32k x 8 KV heads on): gathers
    ("fp8", False, 2 ** 30, 0, 0, (128, 3, True, 2)),  # quantized, large: transposed products, two per SM
    ("fp8", True, 2 ** 30, 0, 16, (64, 3, True, 4)),  # fp8 pages of 16: 64-token gathers (128 spilled)
    ("fp8", True, 2 ** 30, 0, 64, (64, 3, True, 4)),  # ... of 64: 64-token TMA boxes
    ("fp8", True, 2 ** 30, 0, 128, (128, 3, True, 2)),  # ... of 128: the contiguous cache's boxes
])
def test_decode_config_anchors(fmt, paged, kv_tokens, tokens_per_program, page_size, expected):
    c = decode_config(128, 4, kv_format=fmt, paged=paged, kv_tokens=kv_tokens, tokens_per_program=tokens_per_program,
                      page_size=page_size)
    assert (c.block_n, c.num_stages, c.trans, c.resident_per_sm) == expected


@pytest.mark.parametrize("d, page_size, kv_tokens, expected", [
    (128, 64, 32768 * 8, (64, 3, 1)),  # large pools of 64-token pages: TMA boxes, 3 stages (run 193)
    (128, 256, 2 ** 30, (64, 3, 1)),  # ... any page holding whole boxes
    (128, 16, 2 ** 30, (128, 2, 1)),  # pages smaller than a box: pointer gathers over 128-token steps
    (128, 64, 8192 * 8, (64, 2, 0)),  # small pools keep 64-token steps ("16bit-paged")
    (64, 64, 2 ** 30, (256, 2, 1)),  # d64: TMA steps of 128 tokens; a 64-token page cannot hold one (gathers)
    (64, 128, 2 ** 30, (128, 3, 1)),  # ... a 128-token page can
])
def test_decode_config_paged_tma_tiles(d, page_size, kv_tokens, expected):
    c = decode_config(d, 4, paged=True, kv_tokens=kv_tokens, page_size=page_size)
    assert (c.block_n, c.num_stages, c.resident_per_sm) == expected
    assert page_size % c.block_n == 0 or c.block_n == 128 * 128 // d  # TMA boxes, or the gather tile


def test_quant_decode_config_properties():
    """NVFP4 caches at QUANT_MMA_HEAD_DIMS only; once the small steps are taken, more programs or a longer cache
    keep them."""
    programs_grid, capacity_grid = (1, 8, 63, 64, 256, 512, 1023, 1024, 4096), (256, 1024, 2048, 4095, 4096, 2 ** 17)
    for d, fmt in itertools.product(HEAD_DIMS, ("16bit", "fp8", "nvfp4")):
        for programs, capacity in itertools.product(programs_grid, capacity_grid):
            c = quant_decode_config(d, fmt, programs, capacity)
            if fmt != "nvfp4" or d not in QUANT_MMA_HEAD_DIMS:
                assert c is None
                continue
            _frozen(c)
            assert _pow2(c.block_n) and c.step == c.block_n * c.num_warps and c.programs_per_sm >= 1, c
            if c.block_n == 16:
                for more_p, more_c in ((programs * 2, capacity), (programs, capacity * 2)):
                    assert quant_decode_config(d, fmt, more_p, more_c).block_n == 16, (programs, capacity)


@pytest.mark.parametrize("programs, capacity, expected", [
    (8, 131072, (32, 2)),  # b=1 x 8 KV heads: 32-token steps at every length
    (64, 8192, (16, 3)),  # b=8 ctx 8k
    (256, 2048, (32, 2)),  # b=32 ctx 2k: short caches keep the long steps ...
    (1024, 1024, (16, 3)),  # ... until b=128 (no split either way)
])
def test_quant_decode_config_anchors(programs, capacity, expected):
    c = quant_decode_config(128, "nvfp4", programs, capacity)
    assert (c.block_n, c.programs_per_sm) == expected


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


# ---------------------------------------------------------------------------------------------------- split counts

# (Hkv, m_tiles, max_seqlen_k, block_n, num_sms, resident_per_sm, per_sm, long_per_sm); batch is swept separately
SPLIT_GRID = list(itertools.product((1, 8), (1, 2), (1, 100, 511, 512, 1000, 2048, 8192, 32768, 10 ** 6), (32, 128),
                                    (16, 132), (0, 1, 2, 4), (1, 2, 3), (0, LONG_SPLIT_PROGRAMS_PER_SM)))
BATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 32, 33, 64, 100, 128, 256)


def _blocks(max_seqlen_k: int, block_n: int) -> int:
    return _utils.cdiv(max_seqlen_k, block_n) if max_seqlen_k >= MIN_SPLIT_TOKENS else 1


def test_num_splits_properties():
    """In [1, MAX_SPLITS]; never more splits than KV blocks; 1 for caches under MIN_SPLIT_TOKENS and when batch x
    heads x M tiles already give every SM its programs; around the SM target otherwise: at least the count rounded
    down (unless the cache is too short), at most the count rounded up at the larger per-SM target; with a
    limiting residency, never more than per_sm programs per SM, and the largest count whose programs fill 90% of
    whole waves of resident_per_sm per SM when one does."""
    for hkv, m, seqlen, block_n, sms, resident, per_sm, long_per_sm in SPLIT_GRID:
        blocks = _blocks(seqlen, block_n)
        for b in BATCHES:
            base = b * hkv * m
            s = num_splits_heuristic(b, hkv, m, seqlen, block_n, sms, resident, per_sm, long_per_sm)
            args = (b, hkv, m, seqlen, block_n, sms, resident, per_sm, long_per_sm, s)
            assert 1 <= s <= min(MAX_SPLITS, blocks), args
            if base >= max(per_sm, long_per_sm) * sms:
                assert s == 1, args
            if not resident:
                ceil = _utils.cdiv(max(per_sm, long_per_sm) * sms, base)
                assert min(per_sm * sms // base, blocks, MAX_SPLITS) <= s <= max(1, ceil), args
                continue
            assert base * s <= per_sm * sms or s == 1, args
            if resident < per_sm:
                wave, cap = resident * sms, max(1, min(per_sm * sms // base, blocks, MAX_SPLITS))
                fills = [n for n in range(1, cap + 1) if base * n >= 0.9 * _utils.cdiv(base * n, wave) * wave]
                assert s == (max(fills) if fills else cap), args


def test_num_splits_never_rise_with_batch():
    """More sequences, the same or fewer splits each, where the code guarantees it: without long_per_sm and with a
    residency that does not limit (0, or at least per_sm). (With long_per_sm, and with the wave-filling count of a
    limiting residency, it does not hold: see the xfail below and the test above.)"""
    for hkv, m, seqlen, block_n, sms, resident, per_sm, long_per_sm in SPLIT_GRID:
        if long_per_sm or 0 < resident < per_sm:
            continue
        counts = [num_splits_heuristic(b, hkv, m, seqlen, block_n, sms, resident, per_sm) for b in range(1, 200)]
        assert all(a >= b for a, b in zip(counts, counts[1:])), (hkv, m, seqlen, block_n, sms, resident, per_sm)


def test_num_splits_never_rise_with_batch_long_splits():
    """With long_per_sm too (splits judged long at the count they then take; b=5 took 9 splits against b=4's 8 at
    32/8 heads ctx 8k when they were judged at two programs per SM and counted at three)."""
    for hkv, seqlen in itertools.product((1, 4, 8, 16), (1024, 4096, 8192, 32768, 131072)):
        counts = [num_splits_heuristic(b, hkv, 1, seqlen, 64, H200_SMS, long_per_sm=LONG_SPLIT_PROGRAMS_PER_SM)
                  for b in range(1, 300)]
        assert all(a >= b for a, b in zip(counts, counts[1:])), (hkv, seqlen)


# (batch, Hkv, m_tiles, max_seqlen_k, block_n, sms, resident_per_sm, per_sm, long_per_sm) -> splits
@pytest.mark.parametrize("args, expected", [
    ((1, 8, 1, 8192, 64, 132), 33),  # b=1: 8 programs -> the SM target cdiv(264, 8) = 33 (run 38: 20.8 us; 32: 21.6)
    ((1, 1, 1, 8192, 64, 132), 128),  # MQA at batch 1: 128 one-block splits (run 38: 11.5 us)
    ((1, 1, 1, 32768, 64, 132), MAX_SPLITS),  # run 38: 15.5 us at 256, 17.3 at 128
    ((1, 1, 1, 511, 64, 132), 1),  # under MIN_SPLIT_TOKENS (512): not split, however idle the GPU
    ((8, 8, 1, 32768, 128, 132, 1), 4),  # one program per SM: 1.94 waves (5 = 2.4 waves was 28% slower)
    ((1, 8, 1, 131072, 64, 132, 0, 2, 3), 49),  # long splits, three per SM (run 105: 129.2 us vs 135.8 at 33)
])
def test_num_splits_anchors(args, expected):
    assert num_splits_heuristic(*args) == expected


def test_combine_tiles_properties():
    """Every split of a row in one power-of-two load; power-of-two columns within the head dim; the tile within
    COMBINE_TILE values, and either all of it used or the whole row in one program."""
    for splits, d in itertools.product(range(1, MAX_SPLITS + 1), (16, 32, 64, 128, 256, 512)):
        chunk, cols = combine_tiles(splits, d)
        assert _pow2(chunk) and chunk >= max(2, splits), (splits, d, chunk)
        assert _pow2(cols) and 16 <= cols <= d and chunk * cols <= COMBINE_TILE, (splits, d, cols)
        assert chunk * cols == COMBINE_TILE or cols == d, (splits, d, chunk, cols)


@pytest.mark.parametrize("args, expected", [
    ((2, 128), (2, 128)),  # two splits: whole rows
    ((33, 128), (64, 64)),  # batch 1, 8 KV heads: 33 splits -> two programs per row
    ((256, 256), (256, 16)),  # MAX_SPLITS: still one load
])
def test_combine_tiles_anchors(args, expected):
    assert combine_tiles(*args) == expected


def test_merge_tiles_properties():
    """Power-of-two loads of MERGE_TILE values (fewer where a tile has fewer rows), at least two splits a load, no
    more rows than the tile has; the rule fuses exactly where the loads stay within MAX_MERGE_LOADS and the cache
    within MERGE_MAX_KV_BYTES."""
    for rows, d in itertools.product((1, 3, 4, 8, 16, 64), (32, 64, 128, 256, 512)):
        merge_rows, merge_splits = merge_tiles(rows, d)
        assert _pow2(merge_rows) and _pow2(merge_splits) and merge_splits >= 2, (rows, d)
        assert merge_rows * merge_splits * d <= MERGE_TILE and merge_rows <= _utils.next_pow2(rows), (rows, d)
        for splits in range(1, MAX_SPLITS + 1):
            loads = _utils.cdiv(rows, merge_rows) * _utils.cdiv(splits, merge_splits)
            for kv_bytes in (0, MERGE_MAX_KV_BYTES, MERGE_MAX_KV_BYTES + 1):
                expected = splits > 1 and loads <= MAX_MERGE_LOADS and kv_bytes <= MERGE_MAX_KV_BYTES
                assert fused_combine_rule(splits, rows, d, kv_bytes) == expected, (splits, rows, kv_bytes)


MIB = 1 << 20


# (splits, rows, padded head dim, cache bytes read) -> fused
@pytest.mark.parametrize("args, fused", [
    ((1, 4, 128, 0), False),  # no split: nothing to merge
    ((33, 4, 128, 32 * MIB), True),  # b=1 ctx 8k 32/8 heads: 3 loads of 16 splits (run 217: 33.0 vs 38.7 us eager)
    ((50, 4, 128, 32 * MIB), True),  # 50 splits, 4 loads (pages of 16, though, are gathered: decode_config declines)
    ((33, 4, 128, 128 * MIB), False),  # b=1 ctx 32k: the attention outlasts the host (run 228: 70.8 vs 51.7 us)
    ((128, 8, 128, 4 * MIB), False),  # MQA b=1 ctx 8k: 16 loads (runs 228 / 232: 71 us eager vs 6.9 in graphs)
    ((33, 8, 128, 32 * MIB), False),  # MQA b=8 ctx 8k: 5 loads (52.6 vs 17.6)
    ((24, 8, 128, 24 * MIB), True),  # MQA, 24 splits: 3 loads of 8
    ((4, 64, 128, 0), True),  # many rows, few splits: two row blocks of 32, two loads each
    ((6, 64, 128, 0), False),  # ... 6 loads
])
def test_fused_combine_anchors(args, fused):
    assert fused_combine_rule(*args) == fused


@pytest.mark.parametrize("cache, new, rows, plain, strides_equal, fused", [
    (torch.bfloat16, torch.bfloat16, 4, True, True, True),  # GQA decode with a one-token append: in the kernel
    (torch.float16, torch.float16, 16, True, True, True),  # a whole 16-row tile
    (torch.bfloat16, torch.bfloat16, 128, True, True, False),  # two M tiles would both read the new positions
    (torch.float8_e4m3fn, torch.bfloat16, 4, True, True, True),  # FP8 caches: quantized in the kernel too
    (torch.uint8, torch.bfloat16, 4, True, True, False),  # NVFP4 caches: the append kernel quantizes
    (torch.float16, torch.bfloat16, 4, True, True, False),  # a 16-bit cache of another dtype (refused earlier)
    (torch.bfloat16, torch.bfloat16, 4, False, True, False),  # rotary tables or cache_leftpad: the append kernel
    (torch.bfloat16, torch.bfloat16, 4, True, False, False),  # k and v of different strides
])
def test_append_in_kernel(cache, new, rows, plain, strides_equal, fused):
    k_cache = torch.empty(2, 64, 8, 128, device="meta", dtype=cache)
    k = torch.empty(2, 1, 8, 128, device="meta", dtype=new)
    v = k if strides_equal else torch.empty(2, 8, 1, 128, device="meta", dtype=new).transpose(1, 2)
    cfg = decode_config(128, rows)
    assert plan_decode.append_in_kernel(k_cache, k, v, cfg, rows, plain) == fused


# ---------------------------------------------------------------------------------------------------- split plans


@pytest.fixture
def gpu_planning(monkeypatch):
    """Plan as the GPU does (not the interpreter's tiles), on 132 SMs (meta tensors)."""
    monkeypatch.setattr(_utils, "is_interpreter", lambda: False)


def _split_plan(b, ctx, hq, hkv, d, page=0, num_splits=0, fmt="16bit", sq=1, mla=False):
    dtype = {"16bit": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}[fmt]
    width = d // 2 if fmt == "nvfp4" else d
    q = torch.empty(b, sq, hq, d, device="meta", dtype=torch.bfloat16)
    if page:
        k_cache = torch.empty(b * ctx // page, page, hkv, width, device="meta", dtype=dtype)
        table = torch.empty(b, ctx // page, device="meta", dtype=torch.int32)
    else:
        k_cache, table = torch.empty(b, ctx, hkv, width, device="meta", dtype=dtype), None
    return plan_decode.split_plan(q, k_cache, table, num_splits, mla=mla)


def test_split_plan_properties(gpu_planning, monkeypatch):
    """The planned tile is decode_config's for the tokens each split streams (with the whole-cache rule's stage more
    where it takes one split instead of several); splits within [1, KV blocks of that tile]; 1 for short caches and
    when batch x KV heads x M tiles fill every SM; a forced count is kept."""
    monkeypatch.setattr(plan_decode, "sm90_target", lambda: True)  # the same plans on the CPU as on an H200
    heads, dims, pages, fmts = ((8, 1), (32, 8), (64, 8), (16, 16)), (64, 128), (0, 16, 64), ("16bit", "fp8", "nvfp4")
    for (hq, hkv), d, page, fmt, ctx in itertools.product(heads, dims, pages, fmts, (256, 2048, 8192, 32768, 131072)):
        for b in (1, 4, 8, 32, 128):
            cfg, s, capacity = _split_plan(b, ctx, hq, hkv, d, page, fmt=fmt)
            args = (b, ctx, hq, hkv, d, page, fmt, cfg, s)
            first = decode_config(d, hq // hkv, kv_format=fmt, paged=bool(page), kv_tokens=b * ctx * hkv,
                                  page_size=page)  # the tile the count is made for
            m_tiles = _utils.cdiv(hq // hkv, first.block_m)
            two_per_sm = num_splits_heuristic(b, hkv, m_tiles, ctx, first.block_n, H200_SMS)  # more: three an SM
            expected = decode_config(d, hq // hkv, kv_format=fmt, paged=bool(page), kv_tokens=b * ctx * hkv,
                                     tokens_per_program=ctx // s, page_size=page, num_splits=s,
                                     three_per_sm=not page and s > two_per_sm)
            whole = (not page and fmt == "16bit" and plan_decode.whole_cache_programs(b * hkv * m_tiles, H200_SMS)
                     and num_splits_heuristic(b, hkv, m_tiles, ctx, first.block_n, H200_SMS, first.resident_per_sm,
                                              long_per_sm=LONG_SPLIT_PROGRAMS_PER_SM) > 1)
            if whole:  # one program per sequence-head streams the whole cache instead of splitting it
                expected = dataclasses.replace(expected, num_stages=plan_decode.WHOLE_CACHE_STAGES)
                assert s == 1, args
            assert capacity == ctx and cfg == expected, args
            kv_bytes = b * ctx * hkv * d * 2 * KV_ELEMENT_BYTES[fmt]
            gathers = bool(page) and not tma_tiles(cfg, page, fmt == "nvfp4")  # the combine launch (run 282)
            assert cfg.fused_combine == (fused_combine_rule(s, min(cfg.block_m, hq // hkv), d, kv_bytes)
                                         and not gathers), args
            assert 1 <= s <= min(MAX_SPLITS, _utils.cdiv(ctx, cfg.block_n)), args
            floor = (fmt == "fp8" and page and page % (128 * 128 // d) != 0  # no whole 128-token box a page
                     and ctx >= PAGED_FP8_MIN_SPLITS * MIN_SPLIT_TOKENS)
            assert s >= PAGED_FP8_MIN_SPLITS or not floor, args
            if ctx < MIN_SPLIT_TOKENS or b * hkv * _utils.cdiv(hq // hkv, cfg.block_m) >= 3 * H200_SMS:
                assert s == (PAGED_FP8_MIN_SPLITS if floor else 1), args
        assert _split_plan(2, ctx, hq, hkv, d, page, num_splits=7, fmt=fmt)[1] == 7


# (batch, ctx, Hq, Hkv, head dim, page size or 0, num_splits asked) -> (tokens per step, splits) as the GPU plans them
@pytest.mark.parametrize("shape, expected", [
    ((1, 8192, 32, 8, 128, 0, 0), (64, 33)),  # b=1 long context: two programs per SM
    ((1, 131072, 32, 8, 128, 0, 0), (64, 49)),  # long splits: three per SM, rounded down (2675 tokens each)
    ((8, 32768, 32, 8, 128, 0, 0), (128, 4)),  # long programs: 128-token steps, splits counted again for waves
    ((1, 8192, 8, 1, 128, 0, 0), (64, 128)),  # MQA: one-block splits
    ((32, 8192, 32, 8, 128, 0, 2), (128, 2)),  # a forced count is kept; its programs are long
    ((1, 8192, 32, 8, 128, 16, 0), (64, 50)),  # small, pages shorter than a step (gathers): three programs per SM
    ((1, 8192, 32, 8, 128, 64, 0), (64, 33)),  # pages of whole steps (TMA boxes): two, like the contiguous cache
    ((1, 131072, 32, 8, 128, 64, 0), (64, 33)),  # large pools of whole-step pages: 3-stage TMA steps (run 193)
    ((32, 8192, 32, 8, 128, 16, 0, "fp8"), (64, 2)),  # paged FP8: two splits though the batch fills the SMs
    ((128, 1024, 32, 8, 128, 16, 0, "fp8"), (64, 2)),  # ... down to two of MIN_SPLIT_TOKENS (run 231)
    ((128, 1000, 32, 8, 128, 8, 0, "fp8"), (64, 1)),  # shorter: one
    ((32, 8192, 32, 8, 128, 128, 0, "fp8"), (128, 1)),  # pages of whole 128-token boxes: the contiguous rule
])
def test_decode_plan(shape, expected, gpu_planning):
    b, ctx, hq, hkv, d, page, num_splits, *fmt = shape
    cfg, splits, capacity = _split_plan(b, ctx, hq, hkv, d, page, num_splits, *fmt)
    assert (cfg.block_n, splits, capacity) == (*expected, ctx)


# (batch, ctx, Hq, Hkv, head dim) of a contiguous 16-bit cache -> (splits, pipeline stages) as the H200 plans them
@pytest.mark.parametrize("shape, expected", [
    ((1, 8192, 32, 8, 128), (33, 3)),  # two programs per SM: the short tile's 3 stages (runs 279-281)
    ((1, 32768, 32, 8, 128), (33, 3)),
    ((4, 8192, 32, 8, 128), (8, 3)),
    ((2, 16384, 32, 8, 64), (17, 3)),  # two per SM rounded up (272 programs): 3 (run 280)
    ((1, 32768, 8, 1, 128), (256, 3)),  # MQA: one-block splits
    ((1, 131072, 32, 8, 128), (49, 2)),  # counts planned for three per SM: "16bit-wide" (run 285)
    ((8, 8192, 32, 8, 128), (6, 2)),
    ((8, 8192, 32, 8, 64), (6, 2)),
    ((64, 1024, 32, 8, 128), (1, 3)),  # unsplit, two waves: 3 (run 280)
    ((16, 4096, 32, 8, 128), (1, 3)),  # the whole-cache rule's stage more (WHOLE_CACHE_STAGES)
    ((8, 32768, 32, 8, 128), (4, 2)),  # long programs: the 128-token tile's 2
])
def test_decode_stages(shape, expected, gpu_planning, monkeypatch):
    monkeypatch.setattr(plan_decode, "sm90_target", lambda: True)
    cfg, splits, _ = _split_plan(*shape)
    assert (splits, cfg.num_stages) == expected


@pytest.mark.parametrize("programs, whole", [(32, False), (64, False), (98, False), (99, True), (128, True),
                                              (132, True), (133, False), (256, False)])
def test_whole_cache_programs(programs, whole):
    """One split (WHOLE_CACHE_STAGES) from three quarters of the SMs (99 of 132) up to one wave (run 255)."""
    assert plan_decode.whole_cache_programs(programs, H200_SMS) == whole


# (batch, ctx, Hq, Hkv, head dim, page size or 0, num_splits asked, format) -> (tokens per step, stages, splits)
@pytest.mark.parametrize("shape, expected", [
    ((128, 1024, 8, 1, 128, 0, 0, "16bit"), (64, 3, 1)),  # MQA, 128 programs: the whole cache, a third stage
    ((128, 1024, 8, 1, 64, 0, 0, "16bit"), (128, 3, 1)),  # its d64 (128-token steps at d64)
    ((16, 4096, 32, 8, 128, 0, 0, "16bit"), (128, 3, 1)),  # 128 programs of 4k tokens: the long tile, 3 stages
    ((12, 4096, 32, 8, 128, 0, 0, "16bit"), (64, 3, 3)),  # 96 programs: split as before (the short tile's 3 stages)
    ((4, 8192, 32, 8, 128, 0, 0, "16bit"), (64, 3, 8)),  # 32 programs: split as before
    ((32, 2048, 32, 8, 128, 0, 0, "16bit"), (64, 3, 1)),  # 256 programs: one split already
    ((128, 1024, 8, 1, 128, 0, 2, "16bit"), (64, 3, 2)),  # a forced count is kept
    ((128, 1024, 8, 1, 128, 16, 0, "16bit"), (64, 2, 3)),  # paged (gathers): not measured, split as before
    ((128, 1024, 8, 1, 128, 0, 0, "fp8"), (64, 3, 2)),  # FP8: its own tiles, split as before
])
def test_decode_plan_whole_cache(shape, expected, gpu_planning, monkeypatch):
    monkeypatch.setattr(plan_decode, "sm90_target", lambda: True)
    b, ctx, hq, hkv, d, page, num_splits, fmt = shape
    cfg, splits, _ = _split_plan(b, ctx, hq, hkv, d, page, num_splits, fmt)
    assert (cfg.block_n, cfg.num_stages, splits) == expected


# ---------------------------------------------------------------------------------------------------- MLA


def test_mla_decode_tiles_and_splits():
    """MLA (qv) tiles by rows (plan.decode.MLA_TILES, run 125), and the split counts they lead to: the 64-row tile
    (one program per SM) takes one wave: at b=1 ctx 32k 66 splits of its two M tiles, the measured best."""
    got = [(c.block_m, c.block_n, c.num_warps, c.num_stages, c.resident_per_sm)
           for c in map(mla_decode_config, (16, 32, 128))]
    assert got == [(16, 64, 4, 2, 0), (32, 64, 4, 2, 0), (64, 64, 8, 2, 1)]
    fp8 = [(c.block_m, c.block_n, c.num_warps, c.num_stages, c.trans)
           for c in (mla_decode_config(r, fp8=True) for r in (16, 32, 64, 128))]
    # MLA_FP8_TILES (runs 266-270): 32 rows as two 16-row tiles, 64 rows transposed
    assert fp8 == [(16, 128, 4, 2, False), (16, 128, 4, 2, False), (64, 32, 8, 3, True), (64, 32, 8, 3, True)]
    assert mla_decode_config(128, interpret=True).block_n == 16
    big = mla_decode_config(128)
    one_wave = dict(resident_per_sm=1, per_sm=1)  # plan.decode.split_plan's MLA count
    assert num_splits_heuristic(1, 1, 2, 32768, big.block_n, 132, **one_wave) == 66
    assert num_splits_heuristic(32, 1, 2, 4096, big.block_n, 132, **one_wave) == 2
    assert num_splits_heuristic(128, 1, 2, 1024, big.block_n, 132, **one_wave) == 1


def test_mla_split_plan_properties(gpu_planning):
    """MLA plans: mla_decode_config's tile for the rows; a tile an SM holds one of never takes a second wave."""
    for hq, b, ctx in itertools.product((16, 32, 64, 128), (1, 2, 8, 32, 128), (256, 1024, 4096, 32768)):
        cfg, s, _ = _split_plan(b, ctx, hq, 1, 576, mla=True)
        assert cfg == mla_decode_config(hq) and 1 <= s <= min(MAX_SPLITS, _utils.cdiv(ctx, cfg.block_n))
        if cfg.resident_per_sm:
            assert b * _utils.cdiv(hq, cfg.block_m) * s <= cfg.resident_per_sm * H200_SMS or s == 1, (hq, b, ctx, s)


def test_mla_decode_schedule(gpu_planning):
    """decode_schedule for an MLA call (qv; b=1 ctx 32k, 128 heads): the 64-row tile, 64 splits (the heuristic's
    66 give the last two none of the 512 blocks: nonempty_splits), partials as wide as the latent (512) plus the
    lse."""
    q = torch.empty(1, 1, 128, 576, device="meta", dtype=torch.bfloat16)
    k_cache = torch.empty(1, 32768, 1, 576, device="meta", dtype=torch.bfloat16)
    v_cache = torch.empty(1, 32768, 1, 512, device="meta", dtype=torch.bfloat16)
    s = plan_decode.decode_schedule(q, k_cache, v_cache, None, None, 0, False, lse_in_workspace=True, mla=True)
    assert s.mla and s.qcfg is None and (s.cfg.block_m, s.cfg.block_n) == (64, 64) and s.num_splits == 64
    assert s.workspace == 64 * 128 * (512 + 1) + 128


@pytest.mark.parametrize("sm90, mla, forced, expected", [
    (True, False, None, True),  # the Triton decode kernel on sm_90: a programmatic dependent (run 285)
    (False, False, None, False),  # griddepcontrol is sm_90's (and the interpreter has none)
    (True, True, None, True),  # the Gluon MLA kernels too
    (True, False, False, False),  # config.override(decode_after_prior=False), as the A/B probe times it
])
def test_decode_after_prior(sm90, mla, forced, expected, gpu_planning, monkeypatch):
    monkeypatch.setattr(plan_decode, "sm90_target", lambda: sm90)
    q = torch.empty(1, 1, 32, 64 if mla else 128, device="meta", dtype=torch.bfloat16)
    k_cache = torch.empty(1, 8192, 1 if mla else 8, 64 if mla else 128, device="meta", dtype=torch.bfloat16)
    v_cache = torch.empty(1, 8192, 1, 512, device="meta", dtype=torch.bfloat16) if mla else k_cache
    with config.override(**({} if forced is None else {"decode_after_prior": forced})):
        s = plan_decode.decode_schedule(q, k_cache, v_cache, None, None, 0, False, lse_in_workspace=True, mla=mla,
                                        plain_mask=True)
    assert (s.mcfg is not None) == (mla and sm90) and s.after_prior == expected


@pytest.mark.parametrize("splits, blocks, expected", [
    (66, 512, 64),  # MLA H=128 b=1 ctx 32k in 64-token blocks: 64 splits of 8, two of none
    (66, 256, 64),  # the same in the seesaw's block pairs
    (132, 512, 128),  # H=16 (one 16-row tile) b=1 ctx 32k: 128 splits of 4
    (66, 2048, 64),  # ctx 128k: 64 of 32
    (66, 1000, 63),  # 62 of 16 and one of 8
    (66, 132, 66), (64, 512, 64),  # already none empty
    (32, 32, 32),  # one block each
    (3, 7, 3),  # 3 + 3 + 1
    (1, 512, 1), (66, 0, 66),  # no split; nothing to split (an empty cache)
])
def test_nonempty_splits(splits, blocks, expected):
    assert plan_decode.nonempty_splits(splits, blocks) == expected


def test_gluon_mla_splits_are_never_empty(gpu_planning, monkeypatch):
    """Every split of a Gluon MLA plan gets some of the kernel's 64-token blocks (its rule: cdiv(blocks, splits)
    a split), over batches, head counts and lengths, at full lengths."""
    monkeypatch.setattr(plan_decode, "sm90_target", lambda: True)
    for b, hq, ctx in itertools.product((1, 2, 3, 8, 33), (16, 32, 128), (1000, 4096, 16384, 32768, 100_000)):
        q = torch.empty(b, 1, hq, 64, device="meta", dtype=torch.bfloat16)
        k_cache = torch.empty(b, ctx, 1, 64, device="meta", dtype=torch.bfloat16)
        v_cache = torch.empty(b, ctx, 1, 512, device="meta", dtype=torch.bfloat16)
        s = plan_decode.decode_schedule(q, k_cache, v_cache, None, None, 0, False, lse_in_workspace=True, mla=True,
                                        plain_mask=True)
        assert s.mcfg is not None
        blocks = _utils.cdiv(ctx, s.mcfg.block_n)
        assert (s.num_splits - 1) * _utils.cdiv(blocks, s.num_splits) < blocks or s.num_splits == 1, (b, hq, ctx)


def test_mla_decode_tiles_off_the_h200():
    """Compiled-only targets: sm_10x takes 32-token steps at 64 rows, and 8 warps (target_tiles); targets under 200
    KB of shared memory per block (A100, Ada, consumer Blackwell) take 16-row tiles whatever the head count."""
    assert mla_decode_config(128, arch=100).block_n == 32
    assert mla_decode_config(16, arch=100) == dataclasses.replace(mla_decode_config(16), num_warps=8)
    for arch in (80, 89, 120):
        assert small_shared_memory(arch)
        assert {mla_decode_config(rows, arch=arch).block_m for rows in (16, 64, 128)} == {16}
    assert mla_decode_config(128, arch=None) == mla_decode_config(128)


def _mla_call(b=2, sq=1, hq=128, page=None, dtype=torch.bfloat16, latent=512, rope=64, cache_dtype=None):
    q = torch.empty(b, sq, hq, rope, dtype=dtype)
    rows = (b * 128 // page, page) if page else (b, 128)
    cache_dtype = cache_dtype or dtype
    kc, vc = torch.empty(*rows, 1, rope, dtype=cache_dtype), torch.empty(*rows, 1, latent, dtype=cache_dtype)
    return q, kc, vc, (torch.zeros(b, 128 // page, dtype=torch.int32) if page else None)


# (call, extras, plain mask, taken): the Gluon MLA decode's scope and its row rule
MLA_GLUON_TABLE = [
    (dict(), False, True, True),  # H=128, contiguous
    (dict(hq=16), False, True, True),  # 16 rows (run 149: 1.00-1.12x the Triton kernel's 16-row tile)
    (dict(hq=8), False, True, True),  # 8 rows: 8-row tiles (run 217: 1.08-1.27x the Triton kernel)
    (dict(hq=4), False, True, False),  # 4 rows: the Triton kernel (not measured narrow)
    (dict(hq=8, sq=2), False, True, True),  # 16 rows of two tokens
    (dict(page=64), False, True, True), (dict(page=16), False, True, True), (dict(page=8), False, True, True),
    (dict(page=128), False, True, True),  # a multiple of the 64-token block
    (dict(page=48), False, True, False), (dict(page=96), False, True, False),  # neither 8..32 nor a multiple of 64
    (dict(), True, True, False),  # cache_batch_idx, rotary, ALiBi, sinks: the Triton kernel's extras
    (dict(), False, False, False),  # a window or softcap
    (dict(dtype=torch.float16), False, True, True),
    (dict(cache_dtype=torch.float8_e4m3fn), False, True, False),  # FP8 latents at 64 rows: the seesaw reads 16 bits
    (dict(hq=16, cache_dtype=torch.float8_e4m3fn), False, True, True),  # the narrow kernel widens them, one ahead
    (dict(hq=8, cache_dtype=torch.float8_e4m3fn), False, True, True),  # 8-row tiles, one ahead (run 282)
    (dict(hq=32, page=64, cache_dtype=torch.float8_e4m3fn), False, True, True),  # 32 rows: no room to widen ahead
    (dict(hq=16, cache_dtype=torch.float8_e4m3fn), False, False, False),  # softcap: the Triton kernel
    (dict(hq=16, cache_dtype=torch.float8_e5m2), False, True, False),  # e5m2 caches are not served
    (dict(latent=256), False, True, False), (dict(rope=32), False, True, False),
]


@pytest.mark.parametrize("call, extras, plain, taken", MLA_GLUON_TABLE)
def test_mla_gluon_dispatch(call, extras, plain, taken, monkeypatch):
    monkeypatch.setattr(plan_decode, "sm90_target", lambda: True)
    q, kc, vc, table = _mla_call(**call)
    cfg = plan_decode.mla_gluon_config(q, kc, vc, table, extras, plain)
    assert (cfg is not None) == taken
    if taken:
        rows = call.get("sq", 1) * call.get("hq", 128)
        fp8 = call.get("cache_dtype") == torch.float8_e4m3fn
        tile = plan_decode.mla_gluon_rows(rows, fp8)
        assert cfg == plan_decode.MlaGluonConfig(block_n=64, stages=2, rows=tile, ahead=fp8 and tile <= 16)


@pytest.mark.parametrize("rows, tile", [(8, 8), (9, 16), (16, 16), (24, 16), (32, 16), (33, 64), (64, 64), (128, 64),
                                       (2048, 64)])
def test_mla_gluon_rows(rows, tile):
    """The narrow kernel's 8-row tiles for 8 rows a sequence (run 217: H=8), 16-row tiles up to 32 (run 214: H=16
    and H=32), the seesaw's 64 above; FP8 caches one 32-row tile from 17 rows (run 273)."""
    assert plan_decode.mla_gluon_rows(rows) == tile
    assert plan_decode.mla_gluon_rows(rows, fp8=True) == (32 if 16 < rows <= 32 else tile)


def test_mla_gluon_only_on_sm90(monkeypatch):
    q, kc, vc, table = _mla_call()
    monkeypatch.setattr(plan_decode, "sm90_target", lambda: False)  # the interpreter / other targets (any machine)
    assert plan_decode.mla_gluon_config(q, kc, vc, table, False, True) is None


@pytest.mark.parametrize("rows, seqs, gap", [
    (2 * 4096, 2, 144),  # long sequences: zeros through every last key block
    (576, 1, 144),  # the boundary: 144 extra columns are a quarter of the tokens
    (575, 1, 16),
    (4096 * 64, 4096, 16),  # many short sequences: the wide gap would triple V^T
    (0, 0, 144),  # nothing to lay out
])
def test_values_t_gap(rows, seqs, gap):
    from tileflash.plan.prefill import values_t_gap

    assert values_t_gap(rows, seqs) == gap
