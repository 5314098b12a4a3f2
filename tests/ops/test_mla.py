"""MLA decode (DeepSeek-V2/V3's multi-head latent attention through FA3's qv): every query head attends over one
latent cache v_cache [.., 1, 512] that is both the value and the key's latent part, next to a 64-wide rotary key
k_cache [.., 1, 64]; score = q . k + qv . v. Checked against kvcache_ref (the concatenated query and key) with the
2x rule: contiguous and paged caches (pages in random order), H = 16 and 128, split-KV, appends, several query
tokens, sinks; decode_plan and packed queries bitwise against the plain call; and the input checks."""
import pytest
import torch

import tileflash
from helpers import DEVICE, check_kvcache_call
from tileflash.plan import decode as plan_decode

ROPE, LATENT = 64, 512


def _mla_inputs(b, sq, hq, ctx, page, s_new=0, dtype=torch.bfloat16, seed=0, hkv=1, latent=LATENT):
    """q [b, sq, hq, 64], qv [b, sq, hq, latent], caches [b, ctx, hkv, 64 / latent] or a pool of `page`-token pages
    in random order with its block table, and s_new appended rows (or None)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    q, qv = mk(b, sq, hq, ROPE), mk(b, sq, hq, latent)
    rows = (b * ctx // page, page) if page else (b, ctx)
    kc, vc = mk(*rows, hkv, ROPE), mk(*rows, hkv, latent)
    table = None
    if page:
        table = torch.randperm(rows[0], generator=g).to(torch.int32).view(b, -1).to(DEVICE)
    new = (mk(b, s_new, hkv, ROPE), mk(b, s_new, hkv, latent)) if s_new else (None, None)
    return q, qv, kc, vc, table, new


# (batch, Sq, Hq, ctx, page, appended, cache lengths, num_splits, causal, dtype)
CASES = [
    (2, 1, 16, 96, None, 0, (90, 17), 1, False, torch.bfloat16),  # H=16 (one 16-row tile), ragged lengths
    (2, 1, 16, 96, None, 0, (90, 17), 3, False, torch.float16),  # the same split: partials of 512 merged
    (1, 1, 128, 64, 16, 0, (61,), 2, False, torch.bfloat16),  # H=128 (two 64-row tiles), paged, split
    (2, 2, 16, 128, 64, 2, (70, 0), 2, True, torch.bfloat16),  # page 64, a 2-token append, causal, an empty cache
    (1, 3, 32, 48, 16, 1, (30,), 1, True, torch.float16),  # 3 tokens x 32 heads = 96 rows: a partial M tile
]


@pytest.mark.parametrize("case", CASES, ids=["h16", "h16_split", "h128_paged_split", "page64_append_causal",
                                             "sq3_h32"])
def test_mla_decode(case):
    b, sq, hq, ctx, page, s_new, lens, splits, causal, dtype = case
    q, qv, kc, vc, table, (kn, vn) = _mla_inputs(b, sq, hq, ctx, page, s_new, dtype, seed=hq + ctx)
    lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    check_kvcache_call(q, kn, vn, kc, vc, qv=qv, cache_seqlens=lens, block_table=table, num_splits=splits,
                       causal=causal)


@pytest.mark.parametrize("page, splits, ctx, lens", [(None, 1, 64, (40, 62)), (16, 3, 64, (40, 62)),
                                                     (None, 3, 640, (333, 639))])
def test_mla_fp8_latent_cache(page, splits, ctx, lens, hq=16):
    """An e4m3 latent cache with its own scale (and the rotary keys with theirs): the score's two parts carry
    different scales, so qv is rescaled by v_scale / k_scale in the kernel; appends quantize both. The longer
    cache spans several of the 16-row FP8 tile's 128-token steps (MLA_FP8_TILES) per split, a partial last one."""
    from tileflash.reference import fp8_quantize_ref

    q, qv, kc, vc, table, (kn, vn) = _mla_inputs(2, 1, hq, ctx, page, s_new=1, seed=21)
    k_scale, v_scale = (torch.tensor([s], device=DEVICE) for s in (0.01, 0.013))
    lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    check_kvcache_call(q, kn, vn, fp8_quantize_ref(kc, k_scale), fp8_quantize_ref(vc, v_scale), qv=qv,
                       cache_seqlens=lens, block_table=table, num_splits=splits, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("hq, ctx, lens, tile", [(16, 640, (333, 639), (16, 128, False)),
                                                 (32, 640, (333, 639), (16, 128, False)),
                                                 (128, 200, (133, 199), (64, 32, True))])
def test_mla_fp8_latent_cache_gpu_tile(hq, ctx, lens, tile):
    """The long FP8 case on the Triton kernel at the tile the sm_90 planner takes for FP8 latents (MLA_FP8_TILES:
    up to 32 rows as 16-row tiles of 128-token steps, 64 rows transposed in 32-token steps), forced under the
    interpreter too, whose own tiles step 16 tokens untransposed (on the GPU the Gluon kernel, which takes FP8
    calls of up to 32 rows, declined)."""
    from tileflash import config

    gpu_tile = plan_decode.mla_decode_config(hq, fp8=True)
    assert (gpu_tile.block_m, gpu_tile.block_n, gpu_tile.trans) == tile
    with config.override(mla_decode=lambda chosen: gpu_tile, mla_gluon=lambda chosen: None):
        test_mla_fp8_latent_cache(None, 3, ctx, lens, hq=hq)


def test_mla_sink_and_gqa_latent():
    """The other decode features stay available with qv: a learnable sink (split: added once, in the combine) and
    several KV heads of a narrower latent."""
    q, qv, kc, vc, table, _ = _mla_inputs(2, 1, 8, 64, None, seed=5, hkv=2, latent=128)
    sink = torch.linspace(1.0, 4.0, 8, device=DEVICE)
    check_kvcache_call(q, None, None, kc, vc, qv=qv, cache_seqlens=torch.tensor([64, 33], dtype=torch.int32,
                                                                                device=DEVICE),
                       num_splits=2, learnable_sink=sink)


def test_mla_default_scale_and_plan():
    """The default scale is FA3's 1 / sqrt(64 + 512); decode_plan (shapes given) and FA3's packed queries of one
    length give the plain call's result bitwise."""
    b, sq, hq = 2, 2, 16
    q, qv, kc, vc, table, _ = _mla_inputs(b, sq, hq, 64, 16, seed=9)
    lens = torch.tensor([50, 63], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, block_table=table, causal=True, num_splits=2)
    out, lse = tileflash.flash_attn_with_kvcache(q, kc, vc, qv=qv, return_softmax_lse=True, **kw)
    assert out.shape == (b, sq, hq, LATENT)
    scaled = tileflash.flash_attn_with_kvcache(q, kc, vc, qv=qv, softmax_scale=(ROPE + LATENT) ** -0.5, **kw)
    assert torch.equal(out, scaled)
    plan = tileflash.decode_plan(q.shape, kc, vc, lens, block_table=table, causal=True, num_splits=2,
                                 return_lse=True, dtype=q.dtype, qv=qv.shape)
    p_out, p_lse = plan.run(q, kc, vc, qv=qv)
    assert torch.equal(p_out, out) and torch.equal(p_lse, lse)
    cu = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=DEVICE)
    packed = tileflash.flash_attn_with_kvcache(q.flatten(0, 1), kc, vc, qv=qv.flatten(0, 1), cu_seqlens_q=cu,
                                               max_seqlen_q=sq, **kw)
    assert torch.equal(packed, out.flatten(0, 1))
    with pytest.raises(ValueError, match="qv"):
        plan.run(q, kc, vc)  # the plan's qv is missing


