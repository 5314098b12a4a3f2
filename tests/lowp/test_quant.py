"""NVFP4 quantize / dequantize (Triton kernels) bit-exact against the PyTorch reference in tileflash/lowp/formats.py,
with hand-written expected codes for the rounding rules, and the FP8 e4m3 helpers against a nearest-value oracle."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers import DEVICE
from tileflash.lowp.formats import (E2M1_VALUES, E4M3, finite_amax, ieee_div, nvfp4_dequantize_ref,
                               nvfp4_global_scale, nvfp4_quantize_ref)
from tileflash.lowp.quant import fp8_dequantize, fp8_quantize, nvfp4_dequantize, nvfp4_quantize
from tileflash.launch.lowp import quant_blocks

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
ONE = torch.tensor(1.0, device=DEVICE)


def u8(t):
    return t.view(torch.uint8)


def codes_of(data):
    """data [..., K/2] -> e2m1 codes [..., K] in element order."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


def assert_same_quant(x, global_scale=None):
    """Kernel == reference bit for bit (data, scale bytes, global scale); returns the kernel's result."""
    data, scales, g = nvfp4_quantize(x, global_scale)
    ref_data, ref_scales, ref_g = nvfp4_quantize_ref(x, global_scale)
    assert torch.equal(g, ref_g), f"global scale {g} != {ref_g}"
    assert torch.equal(u8(scales), u8(ref_scales)), "scales differ"
    assert torch.equal(data, ref_data), "data differ"
    return data, scales, g


def assert_same_bits(out, ref):
    """float32 tensors equal bit for bit (so -0.0 != 0.0) except that any NaN matches any NaN."""
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32))


def block(values, amax=6.0):
    """One 16-element block: `values`, then `amax` (so with global scale 1 the block scale is amax / 6), zeros."""
    row = list(values) + [amax]
    return torch.tensor(row + [0.0] * (16 - len(row)), device=DEVICE)


# --- NVFP4: the e2m1 code table and its rounding ---

def test_e2m1_table_matches_the_hardware_code_layout():
    # code = sign << 3 | exponent << 1 | mantissa; exponent 0 is the subnormal 0 / 0.5
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    codes = torch.arange(16, dtype=torch.uint8, device=DEVICE)
    data = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 8)
    scales = torch.ones(1, 1, device=DEVICE).to(E4M3.dtype)
    expected = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=DEVICE)
    out = nvfp4_dequantize(data, scales, ONE)
    assert_same_bits(out[0], expected)  # code 8 is -0.0
    assert_same_bits(nvfp4_dequantize_ref(data, scales, ONE)[0], expected)


TIES = [  # (|v| at block scale 1, expected code): ties go to the even code
    (0.25, 0b000), (0.75, 0b010), (1.25, 0b010), (1.75, 0b100), (2.5, 0b100), (3.5, 0b110), (5.0, 0b110),
]
NEAR = [  # just off each tie, and exact table values
    (0.2499, 0), (0.2501, 1), (0.7499, 1), (1.2501, 3), (1.7499, 3), (2.5001, 5), (3.4999, 5), (4.9999, 6),
    (5.0001, 7), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7),
]


