"""Property-based fuzzing of the public ops against the pure-PyTorch references (hypothesis): prefill (forward and
backward), varlen, decode (16-bit, FP8 and NVFP4 caches), merge_attn_states, the NVFP4 quantizer and GEMM.

Hypothesis draws the *structure* of a problem (batch, lengths, heads, head dim, masks, layouts, page tables, splits);
the values come from a seeded torch generator, so every failing example prints a case that reproduces exactly.
Each example is checked with the project's 2x rule (`check_2x`) and `check_lse`; outputs are poisoned with NaN
by conftest's autouse fixture, so an unwritten element fails.

Garbage is NaN: memory a kernel has no business reading holds NaN — padding around strided views (extra rows,
heads, head-dim columns), keys past `seqused_k`, cache slots past `cache_seqlens + Snew`, spare pages and the
pages unused block-table entries point to. A load that reaches it and is "masked later" still poisons P @ V
(0 * NaN = NaN), so this catches out-of-bounds reads the interpreter does not detect. `garbage="randn"` draws
the same problem with finite garbage, to tell a leak from a maths error when shrinking.

Profiles (select with TILEFLASH_FUZZ; the default is "ci"):
  ci    fixed seed (derandomize), no example database, 397 examples over the seven tests, small shapes sized for
        the Triton interpreter on 2 cores (about 0.2 ms x programs x KV-loop iterations): ~180 s (558 examples ran
        250 s of a 638 s suite in session 15, over the ~10 minutes the CPU suite is meant to take);
  long  TILEFLASH_FUZZ=long: 2500 examples, longer sequences, more heads, more large head dims.
TILEFLASH_FUZZ_SEED=N explores with seed N instead of the fixed one (either profile); TILEFLASH_FUZZ_EXAMPLES=N
sets the per-test base count (tests take weighted shares of it: decode 1.2, varlen 0.8, merge 2, quantized-cache
decode 0.5, NVFP4 quantize/GEMM 0.5, backward 0.2).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

import tileflash
import tileflash._utils as tf_utils
from helpers import DEVICE, ON_GPU, check_2x, check_grads, check_lse
from tileflash._utils import cdiv
from tileflash.plan import decode_block_m, padded_head_dim
from tileflash.reference import attention_ref, attention_varlen_ref, kvcache_ref, merge_ref

# softcap's tanh is 1 - 2 / (exp(2y) + 1): exp overflows to inf on purpose for large scores (giving 1), and numpy
# in the interpreter warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# ---------------------------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------------------------
_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.large_base_example])
# ci: 40 examples per op (64 took 252 s of the CPU suite's 15 minutes; the suite aims at ~12); long: 500.
settings.register_profile("tileflash-fuzz-ci", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("tileflash-fuzz-long", max_examples=500, derandomize=True, **_COMMON)

_MODE = os.environ.get("TILEFLASH_FUZZ", "ci").strip().lower() or "ci"
if _MODE not in ("ci", "long"):
    raise pytest.UsageError(f"TILEFLASH_FUZZ: expected 'ci' or 'long', got {_MODE!r}")
LONG = _MODE == "long"
_PROFILE = settings.get_profile(f"tileflash-fuzz-{_MODE}")


_SEED = os.environ.get("TILEFLASH_FUZZ_SEED")


def fuzz_settings(weight: float = 1.0):
    """The selected profile with this test's share of examples (weights balance the cost of each op); with
    TILEFLASH_FUZZ_SEED set, also that seed (a different exploration than the fixed CI one)."""
    base = int(os.environ.get("TILEFLASH_FUZZ_EXAMPLES", _PROFILE.max_examples))
    chosen = settings(_PROFILE, max_examples=max(1, round(base * weight)))
    if _SEED is None:
        return chosen
    return lambda test: seed(int(_SEED))(settings(chosen, derandomize=False)(test))


# Shape limits per profile. Interpreter cost ~ programs x KV blocks (prefill tiles 32 x 16, decode 16..64 x 16);
# `budget` caps that product per example (the batch size gives way), which keeps the CI run's time predictable.
LIM = dict(
    batch=4 if LONG else 3,
    seqlen=192 if LONG else 64,
    seqlen_big_d=48 if LONG else 16,  # lengths when the head dim is > 64 (padded to 128/256: slow to interpret)
    heads_q=16 if LONG else 8,
    capacity=256 if LONG else 64,
    capacity_big_d=64 if LONG else 24,
    budget=1000 if LONG else 64,  # program x KV-block steps per example: ~10 ms each in the interpreter
)
if ON_GPU:  # native kernels with GPU tiles (128 x 64..128; decode 64..128 keys a step): lengths span many
    LIM = dict(batch=4, seqlen=1100 if LONG else 400, seqlen_big_d=600 if LONG else 200, heads_q=32 if LONG else 16,
               capacity=4200 if LONG else 1100, capacity_big_d=2100 if LONG else 600, budget=10**9)
SMALL_DIMS = [16, 8, 32, 64, 24, 40, 48, 56]
BIG_DIMS = [128, 256, 80, 96, 72, 120, 136, 200] if LONG else [128, 256, 80]
DTYPES = [torch.float16, torch.bfloat16]
# None = contiguous cache (about a third of the examples), else the page size.
PAGE_SIZES = st.one_of(st.just(None), st.sampled_from([1, 16, 32]),
                       st.sampled_from([2, 3, 4, 5, 6, 7] + ([13, 64, 256] if LONG else [])))


def num_splits(programs_per_split: int):
    """0 = heuristic, 1 = no split, forced 2..9, and > 32 (the combine then cuts the head dim into several programs
    per row; in the CI profile only when there are few (batch, KV head) programs per split: each one costs ~1 ms to
    interpret, even when its split is empty)."""
    options = [st.just(0), st.just(1), st.integers(2, 9)]
    if LONG or ON_GPU or programs_per_split <= 2:
        options.append(st.sampled_from([33, 40]))
    return st.one_of(*options)


NAN = float("nan")


# ---------------------------------------------------------------------------------------------------------------
# Strided views with NaN all around
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How a tensor sits in memory: `pads` extra elements per dim (the last one pads the row: the head dim stays
    contiguous), `order` the memory order of the leading dims (e.g. (0, 2, 1) = [B, H, S, D] in memory)."""
    pads: tuple = ()
    order: tuple = ()


