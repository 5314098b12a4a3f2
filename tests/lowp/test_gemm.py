"""nvfp4_matmul against a.float() @ dequant(b).T (the reference dequantizer), with the 2x rule; its tile table;
bad input."""
import dataclasses

import pytest
import torch

import tileflash._utils as tf_utils
import tileflash.launch.lowp
from tileflash.launch import direct
from helpers import DEVICE, ON_GPU, ON_SM90, check_2x
from tileflash.lowp.formats import E4M3, nvfp4_dequantize_ref
from tileflash.plan import (GemmConfig, GemmDecodedConfig, GemmMmaConfig, GemmWgmmaConfig, gemm_config,
                            gemm_decoded_config, gemm_mma_config, gemm_wgmma_config)
from tileflash.plan.gemm import native_fp4_config
from tileflash.lowp.gemm import nvfp4_matmul
from tileflash.launch.lowp import launch_nvfp4_dequantize
from tileflash.lowp.quant import nvfp4_dequantize, nvfp4_quantize


def _inputs(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-3, 4, (n, k), generator=g).float())
    return a, nvfp4_quantize(b.to(DEVICE))


def _check(a, b_q, out):
    w = nvfp4_dequantize_ref(*b_q)
    return check_2x(out, a.float() @ w.T, a @ w.to(a.dtype).T)


SHAPES = [
    (1, 32, 16),  # M = 1 (decode): one row of a 16-row tile; K = one scale block, half of a 32-wide K step
    (17, 48, 96),  # odd M across two M tiles; N = 1.5 N tiles; three K steps
    (33, 64, 80),  # K = 2.5 K steps: the last step holds one scale block, the rest masked
    (16, 16, 32),  # exactly one tile in M and K; N half a tile
    (5, 40, 112),  # decode-sized M with K split in two slices (the second ends in a masked half step)
]


