"""Low-precision formats: the FP8 (e4m3fn) descriptor, the NVFP4 block format, and pure-PyTorch NVFP4 references.

NVFP4 (notation: x [..., K], K a multiple of 16; g the global scale, a float32 scalar):
  blocks:   the 16 consecutive elements x[..., 16j : 16j + 16] of the last dimension share one scale
  scales:   [..., K/16] float8_e4m3fn, s_j = e4m3(amax(|block_j|) / 6 / g), round to nearest even, saturated to 448
  data:     [..., K/2] uint8, two e2m1 codes per byte: element 2i in the low nibble, element 2i+1 in the high nibble
  e2m1:     code = sign << 3 | exponent (2 bits) << 1 | mantissa (1 bit); magnitudes E2M1_VALUES[code & 7]
  value:    x ~= E2M1_VALUES[code & 7] * (-1 if code & 8) * float(s_j) * g
  default:  g = amax(|x|) / (6 * 448), so the largest block scale lands on e4m3's top value 448

Rounding (the kernels in tileflash/lowp/kernels/quant.py compute the same float32 operations in the same order):
  s_j = e4m3(amax_j / 6 / g) with IEEE divisions; denom = float(s_j) * g; v = x / denom (v = 0 where denom == 0);
  |v| is rounded to the nearest e2m1 magnitude, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
  1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at 6.

Special values (decided here, tested in tests/lowp/test_quant.py):
  -0.0     the sign is the input's sign bit, as in the hardware e2m1 convert: -0.0, and negative values that round
           to zero, give code 0b1000 (-0), which dequantizes to -0.0.
  NaN      e2m1 has no NaN: a block holding a NaN gets the NaN scale (e4m3 0x7F) and all its 16 codes are 0, so the
           whole block dequantizes to NaN; other blocks are unaffected (the default g ignores NaN and +-inf).
  +-inf    saturates like any value above the range: the block scale saturates to 448 and the element to code +-6.
  > 448    block scales above e4m3's largest finite value saturate to 448 (e4m3fn has no inf; values are clamped
           before the cast, so nothing rests on a cast's overflow behaviour), and the block's elements then
           saturate to +-6: the block keeps its largest representable magnitude.
  tiny     scales at or below half of e4m3's smallest subnormal (2^-9) round to 0: the block is all (signed) zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """An 8-bit float format: its torch dtype, largest finite magnitude (the saturation point), mantissa bits and
    smallest subnormal (the step below the smallest normal)."""
    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_subnormal: float


E4M3 = FP8Format("e4m3fn", torch.float8_e4m3fn, max=448.0, mantissa_bits=3, min_subnormal=2.0 ** -9)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of e2m1 code c is E2M1_VALUES[c & 7]
E2M1_SIGN = 0b1000
E2M1_MAX = 6.0
NVFP4_BLOCK = 16  # elements per e4m3 scale


def ieee_div(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b as an IEEE division. On CUDA, dividing by a Python scalar multiplies by its reciprocal (one ulp off at
    times), which would break bit-exact agreement with the kernels."""
    return a / torch.tensor(b, dtype=torch.float32, device=a.device)


def finite_amax(x: torch.Tensor, dim: tuple[int, ...] | None = None) -> torch.Tensor:
    """amax(|x|) over the finite elements (NaN and +-inf count as 0), float32; over all of x when dim is None.
    0 for an empty reduction (amax refuses empty inputs; a sum of nothing is 0 with the reduced shape)."""
    a = x.float().abs()
    a = torch.where(torch.isfinite(a), a, 0.0)
    reduce = torch.sum if a.numel() == 0 else torch.amax
    return reduce(a) if dim is None else reduce(a, dim=dim)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Default global scale, float32 shape []: amax(|x|) / (6 * 448) over finite elements, 1.0 when that is 0."""
    g = ieee_div(finite_amax(x), E2M1_MAX * E4M3.max)
    return torch.where(g > 0, g, 1.0)


def e4m3_saturate(v: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, round to nearest even, |v| > 448 (and +-inf) saturated to +-448, NaN kept."""
    return v.clamp(-E4M3.max, E4M3.max).to(E4M3.dtype)


def e2m1_codes(v: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of float32 v (ties to the even code, saturating at 6), sign bit from `negative`; NaN -> 0.

    Written as a nearest-value search (independent of the kernel's threshold comparisons): distances in float64 are
    exact, so ties are found exactly, and among the tied candidates the even code wins."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=v.device)
    mag = v.double().abs().clamp(max=E2M1_MAX)
    dist = (mag[..., None] - table).abs()
    best = dist == dist.min(dim=-1, keepdim=True).values
    even = torch.arange(8, device=v.device) % 2 == 0
    code = (best.to(torch.int64) * (2 + even.to(torch.int64))).argmax(dim=-1)  # an even best beats an odd one
    code = code | torch.where(negative, E2M1_SIGN, 0)
    return torch.where(torch.isnan(v), 0, code).to(torch.uint8)


def nvfp4_quantize_ref(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    """x [..., K] -> (data [..., K/2] uint8, scales [..., K/16] float8_e4m3fn, global_scale float32 [])."""
    g = nvfp4_global_scale(x) if global_scale is None else global_scale
    lead, k = x.shape[:-1], x.shape[-1]
    xf = x.float().reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = xf.abs().amax(dim=-1)  # propagates NaN: a NaN block gets a NaN scale
    scales = e4m3_saturate(ieee_div(amax, E2M1_MAX) / g)
    denom = (scales.float() * g)[..., None]
    v = torch.where(denom == 0, 0.0, xf / torch.where(denom == 0, 1.0, denom))
    codes = e2m1_codes(v, torch.signbit(xf)).reshape(*lead, k // 2, 2)
    data = codes[..., 0] | (codes[..., 1] << 4)
    return data, scales, g


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, low 4 bits) -> float32 values; code 0b1000 is -0.0."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & E2M1_SIGN) != 0, -mag, mag)


def nvfp4_dequantize_ref(data: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """(data [..., K/2] uint8, scales [..., K/16] e4m3, global_scale []) -> float32 [..., K]: (e2m1 * s) * g."""
    lead, k = data.shape[:-1], data.shape[-1] * 2
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK)
    out = e2m1_values(codes) * scales.float()[..., None] * global_scale
    return out.reshape(*lead, k)