PLAIN = Layout()


def layouts(ndim: int):
    """Plain (dense, row-major) half the time; else random padding of every dim (NaN-filled) and a random memory
    order of the leading dims."""
    strided = st.builds(Layout, st.tuples(*[st.sampled_from([0, 1, 3])] * (ndim - 1), st.sampled_from([0, 8])),
                        st.permutations(range(ndim - 1)).map(tuple))
    return st.one_of(st.just(PLAIN), strided)


def strided(shape, dtype, layout: Layout, fill=NAN):
    """(view, buffer): a `shape` view into a larger `fill`-ed buffer laid out as `layout` says."""
    n = len(shape)
    pads = layout.pads or (0,) * n
    order = list(layout.order or range(n - 1)) + [n - 1]
    buf = torch.full([shape[i] + pads[i] for i in order], fill, dtype=dtype, device=DEVICE)
    inv = [order.index(i) for i in range(n)]
    view = buf.permute(inv)[tuple(slice(0, s) for s in shape)]
    assert view.shape == tuple(shape) and (n == 0 or shape[-1] <= 1 or view.stride(-1) == 1)
    return view, buf


def rand_view(gen, shape, dtype, layout: Layout, scale=1.0):
    view, buf = strided(shape, dtype, layout)
    view.copy_((torch.randn(*shape, generator=gen) * scale).to(dtype))
    return view, buf


