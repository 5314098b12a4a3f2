"""The Gluon MLA decodes (kernels/gluon/mla_decode.py, mla_decode_narrow.py): GPU (sm_90) only, since Gluon has no CPU
interpreter (the CPU suite compiles them: tests/sm90_compile_check.py). Each case asserts that the call took that
kernel, then checks out and lse against kvcache_ref with the 2x rule (outputs poisoned). The kernel's caches hold NaN
everywhere a sequence has no key (past its length, unused pages), while the reference reads clean copies: a row the
kernel reads there and neither masks nor zeroes fails."""
import dataclasses

import pytest
import torch

import tileflash
from helpers import DEVICE, ON_SM90, check_2x, check_lse
from tileflash.ops import kvcache as decode_ops
from tileflash.plan import MlaGluonConfig
from tileflash.reference import kvcache_ref

pytestmark = pytest.mark.skipif(not ON_SM90, reason="the Gluon MLA decode runs on sm_90 GPUs only")

ROPE, LATENT = 64, 512

# (batch, Sq, Hq, capacity, page, appended, cache lengths before the append, num_splits, causal, dtype)
CASES = [
    (2, 1, 128, 1000, None, 0, (1000, 37), 0, False, torch.bfloat16),  # H=128, heuristic splits, 1-row tails
    (3, 1, 16, 4096, 64, 1, (4000, 31, 0), 0, False, torch.bfloat16),  # page 64 (engines'), append, empty cache
    (2, 2, 64, 704, 16, 2, (650, 100), 3, True, torch.float16),  # page 16: four copies a 64-token block; 2 row tiles
    (1, 4, 16, 320, 32, 0, (299,), 1, True, torch.bfloat16),  # page 32, causal among 4 tokens, no split
    (1, 16, 8, 640, 128, 16, (497,), 2, True, torch.bfloat16),  # 16 tokens x 8 heads, a 16-row append
    (1, 1, 128, 64, None, 0, (33,), 1, False, torch.bfloat16),  # one partial block (warpgroup 1's odd block absent)
    (1, 3, 32, 64, 8, 0, (64,), 1, True, torch.float16),  # page 8: one whole block of 8 copies, a partial row tile
    (4, 1, 128, 8192, 64, 1, (8191, 5000, 1, 3000), 0, False, torch.bfloat16),  # long, ragged, page 64
    # one split over 3..7 blocks of 64 keys: odd and even counts (the warpgroups alternate), the last partial
    # or whole
    (3, 1, 128, 512, None, 0, (300, 200, 448), 1, False, torch.bfloat16),
    (2, 2, 64, 512, 32, 1, (383, 130), 1, True, torch.bfloat16),
]