@pytest.mark.parametrize("cases", [TIES, NEAR], ids=["ties", "near_ties_and_exact"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_rounding_codes(cases, sign):
    vals = [sign * v for v, _ in cases]
    x = torch.stack([block(vals[i:i + 8]) for i in range(0, len(vals), 8)])
    data, scales, _ = assert_same_quant(x, ONE)
    assert torch.all(scales.float() == 1.0)
    expected = [c | (0b1000 if sign < 0 else 0) for _, c in cases]
    got = [codes_of(data)[i // 8, i % 8].item() for i in range(len(cases))]
    assert got == expected


def test_zero_blocks_and_signed_zero():
    x = torch.zeros(3, 32, device=DEVICE)
    data, scales, g = assert_same_quant(x)
    assert g.item() == 1.0 and torch.all(u8(scales) == 0) and torch.all(data == 0)
    x[1, 16:] = 1.0  # row 1: a zero block next to a non-zero one
    x[2, 3] = -0.0  # -0.0 keeps its sign (in a zero-scale block): code 0b1000
    x[2, 20] = 5.0
    x[2, 21] = -1e-3  # a negative value rounding to zero next to a large one: code 0b1000 too
    data, scales, _ = assert_same_quant(x)
    assert u8(scales)[1, 0] == 0 and torch.all(codes_of(data)[1, :16] == 0)
    assert codes_of(data)[2, 3] == 0b1000 and codes_of(data)[2, 21] == 0b1000 and codes_of(data)[2, 4] == 0
    out = nvfp4_dequantize(data, scales, torch.tensor(1.0, device=DEVICE))
    assert math.copysign(1.0, out[2, 3].item()) == -1.0


def test_default_global_scale_maps_the_largest_block_to_448():
    x = torch.zeros(2, 32, device=DEVICE)
    x[1, 7] = -2688.0  # 6 * 448
    x[0, 0] = float("inf")  # ignored by the default global scale (as NaN is)
    x[0, 1] = float("nan")
    assert nvfp4_global_scale(x).item() == 1.0
    _, scales, _ = assert_same_quant(x[1:])
    assert scales[0, 0].float().item() == 448.0


SCALE_TIES = [  # block scale amax / 6 (global scale 1) -> expected e4m3 byte, round to nearest even
    (1.0625, 0x38),  # between 1.0 (0x38) and 1.125 (0x39): even 1.0
    (1.1875, 0x3A),  # between 1.125 and 1.25: even 1.25
    (232.0, 0x76),  # between 224 (0x76) and 240 (0x77): even 224
    (248.0, 0x78),  # between 240 (0x77) and 256 (0x78): even 256 (a carry into the exponent)
    (3 * 2.0 ** -10, 0x02),  # subnormal tie between 2^-9 (0x01) and 2^-8 (0x02): even 0x02
    (2.0 ** -10, 0x00),  # half the smallest subnormal: ties to 0
    (2.0 ** -10 * 1.0001, 0x01),  # just above: the smallest subnormal
    (2.0 ** -6 * (1 + 1 / 16), 0x08),  # tie above the smallest normal: even 0x08
    (464.0, 0x7E),  # past 448: saturates (e4m3fn has no inf)
    (1e6, 0x7E),
]


@pytest.mark.parametrize("s, expected", SCALE_TIES)
def test_block_scale_rounding_and_saturation(s, expected):
    x = block([], amax=6.0 * s)  # 6 * s is exact in fp32 here, and so is (6 * s) / 6
    _, scales, _ = assert_same_quant(x[None], ONE)
    assert u8(scales).item() == expected


def test_block_scale_over_448_saturates_elements_to_6():
    x = torch.tensor([[3000.0, -6000.0, 1200.0, float("inf"), float("-inf")] + [0.0] * 11], device=DEVICE)
    data, scales, _ = assert_same_quant(x, ONE)  # amax / 6 = inf: scale 448, denom 448
    assert scales.float().item() == 448.0
    assert codes_of(data)[0, :5].tolist() == [0b111, 0b1111, 0b101, 0b111, 0b1111]  # 6.70, -13.4, 2.68, +-inf


def test_block_scale_sweep_over_exponents():
    # Block maxima over 2^-30 .. 2^15 (global scale 1): every e4m3 normal and subnormal scale, underflow to 0 and
    # saturation, with mantissas that hit and miss the rounding points.
    g = torch.Generator().manual_seed(3)
    amax = torch.exp2(torch.linspace(-30, 15, 512)) * (1 + torch.rand(512, generator=g) / 8)
    x = torch.rand(512, 16, generator=g) * 2 - 1
    x = (x * amax[:, None]).to(DEVICE)
    x[:, 0] = amax.to(DEVICE)
    assert_same_quant(x, ONE)


@pytest.mark.parametrize("dtype", FLOATS)
def test_denormal_size_inputs(dtype):
    tiny = {torch.float32: 1e-40, torch.float16: 6e-8, torch.bfloat16: 1e-40}[dtype]  # subnormal in each dtype
    x = torch.tensor([[tiny] * 16, [1e-30] * 8 + [-3e-31] * 8, [tiny] * 8 + [1.0] * 8], device=DEVICE)
    assert_same_quant(x.to(dtype))
    assert_same_quant(x[:2].to(dtype))  # a global scale from tiny values only
    # One large block sets the global scale; the tiny block's scale underflows e4m3 (< 2^-10): all zeros.
    y = torch.cat([torch.full((1, 16), 1e-6), torch.full((1, 16), 1000.0)], dim=1).to(DEVICE, dtype)
    y[0, 1] = -1e-6
    data, scales, _ = assert_same_quant(y)
    assert u8(scales)[0, 0] == 0 and set(codes_of(data)[0, :16].tolist()) == {0, 0b1000}


def test_nan_poisons_only_its_block():
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    x[1, 20] = float("nan")
    data, scales, g = assert_same_quant(x)
    assert u8(scales)[1, 1] == 0x7F and torch.all(codes_of(data)[1, 16:32] == 0)
    clean = x.clone()
    clean[1, 16:32] = 0.0
    c_data, c_scales, c_g = assert_same_quant(clean)
    assert torch.equal(g, c_g)  # the default global scale ignores NaN
    keep = torch.ones(2, 3, dtype=torch.bool, device=DEVICE)
    keep[1, 1] = False
    assert torch.equal(u8(scales)[keep], u8(c_scales)[keep])
    assert torch.equal(codes_of(data)[keep.repeat_interleave(16, 1)], codes_of(c_data)[keep.repeat_interleave(16, 1)])
    out = nvfp4_dequantize(data, scales, g)
    assert torch.isnan(out[1, 16:32]).all() and not torch.isnan(out[:, :16]).any() and not torch.isnan(out[0]).any()


@pytest.mark.parametrize("k, expected", [(16, (128, 32)), (32, (128, 32)), (48, (64, 64)), (128, (32, 128)),
                                         (4096, (32, 128))])
def test_quant_blocks_table(k, expected):
    assert quant_blocks(k) == expected


SHAPES = [(16,), (3, 32), (2, 5, 48), (1, 7, 3, 16), (4, 160), (0, 32)]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("dtype", FLOATS)
def test_matches_reference_over_shapes_and_dtypes(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    # Log-uniform magnitudes over 2^-12 .. 2^8: blocks of very different scales in one tensor.
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 9, shape, generator=g).float())
    data, scales, gs = assert_same_quant(x.to(DEVICE, dtype))
    assert data.shape == (*shape[:-1], shape[-1] // 2) and scales.shape == (*shape[:-1], shape[-1] // 16)
    out = nvfp4_dequantize(data, scales, gs)
    assert out.dtype == torch.float32 and out.shape == shape
    assert_same_bits(out, nvfp4_dequantize_ref(data, scales, gs))


def test_strided_inputs():
    base = torch.randn(48, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    for x in (base.t(), base[:, ::2], base[::3]):  # transposed, stride-2 columns, stride-3 rows
        data, scales, gs = assert_same_quant(x)
        assert torch.equal(data, nvfp4_quantize(x.contiguous())[0])
        strided = torch.stack((data, data), dim=-1)[..., 0]  # a non-unit stride on the packed dimension
        assert_same_bits(nvfp4_dequantize(strided, scales, gs), nvfp4_dequantize_ref(data, scales, gs))


def test_explicit_global_scale_is_used_and_returned():
    x = torch.randn(2, 32, device=DEVICE)
    gs = torch.tensor(0.01, device=DEVICE)
    _, _, out_gs = assert_same_quant(x, gs)
    assert out_gs is gs


def test_dequantize_every_scale_byte_and_code():
    # All 256 scale bytes (negative, subnormal, NaN 0x7F / 0xFF) times all 256 data bytes.
    scales = torch.arange(256, device=DEVICE).to(torch.uint8).view(E4M3.dtype)[:, None].repeat(1, 32)
    data = torch.arange(256, device=DEVICE).to(torch.uint8).reshape(1, 256).repeat(256, 1)
    gs = torch.tensor(0.75, device=DEVICE)
    assert_same_bits(nvfp4_dequantize(data, scales, gs), nvfp4_dequantize_ref(data, scales, gs))


def test_round_trip_error_bound():
    """|dequant(quant(x)) - x| <= max(denom / 4, |x| / 4) with denom = scale * global scale (half an e2m1 step;
    saturated elements of a scale rounded down lose at most 0.375 steps), or <= 6 * 2^-10 * g where the block scale
    underflowed to 0."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(6, 128, generator=g) * torch.exp2(torch.randint(-20, 4, (6, 128), generator=g).float()))
    x = x.to(DEVICE)
    data, scales, gs = nvfp4_quantize(x)
    out = nvfp4_dequantize(data, scales, gs)
    denom = (scales.float() * gs).repeat_interleave(16, dim=-1)
    bound = torch.where(denom > 0, torch.maximum(denom / 4, x.abs() / 4), 6 * 2.0 ** -10 * gs)
    assert torch.all((out - x).abs() <= bound * (1 + 2.0 ** -20))


# Hypothesis: random blocks from the full float32 range (subnormals, inf, NaN included) or built on the rounding
# points, random global scales; the kernel must equal the reference bit for bit.
_TIE_POINTS = [v for v, _ in TIES + NEAR]


@st.composite
def _blocks(draw):
    if draw(st.booleans()):
        return draw(st.lists(st.floats(width=32), min_size=16, max_size=16))
    e = draw(st.integers(-20, 20))
    vals = draw(st.lists(st.sampled_from(_TIE_POINTS + [-v for v in _TIE_POINTS] + [0.0, -0.0]), min_size=15,
                         max_size=15))
    return [6.0 * 2.0 ** e] + [v * 2.0 ** e for v in vals]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows=st.lists(st.lists(_blocks(), min_size=1, max_size=3), min_size=1, max_size=3),
       dtype=st.sampled_from(FLOATS),
       gscale=st.none() | st.floats(min_value=0.0, exclude_min=True, max_value=2.0 ** 100, width=32))
def test_property_kernel_equals_reference(rows, dtype, gscale):
    k = 16 * min(len(r) for r in rows)
    x = torch.tensor([sum(r, [])[:k] for r in rows], device=DEVICE).to(dtype)
    gs = None if gscale is None else torch.tensor(gscale, device=DEVICE)
    data, scales, g = assert_same_quant(x, gs)
    assert_same_bits(nvfp4_dequantize(data, scales, g), nvfp4_dequantize_ref(data, scales, g))


# --- FP8 e4m3 ---

def _e4m3_oracle(v):
    """Nearest e4m3fn byte of float32 v by search over all finite values (ties to the even byte), |v| saturated at
    448, sign from the sign bit."""
    table = torch.arange(0x7F).to(torch.uint8).view(E4M3.dtype).double()  # 0x00 .. 0x7E: 0 .. 448
    mag = v.double().abs().clamp(max=E4M3.max)
    dist = (mag[..., None] - table.to(v.device)).abs()
    best = dist == dist.min(dim=-1, keepdim=True).values
    even = torch.arange(0x7F, device=v.device) % 2 == 0
    code = (best.long() * (2 + even.long())).argmax(dim=-1)
    return (code | torch.where(torch.signbit(v), 0x80, 0)).to(torch.uint8)


def _e4m3_midpoints():
    vals = torch.arange(0x7F).to(torch.uint8).view(E4M3.dtype).float()
    return (vals[:-1] + vals[1:]) / 2  # exact in fp32


def test_fp8_round_to_nearest_even_and_saturation():
    g = torch.Generator().manual_seed(2)
    mids = _e4m3_midpoints()
    x = torch.cat([mids, -mids, torch.randn(500, generator=g) * torch.exp2(torch.randint(-12, 10, (500,), generator=g)
                                                                         .float()),
                   torch.tensor([448.0, 449.0, 464.0, 1e9, float("inf"), float("-inf"), -0.0, 2.0 ** -10])]).to(DEVICE)
    q, scale = fp8_quantize(x, scale=torch.ones(1, device=DEVICE))
    assert torch.equal(u8(q), _e4m3_oracle(x))
    assert u8(q)[-8:].tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x80, 0x00]
    nan_q, _ = fp8_quantize(torch.tensor([1.0, float("nan")], device=DEVICE))
    assert torch.isnan(nan_q.float()[1]) and nan_q.float()[0] == 448.0


@pytest.mark.parametrize("dtype", FLOATS)
def test_fp8_default_scale_per_tensor(dtype):
    x = torch.randn(2, 9, 3, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    q, scale = fp8_quantize(x)
    assert scale.shape == (1,) and scale.dtype == torch.float32
    assert torch.equal(scale, ieee_div(finite_amax(x).reshape(1), 448.0))
    assert torch.equal(u8(q), _e4m3_oracle(x.float() / scale))
    assert (u8(q) & 0x7F).max() == 0x7E  # the largest magnitude lands on 448
    err = (fp8_dequantize(q, scale) - x.float()).abs()
    half_step = x.float().abs() * 2.0 ** -(E4M3.mantissa_bits + 1) + scale * E4M3.min_subnormal / 2
    assert torch.all(err <= half_step * (1 + 2.0 ** -20))


def test_fp8_per_head_scales():
    x = torch.randn(2, 9, 4, 32, generator=torch.Generator().manual_seed(7)).to(DEVICE)  # [B, S, Hkv, D]
    x[:, :, 1] *= 1000.0
    x[:, :, 3] = 0.0  # an all-zero head: scale 1.0
    q, scale = fp8_quantize(x, per_head_dim=-2)
    assert scale.shape == (4,) and scale[3].item() == 1.0
    for h in range(3):
        q_h, s_h = fp8_quantize(x[:, :, h])
        assert torch.equal(u8(q[:, :, h]), u8(q_h)) and scale[h] == s_h[0]
    assert torch.all(q[:, :, 3].float() == 0)
    assert torch.equal(fp8_dequantize(q, scale, per_head_dim=2), q.float() * scale[:, None])
    q2, _ = fp8_quantize(x, scale=scale, per_head_dim=2)
    assert torch.equal(u8(q2), u8(q))


# --- bad input ---

def _nvfp4_args():
    x = torch.randn(4, 32, device=DEVICE)
    return nvfp4_quantize(x)


META = torch.empty(0, device="meta")

ERROR_CASES = [
    (lambda: nvfp4_quantize(torch.randn(4, 24)), ValueError, "x: last dimension K"),
    (lambda: nvfp4_quantize(torch.randn(4, 0)), ValueError, "x: last dimension K"),
    (lambda: nvfp4_quantize(torch.tensor(1.0)), ValueError, "x: last dimension K"),
    (lambda: nvfp4_quantize(torch.randn(4, 32).double()), TypeError, "x: expected dtype"),
    (lambda: nvfp4_quantize(torch.zeros(4, 32, dtype=torch.int32)), TypeError, "x: expected dtype"),
    (lambda: nvfp4_quantize([1.0] * 16), TypeError, "x: expected a torch.Tensor"),
    (lambda: nvfp4_quantize(torch.randn(4, 32), torch.tensor([1.0])), ValueError, "global_scale"),
    (lambda: nvfp4_quantize(torch.randn(4, 32), torch.tensor(1.0).half()), TypeError, "global_scale"),
    (lambda: nvfp4_quantize(torch.randn(4, 32), torch.tensor(1.0, device="meta")), ValueError, "global_scale"),
    (lambda: nvfp4_dequantize(_nvfp4_args()[0].float(), *_nvfp4_args()[1:]), TypeError, "data"),
    (lambda: nvfp4_dequantize(_nvfp4_args()[0][:, :12], *_nvfp4_args()[1:]), ValueError, "data"),
    (lambda: nvfp4_dequantize(_nvfp4_args()[0], _nvfp4_args()[1].float(), _nvfp4_args()[2]), TypeError, "scales"),
    (lambda: nvfp4_dequantize(_nvfp4_args()[0], _nvfp4_args()[1][:, :1], _nvfp4_args()[2]), ValueError, "scales"),
    (lambda: nvfp4_dequantize(_nvfp4_args()[0], _nvfp4_args()[1][0], _nvfp4_args()[2]), ValueError, "scales"),
    (lambda: nvfp4_dequantize(*_nvfp4_args()[:2], META.new_empty(())), ValueError, "global_scale"),
    (lambda: nvfp4_dequantize(*_nvfp4_args()[:2], None), TypeError, "global_scale"),
    (lambda: fp8_quantize(torch.randn(4, 8).long()), TypeError, "x"),
    (lambda: fp8_quantize(torch.randn(4, 8), scale=torch.ones(1).half()), TypeError, "scale"),
    (lambda: fp8_quantize(torch.randn(4, 8), scale=torch.ones(2)), ValueError, "scale"),
    (lambda: fp8_quantize(torch.randn(4, 8), scale=torch.ones(())), ValueError, "scale"),
    (lambda: fp8_quantize(torch.randn(4, 8), scale=META.new_ones(1)), ValueError, "scale"),
    (lambda: fp8_quantize(torch.randn(2, 4, 8), scale=torch.ones(2), per_head_dim=-2), ValueError, "scale"),
    (lambda: fp8_quantize(torch.randn(4, 8), per_head_dim=2), ValueError, "per_head_dim"),
    (lambda: fp8_quantize(torch.randn(4, 8), per_head_dim="heads"), ValueError, "per_head_dim"),
    (lambda: fp8_dequantize(torch.randn(4, 8), torch.ones(1)), TypeError, "x_fp8"),
]


@pytest.mark.parametrize("call, exc, needle", ERROR_CASES, ids=[str(i) for i in range(len(ERROR_CASES))])
def test_errors_name_the_argument(call, exc, needle):
    """(The cases' tensors are made on the test device: on a GPU machine a CPU tensor is refused first, by device.)"""
    with torch.device(DEVICE), pytest.raises(exc, match=needle):
        call()