def garbage_fill(garbage: str, gen, shape, dtype):
    if garbage == "nan":
        return torch.full(shape, NAN, dtype=dtype, device=DEVICE)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def round_like_kernel(x32, dtype):
    """x32 rounded to `dtype` the way a correct kernel's final store rounds it. On a GPU that is round-to-nearest-
    even (= torch's .to). Triton's interpreter (3.6/3.7) converts fp32 -> bf16 by truncating the mantissa
    (`_convert_float` with rounding_mode=None), so there a correct kernel is up to 1 bf16 ulp off, not 1/2."""
    if dtype == torch.bfloat16 and tf_utils.is_interpreter():
        return (x32.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x32.to(dtype)


def same_bits(a, b) -> bool:
    """Bitwise equality (NaN == NaN), for caches that hold NaN garbage."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# Strategies shared by the ops
# ---------------------------------------------------------------------------------------------------------------
@st.composite
def head_dims(draw):
    """Multiples of 8 up to 256, biased to small ones (fast to interpret); returns (d, big)."""
    if draw(st.integers(0, 9)) == 0:  # ~10% large head dims, at short lengths
        return draw(st.sampled_from(BIG_DIMS)), True
    return draw(st.sampled_from(SMALL_DIMS)), False


@st.composite
def head_counts(draw):
    """(Hq, Hkv) with Hq = Hkv * g: MHA, GQA 2/3/4/8, MQA."""
    g = draw(st.sampled_from([1, 2, 4, 8, 3, 5, 16] if LONG else [1, 2, 4, 8, 3]))
    g = min(g, LIM["heads_q"])
    hkv = draw(st.integers(1, max(1, LIM["heads_q"] // g)))
    return hkv * g, hkv


def dim_cost(d: int) -> int:
    """Relative interpreter cost of a head dim (tiles are padded to a power of two >= 16)."""
    return max(1, padded_head_dim(d) // 64)


def batches(choices, cost_per_sequence: int):
    """Batch sizes (first = what shrinking aims at) whose interpreter cost fits the profile's budget; 0 and 1
    always do."""
    return st.sampled_from([x for x in choices if x <= 1 or (x <= LIM["batch"] and
                                                            x * cost_per_sequence <= LIM["budget"])])


def lengths(hi):
    """Lengths biased to the edges: 0, 1, tile boundaries (16, 32, ... on the GPU up to 1024) +- 1, anything."""
    edges = [x for x in (0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513,
                         1023, 1024, 1025) if x <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(0, hi))


@st.composite
def masks(draw, max_len):
    """(causal, window_size, softcap, softmax_scale)."""
    causal = draw(st.booleans())
    side = st.one_of(st.just(-1), st.just(0), st.integers(0, max(1, max_len)))
    window = (draw(side), draw(side)) if draw(st.integers(0, 2)) == 0 else (-1, -1)
    softcap = draw(st.sampled_from([0.0, 0.0, 0.0, 0.5, 2.0, 10.0, 50.0]))
    scale = draw(st.sampled_from([None, None, None, 0.05, 0.3, 1.0]))
    return causal, window, softcap, scale


GARBAGE = st.sampled_from(["nan", "nan", "nan", "randn"])


def _seed():
    return st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------------------------
# flash_attn_func
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillCase:
    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    causal: bool
    window: tuple
    softcap: float
    scale: float | None
    q_layout: Layout
    k_layout: Layout
    v_layout: Layout
    value_scale: float
    seed: int


@st.composite
def prefill_cases(draw):
    d, big = draw(head_dims())
    hq, hkv = draw(head_counts())
    max_len = LIM["seqlen_big_d"] if big else LIM["seqlen"]
    sq, sk = draw(lengths(max_len)), draw(lengths(max_len))
    # One sequence costs Hq programs per 32-query tile, each looping over 16-key blocks.
    b = draw(batches([1, 2, 1, 3, 0, 4], hq * cdiv(sq, 32) * max(1, cdiv(sk, 16)) * dim_cost(d)))
    causal, window, softcap, scale = draw(masks(max_len))
    return PrefillCase(b, sq, sk, hq, hkv, d, draw(st.sampled_from(DTYPES)), causal, window, softcap, scale,
                       draw(layouts(4)), draw(layouts(4)), draw(layouts(4)), draw(st.sampled_from([1.0, 1.0, 3.0])),
                       draw(_seed()))


def prefill_inputs(c: PrefillCase):
    """(generator, q, k, v, mask kwargs): strided views of randn in NaN-filled buffers, as the case says."""
    gen = torch.Generator().manual_seed(c.seed)
    q, _ = rand_view(gen, (c.b, c.sq, c.hq, c.d), c.dtype, c.q_layout, c.value_scale)
    k, _ = rand_view(gen, (c.b, c.sk, c.hkv, c.d), c.dtype, c.k_layout, c.value_scale)
    v, _ = rand_view(gen, (c.b, c.sk, c.hkv, c.d), c.dtype, c.v_layout)
    return gen, q, k, v, dict(softmax_scale=c.scale, causal=c.causal, window_size=c.window, softcap=c.softcap)


@fuzz_settings(1.0)
@given(case=prefill_cases())
def test_fuzz_flash_attn_func(case: PrefillCase):
    c = case
    _, q, k, v, kw = prefill_inputs(c)
    out, lse = tileflash.flash_attn_func(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    ref_lowp, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert out.dtype == c.dtype and lse.dtype == torch.float32 and lse.shape == (c.b, c.hq, c.sq)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


# ---------------------------------------------------------------------------------------------------------------
# flash_attn_varlen_func
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VarlenCase:
    lens_q: tuple
    lens_k: tuple
    seqused_k: tuple | None
    extra_max_q: int  # max_seqlen_q = max(lens_q) + extra (it only sizes the grid)
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    causal: bool
    window: tuple
    softcap: float
    scale: float | None
    q_layout: Layout
    k_layout: Layout
    v_layout: Layout
    garbage: str
    seed: int


@st.composite
def varlen_cases(draw):
    d, big = draw(head_dims())
    hq, hkv = draw(head_counts())
    max_len = (LIM["seqlen_big_d"] if big else LIM["seqlen"]) // 2 + 1
    nseq = draw(st.sampled_from([2, 3, 1, 4, 0] + ([6] if LONG else [])))
    lens_q = tuple(draw(lengths(max_len)) for _ in range(nseq))
    lens_k = tuple(draw(lengths(max_len)) for _ in range(nseq))
    seqused = None
    if draw(st.booleans()):
        seqused = tuple(draw(st.one_of(st.just(n), st.just(0), st.integers(0, n))) for n in lens_k)
    causal, window, softcap, scale = draw(masks(max_len))
    return VarlenCase(lens_q, lens_k, seqused, draw(st.sampled_from([0, 0, 0, 1, 17])), hq, hkv, d,
                      draw(st.sampled_from(DTYPES)), causal, window, softcap, scale, draw(layouts(3)),
                      draw(layouts(3)), draw(layouts(3)), draw(GARBAGE), draw(_seed()))


def _cu(lens):
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(DEVICE, torch.int32)


@fuzz_settings(0.8)
@given(case=varlen_cases())
def test_fuzz_flash_attn_varlen_func(case: VarlenCase):
    c = case
    gen = torch.Generator().manual_seed(c.seed)
    tq, tk = sum(c.lens_q), sum(c.lens_k)
    q, _ = rand_view(gen, (tq, c.hq, c.d), c.dtype, c.q_layout)
    k, _ = rand_view(gen, (tk, c.hkv, c.d), c.dtype, c.k_layout)
    v, _ = rand_view(gen, (tk, c.hkv, c.d), c.dtype, c.v_layout)
    cu_q, cu_k = _cu(c.lens_q), _cu(c.lens_k)
    used = None
    if c.seqused_k is not None:
        used = torch.tensor(c.seqused_k, dtype=torch.int32, device=DEVICE)
        for i, n in enumerate(c.seqused_k):  # keys past seqused_k are not the kernel's to read
            k0, k1 = int(cu_k[i]) + n, int(cu_k[i + 1])
            k[k0:k1] = garbage_fill(c.garbage, gen, (k1 - k0, c.hkv, c.d), c.dtype)
            v[k0:k1] = garbage_fill(c.garbage, gen, (k1 - k0, c.hkv, c.d), c.dtype)
    max_q = max(c.lens_q, default=0) + c.extra_max_q
    max_k = max(c.lens_k, default=0)
    kw = dict(softmax_scale=c.scale, causal=c.causal, window_size=c.window, softcap=c.softcap)
    out, lse = tileflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=used,
                                                return_lse=True, **kw)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, used, **kw)
    ref_lowp, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, used, upcast=False, **kw)
    assert out.shape == q.shape and lse.shape == (c.hq, tq)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)


# ---------------------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeCase:
    seqlens: tuple  # cache_seqlens before the append
    sq: int
    s_new: int
    empty_kv: bool  # s_new == 0 passed as k/v of length 0 (else k=v=None)
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    page_size: int | None  # None: contiguous [B, capacity, Hkv, D]
    capacity: int  # contiguous: S_max; paged: max_pages * page_size
    spare_pages: int
    table_pad: int  # extra columns in the block table's buffer (row stride > max_pages)
    causal: bool
    window: tuple
    softcap: float
    scale: float | None
    num_splits: int
    sp_overlap: bool
    q_layout: Layout
    cache_layouts: tuple  # (k_cache, v_cache)
    new_layout: Layout
    garbage: str
    seed: int


@st.composite
def decode_cases(draw):
    d, big = draw(head_dims())
    hq, hkv = draw(head_counts())
    sq = draw(st.one_of(st.sampled_from([1, 1, 2, 16]), st.integers(1, 16)))
    s_new = draw(st.one_of(st.just(0), st.just(sq), st.integers(0, sq)))
    page_size = draw(PAGE_SIZES)
    cap_hi = LIM["capacity_big_d"] if big else LIM["capacity"]
    want = draw(st.integers(max(s_new, 1), max(s_new, 1, cap_hi)))
    if page_size is None:
        capacity = want
    else:
        max_pages = math.ceil(want / page_size) + draw(st.sampled_from([0, 0, 1]))
        capacity = max_pages * page_size
    # One sequence costs Hkv x M-tile programs per split, together looping over the 16-key blocks (+ ~9 splits).
    m_tiles = cdiv(sq * hq // hkv, decode_block_m(sq * hq // hkv))
    b = draw(batches([1, 2, 3, 4], hkv * m_tiles * (cdiv(capacity, 16) + 9) * dim_cost(d)))
    top = capacity - s_new  # cache_seqlens + Snew <= capacity
    seqlens = tuple(draw(st.one_of(st.just(0), st.just(top), st.integers(0, top))) for _ in range(b))
    causal, window, softcap, scale = draw(masks(capacity))
    causal = causal or draw(st.booleans())  # engines decode causally: bias towards it
    return DecodeCase(seqlens, sq, s_new, draw(st.booleans()), hq, hkv, d, draw(st.sampled_from(DTYPES)),
                      page_size, capacity, draw(st.sampled_from([1, 0, 3])), draw(st.sampled_from([0, 0, 2])),
                      causal, window, softcap, scale, draw(num_splits(b * hkv * m_tiles)), draw(st.booleans()),
                      draw(layouts(4)), (draw(layouts(4)), draw(layouts(4))), draw(layouts(4)), draw(GARBAGE),
                      draw(_seed()))


def make_decode_inputs(c: DecodeCase):
    """(q, k_cache, v_cache, k_buf, v_buf, k, v, cache_seqlens, block_table): caches hold randn up to each
    cache_seqlens and garbage after it; paged pools are in random order with spare (garbage) pages, and block-table
    entries a sequence never reaches point at a garbage page."""
    gen = torch.Generator().manual_seed(c.seed)
    b = len(c.seqlens)
    q, _ = rand_view(gen, (b, c.sq, c.hq, c.d), c.dtype, c.q_layout)
    table = None
    if c.page_size is None:
        shape = (b, c.capacity, c.hkv, c.d)
    else:
        max_pages = c.capacity // c.page_size
        num_pages = b * max_pages + c.spare_pages + 1  # +1: a trap page for the unused table entries
        shape = (num_pages, c.page_size, c.hkv, c.d)
        perm = torch.randperm(num_pages, generator=gen)
        rows = perm[: b * max_pages].reshape(b, max_pages).to(torch.int32)
        for i, n in enumerate(c.seqlens):
            rows[i, math.ceil((n + c.s_new) / c.page_size):] = int(perm[-1])  # the trap page
        tbuf = torch.full((b, max_pages + c.table_pad), -7, dtype=torch.int32, device=DEVICE)
        table = tbuf[:, :max_pages]
        table.copy_(rows)
    caches, bufs = [], []
    for layout in c.cache_layouts:
        cache, buf = strided(shape, c.dtype, layout)
        cache.copy_(garbage_fill(c.garbage, gen, shape, c.dtype))
        caches.append(cache)
        bufs.append(buf)
    for cache in caches:  # real tokens [0, cache_seqlens)
        for i, n in enumerate(c.seqlens):
            if table is None:
                cache[i, :n] = torch.randn(n, c.hkv, c.d, generator=gen).to(DEVICE, c.dtype)
            else:
                pos = torch.arange(n, device=DEVICE)
                cache[table[i, pos // c.page_size].long(), pos % c.page_size] = \
                    torch.randn(n, c.hkv, c.d, generator=gen).to(DEVICE, c.dtype)
    k = v = None
    if c.s_new or c.empty_kv:
        k, _ = rand_view(gen, (b, c.s_new, c.hkv, c.d), c.dtype, c.new_layout)
        v, _ = rand_view(gen, (b, c.s_new, c.hkv, c.d), c.dtype, c.new_layout)
    seqlens = torch.tensor(c.seqlens, dtype=torch.int32, device=DEVICE)
    return q, caches[0], caches[1], bufs[0], bufs[1], k, v, seqlens, table


def _same_view(buf, view, like):
    """The view `view` takes of its buffer, taken of `like` (a clone of that buffer)."""
    return torch.as_strided(like, view.shape, view.stride(), view.storage_offset() - buf.storage_offset())


@fuzz_settings(1.2)
@given(case=decode_cases())
def test_fuzz_flash_attn_with_kvcache(case: DecodeCase):
    c = case
    event(f"cache: {'contiguous' if c.page_size is None else 'paged'}")
    event(f"splits: {'heuristic' if c.num_splits == 0 else 'none' if c.num_splits == 1 else 'forced'}")
    event(f"append: {'Snew > 0' if c.s_new else 'none'}")
    q, k_cache, v_cache, k_buf, v_buf, k, v, seqlens, table = make_decode_inputs(c)
    kw = dict(softmax_scale=c.scale, causal=c.causal, window_size=c.window, softcap=c.softcap)
    ref, ref_lse, ref_k, ref_v = kvcache_ref(q, k_cache, v_cache, k, v, seqlens, table, **kw)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, k, v, seqlens, table, upcast=False, **kw)
    # Expected buffers after the call: the reference's appended caches written back into copies of the buffers,
    # so a stray write anywhere in the buffer (padding, other sequences, spare pages) is caught too.
    want_k_buf, want_v_buf = k_buf.clone(), v_buf.clone()
    _same_view(k_buf, k_cache, want_k_buf).copy_(ref_k)
    _same_view(v_buf, v_cache, want_v_buf).copy_(ref_v)
    out, lse = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                 block_table=table, num_splits=c.num_splits, return_lse=True,
                                                 sp_overlap=c.sp_overlap, **kw)
    assert out.shape == q.shape and lse.shape == (len(c.seqlens), c.hq, c.sq)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)
    assert same_bits(k_cache, ref_k) and same_bits(v_cache, ref_v), "appended cache contents differ"
    assert same_bits(k_buf, want_k_buf) and same_bits(v_buf, want_v_buf), "write outside the appended slots"


# ---------------------------------------------------------------------------------------------------------------
# merge_attn_states
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MergeCase:
    shape: tuple  # [B, S, H, D] or [T, H, D]
    dtype: torch.dtype
    lse_scale: float
    lse_offset_b: float  # shifts part b against part a (large: one part dominates, exp underflows)
    p_empty: float  # probability that a part's row is empty (lse = -inf)
    out_layout: Layout
    lse_layout: Layout
    seed: int


@st.composite
def merge_cases(draw):
    four_d = draw(st.booleans())
    d = draw(st.one_of(st.sampled_from([1, 8, 16, 40, 64, 128, 256]), st.integers(1, 300)))
    if four_d:
        shape = (draw(st.integers(0, 3)), draw(lengths(20)), draw(st.integers(1, 6)), d)
    else:
        shape = (draw(lengths(40)), draw(st.integers(1, 6)), d)
    ndim = len(shape)
    return MergeCase(shape, draw(st.sampled_from(DTYPES + [torch.float32])),
                     draw(st.sampled_from([1.0, 5.0, 30.0])), draw(st.sampled_from([0.0, 3.0, -50.0, 1e3])),
                     draw(st.sampled_from([0.0, 0.2, 0.5, 1.0])), draw(layouts(ndim)), draw(layouts(ndim - 1)),
                     draw(_seed()))


@fuzz_settings(2.0)  # cheap: one launch, no KV loop
@given(case=merge_cases())
def test_fuzz_merge_attn_states(case: MergeCase):
    c = case
    gen = torch.Generator().manual_seed(c.seed)
    lse_shape = (c.shape[1], c.shape[0]) if len(c.shape) == 3 else (c.shape[0], c.shape[2], c.shape[1])
    oa, _ = rand_view(gen, c.shape, c.dtype, c.out_layout)
    ob, _ = rand_view(gen, c.shape, c.dtype, c.out_layout)
    parts = []
    for offset in (0.0, c.lse_offset_b):
        vals = torch.randn(*lse_shape, generator=gen) * c.lse_scale + offset
        vals[torch.rand(*lse_shape, generator=gen) < c.p_empty] = float("-inf")
        part, _ = strided(lse_shape, torch.float32, c.lse_layout)
        part.copy_(vals)
        parts.append(part)
    la, lb = parts
    out, lse = tileflash.merge_attn_states(oa, la, ob, lb)
    # merge_ref takes [B, S, H, D] / [B, H, S]; the 3-D layout is its batch-1 case.
    lift = (lambda t: t[None]) if len(c.shape) == 3 else (lambda t: t)
    ref32, ref_lse = merge_ref(lift(oa.float()), lift(la), lift(ob.float()), lift(lb))
    ref32, ref_lse = ref32.reshape(c.shape), ref_lse.reshape(lse_shape)
    assert out.shape == c.shape and out.dtype == c.dtype and lse.shape == lse_shape
    if c.dtype == torch.float32:  # no lower precision to compare with: a few fp32 ulps of the largest output
        assert not torch.isnan(out).any(), "out: NaN (unwritten?)"
        if out.numel():
            err = (out - ref32).abs().max().item()
            assert err <= 1e-5 * max(1.0, ref32.abs().max().item()), f"out: max error {err:.3e}"
    else:
        check_2x(out, ref32, round_like_kernel(ref32, c.dtype))
    finite = ref_lse[torch.isfinite(ref_lse)]
    check_lse(lse, ref_lse, atol=max(1e-3, 4e-7 * finite.abs().max().item() if finite.numel() else 0.0))


# ---------------------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache over FP8 / NVFP4 caches
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LowpDecodeCase:
    fmt: str  # "fp8" (per-tensor scales), "fp8-head" (per-KV-head scales), "nvfp4"
    seqlens: tuple
    sq: int
    s_new: int
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    page_size: int | None
    capacity: int
    causal: bool
    window: tuple
    softcap: float
    num_splits: int
    seed: int


@st.composite
def lowp_decode_cases(draw):
    fmt = draw(st.sampled_from(["fp8", "fp8-head", "nvfp4"]))
    d = draw(st.sampled_from([32, 64, 128] if fmt == "nvfp4" else [16, 8, 40, 64, 128]))
    hq, hkv = draw(head_counts())
    sq = draw(st.sampled_from([1, 1, 2, 5, 16]))
    s_new = draw(st.sampled_from([0, sq, 1]))
    page_size = draw(PAGE_SIZES)
    want = draw(st.integers(max(s_new, 1), max(s_new, 1, LIM["capacity_big_d"] if d > 64 else LIM["capacity"])))
    capacity = want if page_size is None else math.ceil(want / page_size) * page_size
    m_tiles = cdiv(sq * hq // hkv, decode_block_m(sq * hq // hkv))
    b = draw(batches([1, 2, 3], hkv * m_tiles * (cdiv(capacity, 16) + 9) * dim_cost(d)))
    seqlens = tuple(draw(st.one_of(st.just(0), st.just(capacity - s_new), st.integers(0, capacity - s_new)))
                    for _ in range(b))
    causal, window, softcap, _ = draw(masks(capacity))
    return LowpDecodeCase(fmt, seqlens, sq, s_new, hq, hkv, d, draw(st.sampled_from(DTYPES)), page_size, capacity,
                          causal or draw(st.booleans()), window, softcap, draw(num_splits(b * hkv * m_tiles)),
                          draw(_seed()))


@fuzz_settings(0.5)
@given(case=lowp_decode_cases())
def test_fuzz_flash_attn_with_kvcache_lowp(case: LowpDecodeCase):
    """Quantized caches (paged or not, appends quantized in the call): output against attention over the
    dequantized cache with the 2x rule, appended bytes (and NVFP4 block scales) equal to the reference's."""
    from tileflash.lowp.formats import nvfp4_quantize_ref
    from tileflash.reference import fp8_quantize_ref

    c = case
    event(f"cache format: {c.fmt}")
    gen = torch.Generator().manual_seed(c.seed)
    b = len(c.seqlens)
    table = None
    if c.page_size is None:
        shape = (b, c.capacity, c.hkv, c.d)
    else:
        pages = c.capacity // c.page_size
        shape = (b * pages + 2, c.page_size, c.hkv, c.d)
        table = torch.randperm(shape[0], generator=gen)[: b * pages].reshape(b, pages).to(DEVICE, torch.int32)
    k_hi, v_hi = (torch.randn(*shape, generator=gen).to(DEVICE) for _ in range(2))
    if c.fmt == "nvfp4":
        (k_cache, k_scale, k_g), (v_cache, v_scale, v_g) = nvfp4_quantize_ref(k_hi), nvfp4_quantize_ref(v_hi)
        scales = dict(k_scale=k_scale, v_scale=v_scale, k_global_scale=k_g.reshape(1), v_global_scale=v_g.reshape(1))
    else:
        n = c.hkv if c.fmt == "fp8-head" else 1
        k_s, v_s = ((torch.rand(n, generator=gen) * 0.02 + 0.003).to(DEVICE) for _ in range(2))
        k_cache, v_cache = fp8_quantize_ref(k_hi, k_s), fp8_quantize_ref(v_hi, v_s)
        scales = dict(k_scale=k_s, v_scale=v_s)
    q = torch.randn(b, c.sq, c.hq, c.d, generator=gen).to(DEVICE, c.dtype)
    k = v = None
    if c.s_new:
        k, v = (torch.randn(b, c.s_new, c.hkv, c.d, generator=gen).to(DEVICE, c.dtype) for _ in range(2))
    kw = dict(cache_seqlens=torch.tensor(c.seqlens, dtype=torch.int32, device=DEVICE), block_table=table,
              causal=c.causal, window_size=c.window, softcap=c.softcap, **scales)
    ref, ref_lse, ref_k, ref_v = kvcache_ref(q, k_cache, v_cache, k, v, **kw)
    ref_lowp, _, _, _ = kvcache_ref(q, k_cache, v_cache, k, v, upcast=False, **kw)
    out, lse = tileflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=c.num_splits,
                                                 return_lse=True, **kw)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse)
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    if c.fmt == "nvfp4":  # the reference returns (data, block scales) pairs
        assert torch.equal(bits(k_cache), bits(ref_k[0])) and torch.equal(bits(v_cache), bits(ref_v[0]))
        assert torch.equal(bits(k_scale), bits(ref_k[1])) and torch.equal(bits(v_scale), bits(ref_v[1]))
    else:
        assert torch.equal(bits(k_cache), bits(ref_k)) and torch.equal(bits(v_cache), bits(ref_v))