def _inputs(b, sq, hq, capacity, page, s_new, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    q, qv = mk(b, sq, hq, ROPE), mk(b, sq, hq, LATENT)
    table = None
    if page:
        pages = b * (capacity // page) + 2  # two pages no sequence uses
        kc, vc = mk(pages, page, 1, ROPE), mk(pages, page, 1, LATENT)
        table = torch.randperm(pages, generator=g)[:b * (capacity // page)].to(torch.int32).view(b, -1).to(DEVICE)
    else:
        kc, vc = mk(b, capacity, 1, ROPE), mk(b, capacity, 1, LATENT)
    new = (mk(b, s_new, 1, ROPE), mk(b, s_new, 1, LATENT)) if s_new else (None, None)
    return q, qv, kc, vc, table, new


def _poisoned(cache, lengths, table):
    """A copy of cache with NaN at every row no sequence's first lengths[b] keys occupy."""
    keep = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    for i, n in enumerate(lengths):
        t = torch.arange(n, device=cache.device)
        if table is None:
            keep[i, t] = True
        else:
            page = cache.shape[1]
            keep[table[i, t // page].long(), t % page] = True
    return cache.masked_fill(~keep[:, :, None, None], float("nan"))


def _counting(monkeypatch):
    calls = []
    launch = decode_ops.launch_mla_decode
    monkeypatch.setattr(decode_ops, "launch_mla_decode", lambda *a, **k: calls.append(1) or launch(*a, **k))
    return calls


def _check_call(calls, q, kc_got, vc_got, kc, vc, kn, vn, splits, **kw):
    """flash_attn_with_kvcache on the poisoned caches (kc_got, vc_got), which must take the Gluon MLA decode,
    against kvcache_ref on clean ones (the 2x rule, lse); returns the reference's caches after the append."""
    out, lse = tileflash.flash_attn_with_kvcache(q, kc_got, vc_got, kn, vn, num_splits=splits,
                                                 return_softmax_lse=True, **kw)
    assert calls, "the call did not take the Gluon MLA decode"
    ref, ref_lse, kc_ref, vc_ref = kvcache_ref(q, kc, vc, kn, vn, **kw)
    ref_lowp, *_ = kvcache_ref(q, kc, vc, kn, vn, upcast=False, **kw)
    check_2x(out, ref, ref_lowp)
    check_lse(lse, ref_lse, atol=2e-2)
    return kc_ref, vc_ref


@pytest.mark.parametrize("rows", [64, 16, 32, 8])  # the seesaw, the narrow kernel's tiles (mla_decode_narrow.py)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_gluon_mla_decode(case, rows, monkeypatch, override):
    b, sq, hq, capacity, page, s_new, lens, splits, causal, dtype = case
    calls = _counting(monkeypatch)
    override(mla_gluon=MlaGluonConfig(rows=rows))  # 8-row calls too (the planner keeps them on the Triton kernel)
    q, qv, kc, vc, table, (kn, vn) = _inputs(b, sq, hq, capacity, page, s_new, dtype, seed=hq + capacity)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    after = [n + s_new for n in lens]
    kc_got, vc_got = _poisoned(kc, after, table), _poisoned(vc, after, table)
    kc_ref, vc_ref = _check_call(calls, q, kc_got, vc_got, kc, vc, kn, vn, splits, cache_seqlens=seqlens,
                                 block_table=table, causal=causal, qv=qv)
    if s_new:  # the appended rows, where both copies have them
        for got, want in ((kc_got, kc_ref), (vc_got, vc_ref)):
            assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(_poisoned(want, after, table)))


# (batch, Sq, Hq, capacity, page, appended, cache lengths before the append, num_splits, causal)
FP8_CASES = [
    (2, 1, 16, 1000, None, 0, (1000, 37), 0, False),  # heuristic splits, 1-row tails
    (3, 1, 16, 4096, 64, 1, (4000, 31, 0), 0, False),  # page 64, append (quantized), an empty cache
    (2, 1, 32, 704, 16, 1, (650, 100), 3, False),  # a 32-row tile, page 16 (four copies a block)
    (1, 4, 8, 320, 32, 0, (299,), 1, True),  # causal among 4 tokens x 8 heads, no split, odd block count
    (2, 2, 8, 512, 16, 1, (500, 64), 2, True),  # causal 2 tokens x 8 heads (16 rows, AHEAD's), page 16, append
]


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "ahead"])  # AHEAD: block j + 1 widened beside P_j V_j
@pytest.mark.parametrize("case", FP8_CASES, ids=[f"case{i}" for i in range(len(FP8_CASES))])
def test_gluon_mla_fp8_cache(case, ahead, monkeypatch, override):
    """e4m3 latent and rotary caches with their own scales on the narrow kernel's widened blocks, the planner's
    choice; unwritten rows hold e4m3 NaN bytes (0x7f)."""
    from tileflash.reference import fp8_quantize_ref

    b, sq, hq, capacity, page, s_new, lens, splits, causal = case
    if ahead and sq * hq > 16:
        pytest.skip("AHEAD's two widened blocks leave room for 16-row tiles only")
    # the planner widens ahead at <= 16 rows (plan.decode.MLA_FP8_AHEAD_MAX_ROWS); "plain" keeps the other loop
    override(mla_gluon=lambda cfg: dataclasses.replace(cfg, ahead=ahead))
    calls = _counting(monkeypatch)
    q, qv, kc, vc, table, (kn, vn) = _inputs(b, sq, hq, capacity, page, s_new, torch.bfloat16, seed=7 + hq)
    k_scale, v_scale = torch.tensor([0.015], device=DEVICE), torch.tensor([0.02], device=DEVICE)
    kc8, vc8 = fp8_quantize_ref(kc, k_scale), fp8_quantize_ref(vc, v_scale)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    after = [n + s_new for n in lens]

    def nan_bytes(c):  # c with 0x7f (e4m3 NaN) at every row no sequence occupies
        bits = _poisoned(c.view(torch.uint8).to(torch.float32), after, table)
        return bits.nan_to_num(127.0).to(torch.uint8).view(torch.float8_e4m3fn)

    _check_call(calls, q, nan_bytes(kc8), nan_bytes(vc8), kc8, vc8, kn, vn, splits, cache_seqlens=seqlens,
                block_table=table, causal=causal, qv=qv, k_scale=k_scale, v_scale=v_scale)


def test_gluon_mla_plan_and_triton_agree(monkeypatch, override):
    """decode_plan's run gives the plain call's result bitwise; the Triton MLA kernel (the Gluon one declined by
    config) agrees within the 2x rule's bound of each other's errors."""
    b, sq, hq = 2, 1, 128
    q, qv, kc, vc, table, _ = _inputs(b, sq, hq, 2048, 64, 0, torch.bfloat16, seed=3)
    lens = torch.tensor([2000, 900], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, block_table=table)
    calls = _counting(monkeypatch)
    out, lse = tileflash.flash_attn_with_kvcache(q, kc, vc, qv=qv, return_softmax_lse=True, **kw)
    plan = tileflash.decode_plan(q.shape, kc, vc, lens, block_table=table, return_lse=True, dtype=q.dtype,
                                 qv=qv.shape)
    p_out, p_lse = plan.run(q, kc, vc, qv=qv)
    assert len(calls) == 2 and torch.equal(p_out, out) and torch.equal(p_lse, lse)
    override(mla_gluon=None)
    tri = tileflash.flash_attn_with_kvcache(q, kc, vc, qv=qv, **kw)
    assert len(calls) == 2  # declined
    ref, _, _, _ = kvcache_ref(q, kc, vc, qv=qv, **kw)
    check_2x(out, ref, tri)


def test_gluon_mla_declines(monkeypatch, override):
    """Calls outside its scope take the Triton kernel, even when forced: softcap, a window, a sink, a 63-token
    page, a narrower latent; and unforced, 4 rows (H=4, one token: plan.decode.MLA_GLUON_MIN_ROWS)."""
    calls = _counting(monkeypatch)
    q4, qv4, kc, vc, _, _ = _inputs(1, 1, 4, 128, None, 0, torch.bfloat16, seed=1)
    lens = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    tileflash.flash_attn_with_kvcache(q4, kc, vc, qv=qv4, cache_seqlens=lens)
    assert not calls
    q, qv = (torch.cat([t] * 4, dim=2) for t in (q4, qv4))  # 16 heads
    override(mla_gluon=MlaGluonConfig())
    for extra in (dict(softcap=5.0), dict(window_size=(50, 0)), dict(learnable_sink=torch.zeros(16, device=DEVICE))):
        tileflash.flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=lens, **extra)
    pool_k, pool_v = (c.flatten(0, 1)[:126].view(2, 63, 1, c.shape[-1]) for c in (kc, vc))
    tileflash.flash_attn_with_kvcache(q, pool_k, pool_v, qv=qv, cache_seqlens=lens,
                                      block_table=torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE))
    tileflash.flash_attn_with_kvcache(q, kc, vc[..., :256], qv=qv[..., :256], cache_seqlens=lens)
    assert not calls