@pytest.mark.parametrize("m, n, k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_reference(m, n, k, dtype):
    a, b_q = _inputs(m, n, k, dtype, seed=m + n + k)
    out = nvfp4_matmul(a, *b_q)
    assert out.dtype == dtype and out.shape == (m, n)
    _check(a, b_q, out)


def test_strided_operands():
    # a transposed (column-major), b_data / b_scales with a row stride larger than their width.
    a_t, (data, scales, gs) = _inputs(48, 24, 64, torch.float16, seed=3)
    a = a_t.t().contiguous().t()[:24]
    wide_data = torch.zeros(24, 64, dtype=torch.uint8, device=DEVICE)
    wide_data[:, :32] = data
    wide_scales = torch.zeros(24, 8, dtype=torch.uint8, device=DEVICE)
    wide_scales[:, :4] = scales.view(torch.uint8)
    b_q = (wide_data[:, :32], wide_scales[:, :4].view(E4M3.dtype), gs)
    out = nvfp4_matmul(a, *b_q)
    _check(a, (data, scales, gs), out)


@pytest.mark.parametrize("swap_ab", [False, True], ids=["plain", "swapped"])
@pytest.mark.parametrize("scale_row_bytes", [8, 10], ids=["words", "bytes"])
def test_scale_words_and_byte_fallback(override, scale_row_bytes, swap_ab):
    """64-wide K steps read the block scales as int32 words of four when their rows are 4-byte aligned (here with
    split K and a masked last N tile); a 10-byte row stride falls back to byte loads. Both decode the same, with
    plain (c = a w^T) and swapped (c^T = w a^T) products."""
    override(gemm=GemmConfig(16, 32, 64, 4, 1, split_k=2, swap_ab=swap_ab))
    a, (data, scales, gs) = _inputs(3, 40, 128, torch.bfloat16, seed=6)
    wide = torch.zeros(40, scale_row_bytes, dtype=torch.uint8, device=DEVICE)
    wide[:, :8] = scales.view(torch.uint8)
    out = nvfp4_matmul(a, data, wide[:, :8].view(E4M3.dtype), gs)
    _check(a, (data, scales, gs), out)


@pytest.mark.parametrize("a_nvfp4", [False, True], ids=["w4a16", "w4a4"])
def test_weights_first_load_order_gives_the_same_bits(override, a_nvfp4):
    """The K step's load order (GemmConfig.weights_first, the large-M tiles' choice) changes nothing but speed."""
    cfg = GemmConfig(16, 32, 64, 4, 1)
    a_q, b_q = _w4a4_inputs(20, 40, 128, seed=12)
    a = nvfp4_dequantize_ref(*a_q).to(DEVICE, torch.bfloat16)
    args = (a_q[0], *b_q, a_q[1], a_q[2]) if a_nvfp4 else (a, *b_q)
    outs = []
    for first in (False, True):
        override(gemm=dataclasses.replace(cfg, weights_first=first))
        outs.append(nvfp4_matmul(*args))
    assert torch.equal(outs[0], outs[1])


def test_scale_words_decode_every_e4m3_byte_like_bytes(override):
    """Every e4m3 scale byte (incl. negatives, subnormals and the NaN codes 0x7F / 0xFF) decodes the same from int32
    words (inline PTX on the GPU) as from bytes: column n of the GEMM uses scale byte n for its first block."""
    override(gemm=GemmConfig(16, 32, 64, 4, 1, split_k=1))
    a, (data, scales, gs) = _inputs(4, 256, 128, torch.float16, seed=8)
    s_bytes = scales.view(torch.uint8).clone()
    s_bytes[:, 0] = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    outs = []
    for row_bytes in (8, 12, 10):  # row strides 8 and 12 are 4-byte aligned (words); 10 is not (bytes)
        wide = torch.zeros(256, row_bytes, dtype=torch.uint8, device=DEVICE)
        wide[:, :8] = s_bytes
        outs.append(nvfp4_matmul(a, data, wide[:, :8].view(E4M3.dtype), gs))
    for out in outs[:2]:
        torch.testing.assert_close(out, outs[2], rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(outs[2][:, 0x7F]).all() and torch.isnan(outs[2][:, 0xFF]).all()


def test_nan_scale_poisons_its_output_column():
    a, (data, scales, gs) = _inputs(5, 32, 32, torch.float16, seed=4)
    scales = scales.clone()
    scales.view(torch.uint8)[7, 1] = 0x7F  # NaN
    out = nvfp4_matmul(a, data, scales, gs)
    assert torch.isnan(out[:, 7]).all()
    assert not torch.isnan(out[:, :7]).any() and not torch.isnan(out[:, 8:]).any()


def test_matches_dequantize_then_matmul():
    # The public dequantize kernel and the GEMM decode the same format.
    a, b_q = _inputs(9, 32, 64, torch.float16, seed=5)
    w = nvfp4_dequantize(*b_q)
    check_2x(nvfp4_matmul(a, *b_q), a.float() @ w.T, a @ w.half().T)


@pytest.mark.parametrize("m, n, k, wgmma, expected", [
    (256, 8192, 8192, False, None),  # the fused kernels' rows
    (257, 8192, 8192, False, GemmDecodedConfig(4096)),  # 64 MiB of bf16: 4096 rows of 8192
    (257, 8192, 8192, True, None),  # the wgmma kernel's rows (sm_90)
    (1024, 8192, 8192, True, None),
    (1025, 8192, 8192, True, GemmDecodedConfig(4096)),
    (4096, 28672, 4096, True, GemmDecodedConfig(8192)),
    (300, 8192, 8320, True, GemmDecodedConfig(3968)),  # K not the wgmma kernel's: decoded from 257 rows
    (1024, 100, 4096, False, GemmDecodedConfig(100)),  # the whole weight in one chunk
    (1024, 8192, 1 << 20, False, GemmDecodedConfig(128)),  # 128 rows at least
])
def test_gemm_decoded_config_table(m, n, k, wgmma, expected):
    assert gemm_decoded_config(m, n, k, wgmma=wgmma) == expected
    assert gemm_decoded_config(m, n, k, native_fp4=True, wgmma=wgmma) is None  # Blackwell's W4A4: its FP4 MMA


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weight_decoded_to_16_bits_rounds_once(dtype):
    """The decoded weight of the large-M route (every e4m3 scale byte, every code) is the fp32 dequantization rounded
    once to a's dtype: bitwise what nvfp4_dequantize(...).to(dtype) gives, NaN scales included."""
    _, (data, scales, gs) = _inputs(1, 256, 32, torch.float16, seed=22)
    s_bytes = scales.view(torch.uint8).clone()
    s_bytes[:, 0] = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    data = data.clone()
    data[:, :8] = torch.arange(256, dtype=torch.uint8, device=DEVICE)[:, None]  # every pair of codes
    gs = torch.tensor(0.37, device=DEVICE)  # not a power of two: the product with it rounds
    got = torch.full((256, 32), float("nan"), dtype=dtype, device=DEVICE)
    launch_nvfp4_dequantize(data, s_bytes, gs, got)
    want = nvfp4_dequantize(data, s_bytes.view(E4M3.dtype), gs).to(dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.fixture
def weight_decodes(monkeypatch):
    """The row counts of the decoded route's decodes (launch_nvfp4_dequantize calls: a W4A4 call's a first, then
    the weight's chunks) during the test; rows.targets: the tensors they decoded into."""
    rows = _Decodes()
    launch = tileflash.launch.lowp.launch_nvfp4_dequantize

    def record(d2, *rest):
        rows.append(d2.shape[0])
        rows.targets.append(rest[-1])
        return launch(d2, *rest)

    monkeypatch.setattr(tileflash.launch.lowp, "launch_nvfp4_dequantize", record)
    return rows


class _Decodes(list):
    def __init__(self):
        super().__init__()
        self.targets = []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows, chunks", [(128, [100]), (48, [48, 48, 4])], ids=["one-chunk", "chunks-tail"])
def test_decoded_weight_route(override, weight_decodes, dtype, chunk_rows, chunks):
    """W4A16 above 256 rows (forced here at a small shape): the weight decoded into a's dtype chunk by chunk (here
    also 48-row chunks and a 4-row tail), then cuBLAS (torch.mm) into each chunk's output columns. One chunk is
    bitwise a @ nvfp4_dequantize(b).to(a.dtype).T; chunks keep the 2x rule (each column has the same operands).
    An a that requires grad is taken as a value (nvfp4_matmul has no gradient; torch.mm's out= would refuse it)."""
    override(gemm_decoded=GemmDecodedConfig(chunk_rows))
    a, b_q = _inputs(7, 100, 96, dtype, seed=21)
    a = a.t().contiguous().t().requires_grad_()  # column-major a: cuBLAS takes any strides
    out = nvfp4_matmul(a, *b_q)
    assert weight_decodes == chunks
    assert out.dtype == dtype and out.shape == (7, 100) and not out.requires_grad
    a = a.detach()
    if len(chunks) == 1:
        torch.testing.assert_close(out, a @ nvfp4_dequantize(*b_q).to(dtype).T, rtol=0, atol=0)
    _check(a, b_q, out)


@pytest.mark.parametrize("m, k", [(257, 64), (1025, 256)], ids=["no-wgmma-K", "past-wgmma-rows"])
def test_decoded_weight_route_is_the_default_at_large_m(weight_decodes, m, k):
    """Above 256 rows where the wgmma kernel cannot take K (not a multiple of 256), above 1024 everywhere."""
    a, b_q = _inputs(m, 40, k, torch.bfloat16, seed=23)
    out = nvfp4_matmul(a, *b_q)
    assert weight_decodes == [40]  # gemm_decoded_config's one chunk: the whole weight
    _check(a, b_q, out)


def _w4a4_inputs(m, n, k, seed):
    """NVFP4 a and b (W4A4); a spans several decades too, so its block scales differ."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-4, 3, (m, k), generator=g).float())
    return nvfp4_quantize(a.to(DEVICE)), _inputs(1, n, k, torch.float16, seed=seed + 1)[1]


def _check_w4a4(a_q, b_q, out):
    a_deq, w = nvfp4_dequantize_ref(*a_q), nvfp4_dequantize_ref(*b_q)
    return check_2x(out, a_deq @ w.T, a_deq.to(out.dtype) @ w.to(out.dtype).T)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows, chunks", [(128, [9, 100]), (48, [9, 48, 48, 4])],
                         ids=["one-chunk", "chunks-tail"])
def test_decoded_route_w4a4(override, weight_decodes, out_dtype, chunk_rows, chunks):
    """W4A4 on the decoded route (forced at a small shape): a decoded whole into out_dtype, then the weight chunk by
    chunk, then cuBLAS: with one chunk bitwise nvfp4_dequantize(a).to(dtype) @ nvfp4_dequantize(b).to(dtype).T."""
    override(gemm_decoded=GemmDecodedConfig(chunk_rows))
    a_q, b_q = _w4a4_inputs(9, 100, 96, seed=24)
    out = nvfp4_matmul(a_q[0], *b_q, a_scales=a_q[1], a_global_scale=a_q[2], out_dtype=out_dtype)
    assert weight_decodes == chunks  # a's 9 rows first
    assert out.dtype == out_dtype and out.shape == (9, 100)
    # a's decode is the call's own buffer: the kept workspace holds the weight's chunk only (not M x K for good)
    kept = {buf.untyped_storage().data_ptr() for buf in direct.WORKSPACE.buffers.values()}
    targets = [t.untyped_storage().data_ptr() for t in weight_decodes.targets]
    assert targets[0] not in kept and all(t in kept for t in targets[1:])
    if len(chunks) == 2:
        want = nvfp4_dequantize(*a_q).to(out_dtype) @ nvfp4_dequantize(*b_q).to(out_dtype).T
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    _check_w4a4(a_q, b_q, out)


@pytest.mark.skipif(ON_GPU and torch.cuda.get_device_capability()[0] in (10, 12),
                    reason="Blackwell's W4A4 keeps the native FP4 MMA")
def test_decoded_route_is_w4a4s_default_at_large_m(weight_decodes):
    a_q, b_q = _w4a4_inputs(257, 40, 64, seed=25)
    out = nvfp4_matmul(a_q[0], *b_q, a_scales=a_q[1], a_global_scale=a_q[2])
    assert weight_decodes == [257, 40]
    _check_w4a4(a_q, b_q, out)


@pytest.mark.parametrize("m, n, k", SHAPES[1:], ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES[1:]])
@pytest.mark.parametrize("out_dtype", [None, torch.float16], ids=["bf16", "fp16"])
def test_w4a4_matches_reference(m, n, k, out_dtype):
    """Both operands NVFP4: the product of the two dequantized matrices, out in bf16 unless out_dtype says."""
    a_q, b_q = _w4a4_inputs(m, n, k, seed=m + n + k)
    out = nvfp4_matmul(a_q[0], *b_q, a_q[1], a_q[2], out_dtype=out_dtype)
    assert out.dtype == (out_dtype or torch.bfloat16) and out.shape == (m, n)
    _check_w4a4(a_q, b_q, out)


@pytest.mark.parametrize("swap_ab", [False, True], ids=["plain", "swapped"])
@pytest.mark.parametrize("a_row_bytes", [8, 10], ids=["words", "bytes"])
def test_w4a4_scale_words_strides_and_split(override, a_row_bytes, swap_ab):
    """a's scales read as int32 words (4-byte aligned rows) or bytes (a 10-byte row stride: both operands fall
    back), a's codes with a row stride wider than K/2, split K, plain and swapped products."""
    override(gemm=GemmConfig(16, 32, 64, 4, 1, split_k=2, swap_ab=swap_ab))
    (a_data, a_scales, a_g), b_q = _w4a4_inputs(5, 40, 128, seed=9)
    wide_data = torch.zeros(5, 80, dtype=torch.uint8, device=DEVICE)
    wide_data[:, :64] = a_data
    wide_scales = torch.zeros(5, a_row_bytes, dtype=torch.uint8, device=DEVICE)
    wide_scales[:, :8] = a_scales.view(torch.uint8)
    out = nvfp4_matmul(wide_data[:, :64], *b_q, wide_scales[:, :8].view(E4M3.dtype), a_g)
    _check_w4a4((a_data, a_scales, a_g), b_q, out)


@pytest.mark.skipif(ON_GPU, reason="interpreter-only: shows the bf16 interpreter hazard is caught")
def test_bf16_check_can_fail(monkeypatch):
    """Without the interpreter's fp32 widening the bf16 dot runs on raw bits; the 2x check must catch it."""
    monkeypatch.setattr(tf_utils, "INTERPRETER_UPCAST", False)
    a, b_q = _inputs(17, 32, 64, torch.bfloat16, seed=6)
    try:
        out = nvfp4_matmul(a, *b_q)
    except Exception:
        return  # the interpreter may also refuse raw-bit bf16 dots outright; either way it cannot pass silently
    with pytest.raises(AssertionError):
        _check(a, b_q, out)


@pytest.mark.parametrize("m, n, expected", [
    # decode-sized M: swapped products over 64-column weight tiles, K split until ~3 programs per SM
    (1, 4096, GemmConfig(16, 64, 128, 4, 4, split_k=4, swap_ab=True)),  # 64 N tiles: 7 slices wanted, 4 at most
    (16, 8192, GemmConfig(16, 64, 128, 4, 4, split_k=4, swap_ab=True)),
    (16, 65536, GemmConfig(16, 64, 128, 4, 4, split_k=1, swap_ab=True)),  # enough N tiles alone
    # serving batches: swapped products too (the activation rows on wgmma's N side)
    (17, 4096, GemmConfig(32, 128, 128, 4, 3, split_k=4, swap_ab=True)),
    (64, 4096, GemmConfig(64, 64, 128, 4, 3, swap_ab=True)),
    (128, 4096, GemmConfig(128, 64, 128, 4, 3, swap_ab=True)),
    (257, 4096, GemmConfig(128, 128, 64, 8, 3, weights_first=True)),  # b loaded first: 4-7% at M >= 1024
    (4096, 4096, GemmConfig(128, 128, 64, 8, 3, weights_first=True)),
])
def test_gemm_config_table(m, n, expected):
    assert gemm_config(m, n, 4096) == expected


@pytest.mark.parametrize("m, n, k, expected", [
    # K in slices of at most 2 steps of 256; N tiles per program (<= 4) until 3 programs per SM (132 SMs) remain
    (1, 4096, 4096, GemmMmaConfig(64, 256, split_k=8, programs_n=32)),  # 512 tile-slices: two tiles per program
    (16, 8192, 8192, GemmMmaConfig(64, 256, split_k=16, programs_n=32)),  # 2048 tile-slices: four per program
    (1, 65536, 4096, GemmMmaConfig(64, 256, split_k=8, programs_n=256)),  # 8192 tile-slices: four (at most)
    (16, 200, 400, GemmMmaConfig(64, 256, split_k=1, programs_n=4)),  # 2 K steps: one slice; N tail
    (1, 64, 100000, GemmMmaConfig(64, 256, split_k=196, programs_n=1)),  # 391 steps: 196 slices of <= 2
    (17, 4096, 4096, None),  # more rows than one mma.sync tile: the Triton kernel
])
def test_gemm_mma_config_table(m, n, k, expected):
    assert gemm_mma_config(m, n, k) == expected


def test_gemm_mma_config_forced_choices():
    assert gemm_mma_config(1, 8192, 8192, tiles_per_program=4, split_k=8) == GemmMmaConfig(64, 256, 8, 32)
    assert gemm_mma_config(1, 64, 256, split_k=4).split_k == 1  # never more slices than K steps


# The register-operand kernel (lowp/kernels/gemm_mma.py) serves M <= 16 where the wgmma kernel cannot (K not a
# multiple of 256, weights TMA cannot address); the tests decline the wgmma kernel to run it on any shape.
MMA_SHAPES = [  # K a multiple of 32 (the kernel's 16-byte vectors)
    (1, 4096, 4096),  # decode GEMM: four K slices, one N tile per program
    (16, 200, 416),  # one slice of 1.6 steps (a masked K tail of 160 values), an N tail of 8 rows
    (3, 1000, 8224),  # 17 slices, the last a 32-value tail; 16 tiles, the last one 40 rows
    (16, 64, 32),  # K = two scale blocks: a single masked step
    (7, 8192, 2048),  # four slices of 2 whole steps, one N tile per program
]


@pytest.mark.skipif(not ON_SM90, reason="the register-operand Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("m, n, k", MMA_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in MMA_SHAPES])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_kernel_matches_reference(m, n, k, dtype, monkeypatch, override):
    override(gemm_wgmma=None)
    calls = _count_mma_launches(monkeypatch)
    a, b_q = _inputs(m, n, k, dtype, seed=m * 7 + n + k)
    out = nvfp4_matmul(a, *b_q)
    assert out.dtype == dtype and out.shape == (m, n)
    _check(a, b_q, out)
    assert calls == [1]  # it ran the Gluon kernel


def _count_mma_launches(monkeypatch, counted=None):
    """Count launches of a Gluon GEMM kernel, the register-operand one by default (a call's first launch goes
    through direct.launch; later calls of the same signature replay it)."""
    from tileflash.lowp.kernels.gemm_mma import nvfp4_matmul_mma_kernel
    from tileflash.launch import direct

    counted = counted or nvfp4_matmul_mma_kernel
    calls, launch = [], direct.launch
    monkeypatch.setattr(direct, "launch", lambda kernel, *a, **k: (
        calls.append(1) if kernel is counted else None) or launch(kernel, *a, **k))
    return calls


def _count_wgmma_launches(monkeypatch):
    from tileflash.lowp.kernels.gemm_wgmma import nvfp4_matmul_wgmma_kernel

    return _count_mma_launches(monkeypatch, nvfp4_matmul_wgmma_kernel)


@pytest.mark.skipif(not ON_SM90, reason="the register-operand Gluon kernel runs on sm_90 only")
def test_mma_kernel_split_sum_is_reproducible(override):
    """Split K (16 slices): the fp32 partials are added in slice order, so repeated calls give the same bits."""
    override(gemm_wgmma=None)
    a, b_q = _inputs(5, 1024, 8192, torch.bfloat16, seed=14)
    first = nvfp4_matmul(a, *b_q)
    _check(a, b_q, first)
    for _ in range(5):
        assert torch.equal(nvfp4_matmul(a, *b_q), first)


@pytest.mark.skipif(not ON_SM90, reason="the register-operand Gluon kernel runs on sm_90 only")
def test_mma_kernel_declines_what_it_cannot_address(monkeypatch, override):
    """K not a multiple of 32, a column-strided a: the Triton kernel serves them (still correct)."""
    override(gemm_wgmma=None)
    calls = _count_mma_launches(monkeypatch)
    a, b_q = _inputs(4, 64, 400, torch.bfloat16, seed=12)
    _check(a, b_q, nvfp4_matmul(a, *b_q))
    a, b_q = _inputs(4, 64, 512, torch.bfloat16, seed=13)
    wide = torch.zeros(4, 1024, dtype=torch.bfloat16, device=DEVICE)
    wide[:, ::2] = a
    _check(a, b_q, nvfp4_matmul(wide[:, ::2], *b_q))
    assert calls == []


@pytest.mark.skipif(not ON_SM90, reason="the register-operand Gluon kernel runs on sm_90 only")
def test_mma_kernel_row_scales_keep_every_magnitude(override):
    """Each activation row goes to fp16 scaled by its own power of two: rows near bf16's top (fp16 overflows at
    65504), tiny rows (fp16 subnormals) and a zero row all match the reference; rows with a stride too."""
    override(gemm_wgmma=None)
    a, b_q = _inputs(8, 256, 1024, torch.bfloat16, seed=11)
    a = a * torch.tensor([1e30, 1e-30, 1.0, 0.0, 7e4, 3e-6, 1.0, 1e10], device=DEVICE, dtype=torch.bfloat16)[:, None]
    _check(a, b_q, nvfp4_matmul(a, *b_q))
    wide = torch.zeros(8, 2048, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :1024] = a
    _check(a, b_q, nvfp4_matmul(wide[:, :1024], *b_q))


def test_gemm_config_w4a4_and_mma_sync_targets_take_8_warps():
    """Decoding both operands, or mma.sync targets (operands and accumulator in registers), spill with 4 warps
    on the 128x64 tile (compile check --res-usage); elsewhere the table above holds."""
    assert gemm_config(128, 4096, 4096, a_nvfp4=True) == GemmConfig(128, 64, 128, 8, 3)
    assert gemm_config(128, 4096, 4096, arch=120) == GemmConfig(128, 64, 128, 8, 3)
    assert gemm_config(128, 4096, 4096, arch=89) == GemmConfig(128, 64, 128, 8, 3)
    assert gemm_config(128, 4096, 4096, arch=90) == gemm_config(128, 4096, 4096, arch=100) \
        == GemmConfig(128, 64, 128, 4, 3, swap_ab=True)
    assert gemm_config(1, 4096, 4096, a_nvfp4=True) == gemm_config(1, 4096, 4096)


@pytest.mark.parametrize("m, n, expected", [
    (1, 4096, GemmConfig(16, 128, 128, 4, 3, split_k=4, swap_ab=True)),  # 32 N tiles: 4 slices
    (16, 65536, GemmConfig(16, 128, 128, 4, 3, split_k=1, swap_ab=True)),
    (17, 4096, GemmConfig(128, 64, 128, 8, 3)),
    (4096, 4096, GemmConfig(128, 64, 128, 8, 3)),
])
def test_native_fp4_config_table(m, n, expected):
    assert native_fp4_config(m, n, 4096) == expected
    assert gemm_config(m, n, 4096, a_nvfp4=True, native_fp4=True) == expected


def test_gemm_config_split_k_keeps_four_k_steps_per_slice():
    assert gemm_config(1, 64, 1024).split_k == 2  # 8 K steps of 128: at most 2 slices
    assert gemm_config(1, 32, 256).split_k == 1


def test_gemm_config_interpreter_uses_small_tiles():
    assert gemm_config(4096, 4096, 4096, interpret=True) == GemmConfig(16, 32, 32, 4, 1)
    assert gemm_config(8, 48, 96, interpret=True).split_k == 2  # the CPU tests cover split-K


def test_compile_fullgraph_matches_eager():
    """The three NVFP4 ops are custom ops with fake implementations: torch.compile traces them whole."""
    a, _ = _inputs(3, 16, 32, torch.float16, seed=7)
    b = torch.randn(16, 32, generator=torch.Generator().manual_seed(8)).to(DEVICE)

    def fn(a, b):
        a_q, b_q = nvfp4_quantize(a), nvfp4_quantize(b)
        return (nvfp4_matmul(a, *b_q), nvfp4_dequantize(*b_q),
                nvfp4_matmul(a_q[0], *b_q, a_q[1], a_q[2], out_dtype=torch.float16))

    eager = fn(a, b)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(a, b)
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)


def _args(m=4, n=16, k=32):
    a, b_q = _inputs(m, n, k, torch.float16)
    return [a, *b_q]


def _with(i, value):
    args = _args()
    args[i] = value(args[i])
    return args


ERROR_CASES = [
    (lambda: _with(0, lambda a: a.float()), TypeError, "a: expected dtype"),
    (lambda: _with(0, lambda a: a[0]), ValueError, "a: expected 2 dimensions"),
    (lambda: [torch.randn(4, 24, device=DEVICE).half(), *_args()[1:]], ValueError, "a: K"),
    (lambda: _with(1, lambda d: d[:, :8]), ValueError, "b_data: expected shape"),  # K/2 != a's K / 2
    (lambda: _with(1, lambda d: d.to(torch.int8)), TypeError, "b_data"),
    (lambda: _with(1, lambda d: d.to("meta")), ValueError, "b_data: expected device"),
    (lambda: _with(2, lambda s: s.float()), TypeError, "b_scales"),
    (lambda: _with(2, lambda s: s[:, :1]), ValueError, "b_scales: expected shape"),
    (lambda: _with(2, lambda s: s.to("meta")), ValueError, "b_scales: expected device"),
    (lambda: _with(3, lambda g: g.reshape(1)), ValueError, "b_global_scale"),
    (lambda: _with(3, lambda g: g.double()), TypeError, "b_global_scale"),
    (lambda: _with(3, lambda g: 1.0), TypeError, "b_global_scale"),
    # W4A4: an NVFP4 a (uint8 codes) with its scales
    (lambda: [_w4a4_args()[0], *_w4a4_args()[1:4]], ValueError, "a_scales and a_global_scale"),
    (lambda: [*_args(), _w4a4_args()[4], _w4a4_args()[5]], ValueError, "only for an NVFP4 a"),
    (lambda: _w4a4_with(4, lambda s: s[:, :1]), ValueError, "a_scales: expected shape"),
    (lambda: _w4a4_with(5, lambda g: g.double()), TypeError, "a_global_scale"),
    (lambda: _w4a4_with(1, lambda d: d[:, :8]), ValueError, "b_data: expected shape"),  # b's K != a's K
]


def _w4a4_args(m=4, n=16, k=32):
    a_q, b_q = _w4a4_inputs(m, n, k, seed=0)
    return [a_q[0], *b_q, a_q[1], a_q[2]]


def _w4a4_with(i, value):
    args = _w4a4_args()
    args[i] = value(args[i])
    return args


@pytest.mark.parametrize("out_dtype, a_nvfp4, needle", [
    (torch.float32, True, "expected torch.bfloat16 or torch.float16"),
    (torch.bfloat16, False, "out in a's dtype"),  # a 16-bit a is fp16 here
])
def test_out_dtype_errors(out_dtype, a_nvfp4, needle):
    with pytest.raises(ValueError, match=needle):
        nvfp4_matmul(*(_w4a4_args() if a_nvfp4 else _args()), out_dtype=out_dtype)


@pytest.mark.parametrize("make_args, exc, needle", ERROR_CASES, ids=[str(i) for i in range(len(ERROR_CASES))])
def test_errors_name_the_argument(make_args, exc, needle):
    with pytest.raises(exc, match=needle):
        nvfp4_matmul(*make_args())


# The wgmma kernel (M <= 1024 on sm_90, lowp/kernels/gemm_wgmma.py) and its activation prep pass.

def _prep_reference(a, m_pad):
    """activation_prep_kernel's definition: rows scaled by 2^k into [2^8, 2^9), even / odd K halves, each 64 values
    in the weight decode's contraction order (position 16kb + 8i1 + 2t + i0 holds value 16t + 4kb + 2i1 + i0)."""
    x = a.float()
    amax = torch.where(x.abs() < float("inf"), x.abs(), 0.0).amax(1)
    e = (amax.view(torch.int32) >> 23) & 0xFF
    k = torch.where(e == 0, 0, (135 - e).clamp(-126, 126))
    scaled = (x * torch.exp2(k.float())[:, None]).half()
    m, kk = a.shape
    halves = scaled.view(m, kk // 2, 2).permute(2, 0, 1)  # [2, M, K/2]
    halves = halves.reshape(2, m, kk // 128, 4, 4, 2, 2).permute(0, 1, 2, 4, 5, 3, 6).reshape(2, m, kk // 2)
    prep = torch.zeros(2, m_pad, kk // 2, dtype=torch.float16, device=a.device)
    prep[:, :m] = halves
    return prep.reshape(2 * m_pad, kk // 2), torch.exp2(-k.float())


@pytest.mark.parametrize("k, block_k", [(256, 256), (768, 512)], ids=["one-block", "masked-tail"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_activation_prep_matches_its_definition(k, block_k, dtype):
    """The prep pass in the interpreter (CPU) and on the GPU: halves, order, row scales (rows near bf16's top,
    tiny, zero, strided) and the zero rows past M, bit for bit."""
    from tileflash.lowp.kernels.gemm_wgmma import activation_prep_kernel

    m, m_pad = 6, 8
    g = torch.Generator().manual_seed(k)
    rows = torch.tensor([1.0, 1e-30 if dtype == torch.bfloat16 else 1e-3, 0.0, 7e4 if dtype == torch.bfloat16
                         else 300.0, 3e-6, 1e30 if dtype == torch.bfloat16 else 1.0])
    wide = (torch.randn(m, 2 * k, generator=g) * rows[:, None]).to(DEVICE, dtype)
    a = wide[:, ::2]  # column stride 2
    prep = torch.full((2 * m_pad, k // 2), float("nan"), dtype=torch.float16, device=DEVICE)
    factor = torch.full((m_pad,), float("nan"), device=DEVICE)
    activation_prep_kernel[(m_pad,)](a, prep, factor, m, m_pad, k, a.stride(0), a.stride(1), BLOCK_K=block_k)
    want, want_factor = _prep_reference(a, m_pad)
    assert torch.equal(prep, want)
    assert torch.equal(factor[:m], want_factor)


def test_prep_order_pairs_with_the_weight_order():
    """The algebra the wgmma kernel relies on, in PyTorch: the prepared halves times the weight's low / high
    nibbles in the same contraction order (bytes of a row in the decode's digit order) give a @ w^T."""
    m, n, k = 3, 5, 256
    a, b_q = _inputs(m, n, k, torch.float16, seed=4)
    w = nvfp4_dequantize_ref(*b_q)  # [N, K]
    prep, factor = _prep_reference(a.cpu(), m)
    order = torch.arange(k // 2).reshape(k // 128, 4, 4, 2, 2).permute(0, 2, 3, 1, 4).reshape(-1)
    lo, hi = w.cpu()[:, 0::2][:, order], w.cpu()[:, 1::2][:, order]
    got = (prep[:m].float() @ lo.T + prep[m:].float() @ hi.T) * factor[:, None]
    torch.testing.assert_close(got, a.cpu().float() @ w.cpu().T, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("m, n, k, expected", [
    (16, 8192, 8192, GemmWgmmaConfig(16, 2, 4, 2)),  # decode-sized: 16-row activation tiles, 4 stages
    (1, 28672, 4096, GemmWgmmaConfig(16, 2, 4, 1)),  # 224 tiles: 4 slices balance them better, but cost 7% more (run 246)
    (16, 28672, 4096, GemmWgmmaConfig(16, 2, 4, 1)),  # 16 rows of partials would cost more than the balance gains
    (17, 8192, 8192, GemmWgmmaConfig(block_m=32, consumers=2, stages=6, split_k=2)),  # 64 tiles: K in two
    (32, 28672, 4096, GemmWgmmaConfig(32, 2, 6, 1)),  # 32-row tiles up to M = 32 (run 166)
    (33, 8192, 8192, GemmWgmmaConfig(64, 2, 4, 2)),
    (64, 8192, 8192, GemmWgmmaConfig(64, 2, 4, 2)),
    (128, 8192, 8192, GemmWgmmaConfig(128, 2, 4, 2, steps=1)),
    (256, 8192, 8192, GemmWgmmaConfig(128, 2, 4, 1, steps=1)),  # 128 tiles: one wave already
    (128, 28672, 4096, GemmWgmmaConfig(128, 2, 4, 1, steps=1)),
    (64, 1024, 4096, GemmWgmmaConfig(64, 2, 4, 4)),  # 8 tiles: slices of at least 4 stages, 16 stages -> 4
    (1024, 8192, 8192, GemmWgmmaConfig(128, 2, 4, 1, steps=1)),  # 8 x 64 units: one slice (run 235)
    (1025, 8192, 8192, None),  # past GEMM_WGMMA_MAX_M: the decoded weight and cuBLAS
    (64, 8192, 8320, None),  # K not a multiple of 256
])
def test_gemm_wgmma_config_table(m, n, k, expected):
    assert gemm_wgmma_config(m, n, k) == expected


WGMMA_SHAPES = [  # K a multiple of 256
    (17, 256, 256),  # one stage; 17 of 32 activation rows
    (64, 4096, 4096),  # K in four slices of 4 stages
    (100, 320, 1024),  # an N tail of 64 rows (half a CTA); 100 of 128 rows
    (200, 1000, 2048),  # two 128-row tiles; an N tail of 40 rows
    (33, 512, 28672),  # a long K (an MLP down-projection): 16 slices of 7 stages
    (256, 8192, 512),  # 128 CTAs of 2 stages
    (20, 28672, 512),  # 224 units on at most 132 persistent CTAs: the ring runs on across units
    (777, 1088, 512),  # seven 128-row tiles (past the decode-sized rows); an N tail of 64 rows
]


@pytest.mark.skipif(not ON_SM90, reason="the wgmma Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("m, n, k", WGMMA_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in WGMMA_SHAPES])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wgmma_kernel_matches_reference(m, n, k, dtype, monkeypatch):
    calls = _count_wgmma_launches(monkeypatch)
    a, b_q = _inputs(m, n, k, dtype, seed=m * 5 + n + k)
    out = nvfp4_matmul(a, *b_q)
    assert out.dtype == dtype and out.shape == (m, n)
    _check(a, b_q, out)
    assert calls == [1]


@pytest.mark.skipif(not ON_SM90, reason="the wgmma Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("cfg", [GemmWgmmaConfig(64, 1, 4, 1), GemmWgmmaConfig(128, 1, 3, 4, steps=1),
                                 GemmWgmmaConfig(64, 2, 2, 8), GemmWgmmaConfig(128, 2, 2, 2),
                                 GemmWgmmaConfig(16, 2, 4, 2, prefetch=3), GemmWgmmaConfig(32, 2, 5, 4, prefetch=0),
                                 GemmWgmmaConfig(64, 2, 6, 2, steps=1, prefetch=6)],
                         ids=["bm64-one-consumer", "bm128-one-consumer-split4-one-step", "bm64-two-stages-split8",
                              "bm128-split2-two-steps", "bm16-prefetch3", "bm32-split4-no-prefetch",
                              "bm64-one-step-stages"])
def test_wgmma_kernel_configs_agree(override, cfg):
    """Every tile the sweep may pick computes the same product (split partials summed in slice order)."""
    a, b_q = _inputs(96, 384, 4096, torch.bfloat16, seed=21)
    override(gemm_wgmma=cfg)
    out = nvfp4_matmul(a, *b_q)
    _check(a, b_q, out)
    assert torch.equal(nvfp4_matmul(a, *b_q), out)  # reproducible, replayed


@pytest.mark.skipif(not ON_SM90, reason="the wgmma Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("m, n, k", [(1, 256, 256), (7, 320, 1024), (16, 1000, 4096), (3, 512, 28672)],
                         ids=["1x256x256", "7x320x1024", "16x1000x4096", "3x512x28672"])
def test_wgmma_kernel_at_decode_sized_m(m, n, k, monkeypatch):
    """16-row activation tiles (wgmma's N = 16) for M <= 16, the default where K is a multiple of 256: rows past M
    are the prep's zeros."""
    calls = _count_wgmma_launches(monkeypatch)
    a, b_q = _inputs(m, n, k, torch.bfloat16, seed=m + n + k)
    _check(a, b_q, nvfp4_matmul(a, *b_q))
    assert calls == [1]


@pytest.mark.skipif(not ON_SM90, reason="the wgmma Gluon kernel runs on sm_90 only")
def test_wgmma_kernel_graph_replay_with_split_counters(override):
    """Captured in a CUDA graph (prep pass, GEMM as its programmatic dependent, split-K sum), replays with new
    activations match eager calls bit for bit."""
    override(gemm_wgmma=GemmWgmmaConfig(64, 2, 4, 4))
    a, b_q = _inputs(48, 512, 4096, torch.bfloat16, seed=31)
    eager = [nvfp4_matmul(x, *b_q) for x in (a, a * 2, -a)]
    static = a.clone()
    nvfp4_matmul(static, *b_q)  # plan and compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nvfp4_matmul(static, *b_q)
    for x, want in zip((a, a * 2, -a), eager):
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, want)


@pytest.mark.skipif(not ON_SM90, reason="the wgmma Gluon kernel runs on sm_90 only")
def test_wgmma_kernel_row_scales_keep_every_magnitude():
    """As the register-operand kernel: each activation row scaled by its own power of two into fp16."""
    a, b_q = _inputs(24, 256, 1024, torch.bfloat16, seed=11)
    scales = torch.tensor([1e30, 1e-30, 1.0, 0.0, 7e4, 3e-6, 1.0, 1e10] * 3, dtype=torch.bfloat16)
    a = a * scales.to(DEVICE)[:, None]
    _check(a, b_q, nvfp4_matmul(a, *b_q))


@pytest.mark.skipif(not ON_SM90, reason="the wgmma Gluon kernel runs on sm_90 only")
def test_wgmma_kernel_declines_what_it_cannot_address(monkeypatch):
    """K not a multiple of 256, weight rows not 16-byte aligned: the Triton kernel serves them (still correct)."""
    calls = _count_wgmma_launches(monkeypatch)
    a, b_q = _inputs(40, 64, 400, torch.bfloat16, seed=12)
    _check(a, b_q, nvfp4_matmul(a, *b_q))
    a, (data, scales, gs) = _inputs(40, 64, 512, torch.bfloat16, seed=13)
    wide = torch.zeros(64, 264, dtype=torch.uint8, device=DEVICE)  # rows 264 bytes apart: not 16-byte multiples
    wide[:, :256] = data
    _check(a, (data, scales, gs), nvfp4_matmul(a, wide[:, :256], scales, gs))
    assert calls == []