# ---------------------------------------------------------------------------------------------------------------
# nvfp4_quantize / nvfp4_dequantize / nvfp4_matmul
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Nvfp4Case:
    rows: int  # N: rows of the quantized matrix
    k: int  # a multiple of 16
    m: int  # rows of the activation for the GEMM
    x_dtype: torch.dtype
    a_dtype: torch.dtype
    octaves: int  # per-row magnitudes spread over 2^-octaves .. 2^octaves
    zero_blocks: bool
    seed: int


@st.composite
def nvfp4_cases(draw):
    return Nvfp4Case(draw(lengths(40)), 16 * draw(st.integers(1, 12)), draw(lengths(33)),
                     draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
                     draw(st.sampled_from(DTYPES)), draw(st.sampled_from([0, 3, 12])), draw(st.booleans()),
                     draw(_seed()))


@fuzz_settings(0.5)
@given(case=nvfp4_cases())
def test_fuzz_nvfp4_quantize_and_matmul(case: Nvfp4Case):
    """The Triton quantizer is bit-exact with the reference (data, scales, global scale), dequantize likewise,
    and nvfp4_matmul meets the 2x rule against a.float() @ dequant(w).T."""
    from tileflash.lowp.formats import nvfp4_dequantize_ref, nvfp4_quantize_ref

    c = case
    gen = torch.Generator().manual_seed(c.seed)
    x = torch.randn(c.rows, c.k, generator=gen) * torch.exp2(torch.randint(-c.octaves, c.octaves + 1, (c.rows, 1),
                                                                            generator=gen).float())
    if c.zero_blocks and c.rows:
        x.view(c.rows, c.k // 16, 16)[:, torch.randint(0, c.k // 16, (1,), generator=gen)] = 0.0
    x = x.to(DEVICE, c.x_dtype)
    data, scales, g = tileflash.nvfp4_quantize(x)
    ref_data, ref_scales, ref_g = nvfp4_quantize_ref(x)
    assert torch.equal(data, ref_data) and torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
    assert torch.equal(g.float().reshape(()), ref_g.float().reshape(()))
    w = tileflash.nvfp4_dequantize(data, scales, g)
    assert torch.equal(w, nvfp4_dequantize_ref(ref_data, ref_scales, ref_g))
    # Activations scaled so that outputs stay inside fp16's range whatever the weights' magnitudes.
    a = (torch.randn(c.m, c.k, generator=gen) / max(1.0, float(w.abs().max()) if w.numel() else 1.0))
    a = a.to(DEVICE, c.a_dtype)
    out = tileflash.nvfp4_matmul(a, data, scales, g)
    assert out.shape == (c.m, c.rows) and out.dtype == c.a_dtype
    check_2x(out, a.float() @ w.T, a @ w.to(c.a_dtype).T)


# ---------------------------------------------------------------------------------------------------------------
# flash_attn_func backward
# ---------------------------------------------------------------------------------------------------------------
@fuzz_settings(0.2)  # three kernels plus the reference's autograd per example
@given(case=prefill_cases())
def test_fuzz_flash_attn_func_backward(case: PrefillCase):
    """dq, dk, dv (with a gradient through lse too) against autograd of the fp32 reference, 2x rule, on the
    prefill cases' shapes, masks and strided layouts."""
    gen, q, k, v, kw = prefill_inputs(case)
    dout = torch.randn(case.b, case.sq, case.hq, case.d, generator=gen).to(DEVICE)
    dlse = torch.randn(case.b, case.hq, case.sq, generator=gen).to(DEVICE)
    check_grads(lambda *a: tileflash.flash_attn_func(*a, return_lse=True, **kw),
                lambda *a, upcast: attention_ref(*a, upcast=upcast, **kw),
                [x.detach().requires_grad_() for x in (q, k, v)], dout, dlse)