def _bad(name):
    """(arguments, keyword overrides) of an MLA call made invalid in one way."""
    q, qv, kc, vc, _, _ = _mla_inputs(1, 1, 16, 32, None, seed=1)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    args, kw = [q, kc, vc], dict(qv=qv, cache_seqlens=lens)
    if name == "qv_shape":
        kw["qv"] = qv[..., :256]
    elif name == "qv_dtype":
        kw["qv"] = qv.half()
    elif name == "nvfp4_cache":
        args[1:] = [torch.zeros(1, 32, 1, ROPE // 2, dtype=torch.uint8, device=DEVICE),
                    torch.zeros(1, 32, 1, LATENT // 2, dtype=torch.uint8, device=DEVICE)]
    elif name == "too_many_tokens":
        args[0], kw["qv"] = q.expand(1, 17, 16, ROPE), qv.expand(1, 17, 16, LATENT)
    elif name == "sp_overlap":
        kw["sp_overlap"] = True
    elif name == "latent_too_wide":
        args[2], kw["qv"] = vc.repeat(1, 1, 1, 2), qv.repeat(1, 1, 1, 2)
    elif name == "no_qv":
        del kw["qv"]
    elif name == "new_v_width":
        args += [torch.zeros(1, 1, 1, ROPE, dtype=q.dtype, device=DEVICE),
                 torch.zeros(1, 1, 1, ROPE, dtype=q.dtype, device=DEVICE)]
    elif name == "ragged_packed":
        args[0], kw["qv"] = q[0], qv[0]
        kw.update(cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), max_seqlen_q=2)
    return args, kw


@pytest.mark.parametrize("name, match", [
    ("qv_shape", "qv: expected shape"), ("qv_dtype", "qv"), ("nvfp4_cache", "qv: MLA takes"),
    ("too_many_tokens", "at most 16"), ("sp_overlap", "sp_overlap"), ("latent_too_wide", "1..512"),
    ("no_qv", "different head dims need qv"), ("new_v_width", "v: expected shape"), ("ragged_packed", "packed"),
])
def test_mla_input_errors(name, match):
    args, kw = _bad(name)
    with pytest.raises((ValueError, TypeError), match=match):
        tileflash.flash_attn_with_kvcache(*args, **kw)


def test_mla_tiles_are_mla_config():
    """qv calls take plan.decode.mla_decode_config's tiles (not the 64-wide head's decode tiles) and never the
    register-operand kernel."""
    q, qv, kc, vc, _, _ = _mla_inputs(1, 1, 128, 32, None)
    s = plan_decode.decode_schedule(q, kc, vc, None, None, 0, False, lse_in_workspace=True, mla=True)
    assert s.qcfg is None and s.mla and s.cfg.block_m == 64


def test_mla_compile_matches_eager():
    """The custom op carries qv (its schema and fake implementation give out qv's shape)."""
    q, qv, kc, vc, table, (kn, vn) = _mla_inputs(2, 1, 16, 32, 16, s_new=1, seed=4)
    lens = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE)

    def step(q, qv, kc, vc):
        return tileflash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, qv=qv,
                                                 num_splits=2)

    eager_kc, eager_vc = kc.clone(), vc.clone()
    eager = step(q, qv, eager_kc, eager_vc)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, qv, kc, vc)
    assert compiled.shape == (2, 1, 16, LATENT)
    assert torch.equal(compiled, eager) and torch.equal(kc, eager_kc) and torch.equal(vc, eager_vc)
