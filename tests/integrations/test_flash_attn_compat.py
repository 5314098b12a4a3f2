"""flash-attn's module names on tileflash (tileflash/integrations/flash_attn.py): `import flash_attn` (2.x) and
`import flash_attn_interface` (FA3) after install(), each with its own library's signatures, so positional calls
written for either bind as they do there."""
import inspect
import sys

import pytest
import torch

import tileflash
from helpers import DEVICE, attention_inputs, packed_inputs
from tileflash import reference
from tileflash.integrations import fa2, fa3
from tileflash.integrations import flash_attn as compat

# flash-attn's own parameter lists, in order (2.8's flash_attn/flash_attn_interface.py; FA3's
# hopper/flash_attn_interface.py). tileflash may add trailing parameters, never reorder these.
FA2 = {
    "flash_attn_func": "q k v dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
                       "return_attn_probs",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p softmax_scale "
                              "causal window_size softcap alibi_slopes deterministic return_attn_probs block_table",
    "flash_attn_qkvpacked_func": "qkv dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
                                 "return_attn_probs",
    "flash_attn_kvpacked_func": "q kv dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic "
                                "return_attn_probs",
    "flash_attn_varlen_qkvpacked_func": "qkv cu_seqlens max_seqlen dropout_p softmax_scale causal window_size softcap "
                                        "alibi_slopes deterministic return_attn_probs",
    "flash_attn_varlen_kvpacked_func": "q kv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p "
                                       "softmax_scale causal window_size softcap alibi_slopes deterministic "
                                       "return_attn_probs",
    "flash_attn_with_kvcache": "q k_cache v_cache k v rotary_cos rotary_sin cache_seqlens cache_batch_idx "
                               "cache_leftpad block_table softmax_scale causal window_size softcap rotary_interleaved "
                               "alibi_slopes num_splits return_softmax_lse",
}
FA3 = {
    "flash_attn_func": "q k v softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk "
                       "softcap num_splits pack_gqa deterministic sm_margin return_attn_probs",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_q seqused_k "
                              "softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk "
                              "softcap num_splits pack_gqa deterministic sm_margin return_attn_probs",
    "flash_attn_combine": "out_partial lse_partial out out_dtype",
    "flash_attn_qkvpacked_func": "qkv softmax_scale causal q_descale k_descale v_descale window_size attention_chunk "
                                 "softcap deterministic num_heads_q sm_margin return_attn_probs",
    "flash_attn_with_kvcache": "q k_cache v_cache k v qv rotary_cos rotary_sin cache_seqlens cache_batch_idx "
                               "cache_leftpad page_table cu_seqlens_q cu_seqlens_k_new max_seqlen_q rotary_seqlens "
                               "q_descale k_descale v_descale softmax_scale causal window_size attention_chunk "
                               "softcap rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin "
                               "return_softmax_lse",
}


@pytest.fixture
def installed():
    before = {name: sys.modules.get(name) for name in compat.MODULES}
    compat.install()
    yield
    compat.uninstall()
    assert {name: sys.modules.get(name) for name in compat.MODULES} == before


@pytest.mark.parametrize("module, table", [(fa2, FA2), (fa3, FA3)], ids=["flash_attn", "flash_attn_interface"])
def test_signatures_are_flash_attns(module, table):
    for name, params in table.items():
        got = list(inspect.signature(getattr(module, name)).parameters)
        assert got[:len(params.split())] == params.split(), name


def test_flash_attn_2x_code_runs_unchanged(installed):
    """2.x's positional order: dropout_p fourth, softmax_scale fifth; return_attn_probs gives three values."""
    import flash_attn
    from flash_attn import flash_attn_func
    from flash_attn.flash_attn_interface import flash_attn_varlen_func

    assert flash_attn.__version__.startswith("2.")
    q, k, v = attention_inputs(2, 33, 33, 4, 2, 64, torch.float16, seed=1)
    scale = 0.3
    want, lse = tileflash.flash_attn_func(q, k, v, scale, True, return_lse=True)
    out, got_lse, probs = flash_attn_func(q, k, v, 0.0, scale, True, (-1, -1), 0.0, None, False, True)
    assert torch.equal(out, want) and torch.equal(got_lse, lse) and probs.numel() == 0
    torch.manual_seed(0)
    dropped = flash_attn_func(q, k, v, 0.2, scale, True)
    torch.manual_seed(0)
    assert torch.equal(dropped, tileflash.flash_attn_func(q, k, v, scale, True, dropout_p=0.2))

    qp, kp, vp, cu_q, cu_k = packed_inputs([7, 20], [9, 20], 4, 2, 64, torch.float16, seed=2)
    want = tileflash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 20, 20, causal=True)
    assert torch.equal(flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 20, 20, 0.0, None, True), want)


def test_flash_attn_2x_paged_varlen_takes_cu_seqlens_k_as_key_counts(installed):
    from flash_attn import flash_attn_varlen_func

    q, _, _, cu_q, _ = packed_inputs([5, 3], [5, 3], 4, 2, 64, torch.float16, seed=3)
    g = torch.Generator().manual_seed(4)
    kc, vc = (torch.randn(6, 16, 2, 64, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([40, 21], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 40, 61], dtype=torch.int32, device=DEVICE)
    want = tileflash.flash_attn_varlen_func(q, kc, vc, cu_q, None, 5, 48, seqused_k=used, block_table=table,
                                            causal=True)
    assert torch.equal(flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 5, 48, causal=True, block_table=table), want)


def test_bert_padding_round_trip_around_a_varlen_call(installed):
    """2.x's unpad / call / pad pattern gives the padded call's rows."""
    from flash_attn import flash_attn_varlen_func
    from flash_attn.bert_padding import pad_input, unpad_input

    q, k, v = attention_inputs(2, 12, 12, 2, 2, 32, torch.float16, seed=5)
    mask = torch.ones(2, 12, dtype=torch.int32, device=DEVICE)
    mask[1, 7:] = 0  # the second sequence is 7 tokens, right-padded
    (qu, idx, cu, max_len, used), (ku, *_), (vu, *_) = (unpad_input(x, mask) for x in (q, k, v))
    assert cu.tolist() == [0, 12, 19] and max_len == 12 and used.tolist() == [12, 7] and qu.shape[0] == 19
    out = pad_input(flash_attn_varlen_func(qu, ku, vu, cu, cu, max_len, max_len, causal=True), idx, 2, 12)
    assert torch.equal(out[0], tileflash.flash_attn_func(q[:1], k[:1], v[:1], causal=True)[0])
    assert torch.equal(out[1, :7], tileflash.flash_attn_func(q[1:, :7], k[1:, :7], v[1:, :7], causal=True)[0])
    assert not out[1, 7:].any()


def test_fa3_code_runs_unchanged(installed):
    """FA3's positional order: softmax_scale fourth, causal fifth; seqused_q / seqused_k after max_seqlen_k; qv
    sixth in flash_attn_with_kvcache, whose return_softmax_lse gives (out, lse)."""
    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    q, k, v = attention_inputs(1, 20, 20, 4, 2, 64, torch.float16, seed=6)
    assert torch.equal(flash_attn_func(q, k, v, 0.2, True), tileflash.flash_attn_func(q, k, v, 0.2, True))
    out, lse = flash_attn_func(q, k, v, None, True, return_attn_probs=True)
    want, want_lse = tileflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)

    qp, kp, vp, cu_q, cu_k = packed_inputs([6, 9], [8, 9], 4, 2, 64, torch.float16, seed=7)
    used_k = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    assert torch.equal(flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 9, 9, None, used_k, None, True),
                       tileflash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 9, 9, used_k, causal=True))

    kc, vc = (torch.randn(2, 32, 2, 64, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.float16)
              for _ in range(2))
    qd = q[:, :1].expand(2, 1, 4, 64).contiguous()
    lens = torch.tensor([30, 11], dtype=torch.int32, device=DEVICE)
    want = tileflash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, return_softmax_lse=True)
    got = flash_attn_with_kvcache(qd, kc, vc, None, None, None, None, None, lens, return_softmax_lse=True)
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))  # FA3's (out, lse, *accums)


def test_fa3_packed_qkv_with_and_without_num_heads_q(installed):
    from flash_attn_interface import flash_attn_qkvpacked_func

    q, k, v = attention_inputs(2, 17, 17, 4, 2, 64, torch.float16, seed=15)
    fused = torch.cat([q, k, v], dim=2).requires_grad_()  # a fused GQA projection: [B, S, Hq + 2 Hkv, D]
    out = flash_attn_qkvpacked_func(fused, None, True, num_heads_q=4)
    assert torch.equal(out, tileflash.flash_attn_func(q, k, v, causal=True))
    out.float().sum().backward()
    assert fused.grad is not None and fused.grad.shape == fused.shape
    k4, v4 = (x.repeat_interleave(2, dim=2) for x in (k, v))
    out, lse = flash_attn_qkvpacked_func(torch.stack([q, k4, v4], 2), causal=True, return_attn_probs=True)
    assert torch.equal(out, tileflash.flash_attn_func(q, k4, v4, causal=True)) and lse.shape == (2, 4, 17)
    with pytest.raises(ValueError, match="num_heads_q"):
        flash_attn_qkvpacked_func(fused, num_heads_q=3)


def test_fa3_combine(installed):
    """FA3's flash_attn_combine against the merge of the partials in torch: an empty split (-inf) weighs nothing,
    lse_partial as FA3 keeps it (seqlen contiguous), bf16 into a given out."""
    from flash_attn_interface import flash_attn_combine

    g = torch.Generator().manual_seed(16)
    out_partial = torch.randn(3, 2, 5, 4, 40, generator=g).to(DEVICE)
    lse_partial = torch.randn(3, 2, 4, 5, generator=g).to(DEVICE).transpose(2, 3)  # [splits, B, S, H], S contiguous
    lse_partial[1, 0] = float("-inf")
    weights = torch.softmax(lse_partial, dim=0)
    want = (weights[..., None] * out_partial).sum(0)
    out, lse = flash_attn_combine(out_partial, lse_partial)
    assert out.dtype == torch.float32 and lse.shape == (2, 5, 4)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(lse_partial, dim=0), atol=1e-5, rtol=1e-5)
    given = torch.empty(2, 5, 4, 40, dtype=torch.bfloat16, device=DEVICE)
    assert flash_attn_combine(out_partial, lse_partial, out=given)[0] is given
    torch.testing.assert_close(given.float(), want, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="lse_partial"):
        flash_attn_combine(out_partial, lse_partial[:, :1])


def test_flash_attn_conventions_beyond_the_signatures(installed):
    """2.x's lse is +inf for a row that sees no key (FA3's -inf, as tileflash's); both copy inputs whose last dim
    is strided; FA3 reads descales for e4m3 inputs only; int32 indices in bert_padding; FA3's
    get_scheduler_metadata."""
    import flash_attn
    import flash_attn_interface
    from flash_attn.bert_padding import index_first_axis, pad_input

    q, k, v = attention_inputs(1, 5, 2, 2, 2, 32, torch.float16, seed=9)  # causal, Sq > Sk: rows 0-2 see no key
    _, lse, _ = flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.isposinf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    _, lse = flash_attn_interface.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.isneginf(lse[..., :3]).all()

    wide = torch.randn(1, 5, 2, 64, generator=torch.Generator().manual_seed(10)).to(DEVICE, torch.float16)
    strided = wide[..., ::2]  # last dim stride 2
    want = tileflash.flash_attn_func(strided.contiguous(), k, v)
    assert torch.equal(flash_attn.flash_attn_func(strided, k, v), want)
    assert torch.equal(flash_attn_interface.flash_attn_func(strided, k, v), want)
    ones = torch.ones(1, 2, device=DEVICE)
    assert torch.equal(flash_attn_interface.flash_attn_func(q, k, v, q_descale=ones, k_descale=ones, v_descale=ones),
                       tileflash.flash_attn_func(q, k, v))

    rows, idx = torch.randn(3, 4, device=DEVICE), torch.tensor([5, 0, 2], dtype=torch.int32, device=DEVICE)
    padded = pad_input(rows, idx, 2, 3)
    assert torch.equal(padded.view(6, 4)[idx.long()], rows) and torch.equal(index_first_axis(padded.view(6, 4), idx),
                                                                            rows)
    assert flash_attn_interface.get_scheduler_metadata(2, 1, 64, 4, 2, 64, torch.zeros(2, dtype=torch.int32)) is None


def test_real_flash_attn_submodules_still_import(installed, tmp_path, monkeypatch):
    """With a flash-attn package on the path, `flash_attn` resolves to tileflash and its other submodules (e.g.
    flash_attn.layers.rotary) to the real package's files."""
    compat.uninstall()
    real = tmp_path / "flash_attn"
    (real / "layers").mkdir(parents=True)
    (real / "__init__.py").write_text("")
    (real / "layers" / "__init__.py").write_text("")
    (real / "layers" / "rotary.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    compat.install()
    try:
        import flash_attn
        from flash_attn.layers.rotary import REAL
        from flash_attn_3.flash_attn_interface import flash_attn_func

        assert flash_attn is fa2 and REAL and flash_attn_func is fa3.flash_attn_func
    finally:
        for name in [n for n in sys.modules if n.startswith("flash_attn.layers")]:
            del sys.modules[name]


def test_uninstall_restores_what_was_there():
    sentinel = type(sys)("flash_attn")
    previous, fa3_before = sys.modules.get("flash_attn"), sys.modules.get("flash_attn_interface")
    sys.modules["flash_attn"] = sentinel
    try:
        compat.install()
        import flash_attn

        assert flash_attn is fa2
        compat.uninstall()
        assert sys.modules["flash_attn"] is sentinel and sys.modules.get("flash_attn_interface") is fa3_before
    finally:
        if previous is None:
            sys.modules.pop("flash_attn", None)
        else:
            sys.modules["flash_attn"] = previous


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_flash_attn_private_forward_and_backward(installed, dropout_p):
    """flash-attn 2.8's lower-level functions, as ring-attention libraries call them (by keyword, from their own
    autograd): the same results as tileflash's autograd through flash_attn_func / flash_attn_varlen_func, the
    dropout seed passed from forward to backward as rng_state."""
    from flash_attn.flash_attn_interface import (_flash_attn_backward, _flash_attn_forward,
                                                 _flash_attn_varlen_backward, _flash_attn_varlen_forward)

    q, k, v = attention_inputs(2, 19, 23, 4, 2, 64, torch.float16, seed=11)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.float16)
    kw = dict(dropout_p=dropout_p, softmax_scale=None, causal=True)
    torch.manual_seed(3)
    out, lse, s_dmask, rng = _flash_attn_forward(q, k, v, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                                 alibi_slopes=None, return_softmax=False, **kw)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, window_size_left=-1, window_size_right=-1,
                             softcap=0.0, alibi_slopes=None, deterministic=True, rng_state=rng, **kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(3)
    want, want_lse = tileflash.flash_attn_func(*leaves, causal=True, dropout_p=dropout_p, deterministic=True,
                                               return_lse=True)
    grads = torch.autograd.grad(want, leaves, dout)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and s_dmask.numel() == 0
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), grads))
    assert d.shape == lse.shape
    torch.testing.assert_close(d, (dout.float() * out.float()).sum(-1).transpose(1, 2))
    if dropout_p:  # return_softmax: S_dmask with the pattern the seed handed over as rng_state gives
        torch.manual_seed(3)
        _, _, s_dmask, rng = _flash_attn_forward(q, k, v, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                                 alibi_slopes=None, return_softmax=True, **kw)
        keep = reference.dropout_keep(int(rng), dropout_p, 4, 19, 23, range(2), device=DEVICE)
        seen = reference.visible_mask(19, 23, True, device=DEVICE)
        assert torch.equal((s_dmask[:, :, :19, :23] >= 0) | ~seen, keep | ~seen)
        with pytest.raises(ValueError, match="rng_state"):
            _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, window_size_left=-1, window_size_right=-1,
                                 softcap=0.0, alibi_slopes=None, deterministic=True, **kw)

    qp, kp, vp, cu_q, cu_k = packed_inputs([7, 12], [9, 12], 4, 2, 64, torch.float16, seed=13)
    doutp = torch.randn(qp.shape, generator=torch.Generator().manual_seed(14)).to(DEVICE, torch.float16)
    torch.manual_seed(4)
    out, lse, _, rng = _flash_attn_varlen_forward(qp, kp, vp, cu_q, cu_k, 12, 12, **kw)
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    _flash_attn_varlen_backward(doutp, qp, kp, vp, out, lse, dq, dk, dv, cu_q, cu_k, 12, 12, window_size_left=-1,
                                window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=True,
                                rng_state=rng, **kw)
    leaves = [t.clone().requires_grad_() for t in (qp, kp, vp)]
    torch.manual_seed(4)
    want = tileflash.flash_attn_varlen_func(*leaves, cu_q, cu_k, 12, 12, causal=True, dropout_p=dropout_p,
                                            deterministic=True)
    grads = torch.autograd.grad(want, leaves, doutp)
    assert torch.equal(out, want) and all(torch.equal(a, b) for a, b in zip((dq, dk, dv), grads))


def _read_s_dmask(s_dmask, q, k, causal, window, block_n, alibi_slopes=None):
    """What flash-attn's tests read from S_dmask [B, H, >= Sq, >= Sk] of a padded call: (kept [B, H, Sq, Sk], the
    probabilities): |S| times exp(m_j - lse), m_j the row max over key block j and the blocks after it."""
    sq, sk = q.shape[1], k.shape[1]
    s_dmask = s_dmask[:, :, :sq, :sk].float()
    seen = reference.visible_mask(sq, sk, causal, window, device=q.device)
    s = reference.scores_ref(q.float(), k.float(), None, causal, window, alibi_slopes=alibi_slopes)
    lse = torch.logsumexp(s, -1, keepdim=True)
    block_max = torch.stack([blk.amax(-1) for blk in s.split(block_n, dim=-1)], dim=-1)
    m = block_max.flip(-1).cummax(-1).values.flip(-1).repeat_interleave(block_n, dim=-1)[..., :sk]
    probs = (s_dmask.abs() * torch.exp(m - lse)).masked_fill(~seen, 0.0)
    return (s_dmask >= 0) | ~seen, probs


@pytest.mark.parametrize("causal, window, alibi", [(False, (-1, -1), False), (True, (-1, -1), True),
                                                   (False, (20, 7), False)], ids=["full", "causal-alibi", "window"])
def test_2x_s_dmask_is_what_flash_attns_dropout_tests_read(causal, window, alibi):
    """flash-attn 2.x's dropout tests take the mask (S_dmask >= 0) and the probabilities (|S_dmask| renormalised per
    key block of _get_block_size_n) from S_dmask, build their reference output from that mask, and compare out,
    the probabilities and the dropped fraction. Here: the mask is the kernel's own pattern (the out built from it
    matches), the probabilities are softmax's, and about p of the visible entries are dropped."""
    p = 0.17
    q, k, v = attention_inputs(2, 70, 90, 4, 2, 64, torch.float16, seed=6)
    slopes = torch.rand(2, 4, device=DEVICE) * 0.3 if alibi else None
    out, lse, s_dmask = fa2.flash_attn_func(q, k, v, p, None, causal, window, alibi_slopes=slopes,
                                            return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 128, 128) and s_dmask.dtype == q.dtype
    kept, probs = _read_s_dmask(s_dmask, q, k, causal, window, fa2._get_block_size_n(q.device, 64, True, causal),
                                slopes)
    want, ref_lse = reference.attention_ref(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes)
    seen = reference.visible_mask(70, 90, causal, window, device=DEVICE)
    s = reference.scores_ref(q.float(), k.float(), None, causal, window, alibi_slopes=slopes)
    softmax = torch.exp(s - ref_lse[..., None])
    assert (probs - softmax).abs().max() < 2e-3  # fp16 probabilities
    dropped_out = torch.einsum("bhqk,bkhd->bqhd", torch.where(kept, softmax, 0.0) / (1 - p),
                               v.float().repeat_interleave(2, dim=2))
    assert (out.float() - dropped_out).abs().max() < 1e-2
    fraction = float((~kept & seen).sum() / (seen.sum() * 2 * 4))
    assert abs(fraction - p) < 0.02
    assert not torch.equal(out, want)  # dropout ran


def test_2x_s_dmask_of_packed_and_varlen_calls():
    """The packed and varlen forms give each sequence's S_dmask from row and column 0 (lengths rounded up to 128),
    with that sequence's own pattern: the same values as a padded call of the one sequence's dropout pattern."""
    p = 0.3
    qp, kp, vp, cu_q, cu_k = packed_inputs([7, 33], [40, 33], 2, 2, 32, torch.float16, seed=7)
    torch.manual_seed(3)
    out, _, s_dmask = fa2.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 33, 40, p, causal=True,
                                                 return_attn_probs=True)
    assert s_dmask.shape == (2, 2, 128, 128)
    torch.manual_seed(3)
    seed = int(tileflash._utils.dropout_seed(qp.device))
    for b, (q0, q1, k0, k1) in enumerate([(0, 7, 0, 40), (7, 40, 40, 73)]):
        keep = reference.dropout_keep(seed, p, 2, q1 - q0, k1 - k0, [b], device=DEVICE)[0]
        seen = reference.visible_mask(q1 - q0, k1 - k0, True, device=DEVICE)
        got = s_dmask[b, :, :q1 - q0, :k1 - k0]
        assert torch.equal((got >= 0) | ~seen, keep | ~seen)
        assert (s_dmask[b, :, q1 - q0:] == 0).all() and (s_dmask[b, :, :, k1 - k0:] == 0).all()
    qkv = torch.stack(attention_inputs(1, 50, 50, 2, 2, 32, torch.float16, seed=8), dim=2)
    torch.manual_seed(4)
    _, _, packed_probs = fa2.flash_attn_qkvpacked_func(qkv, p, return_attn_probs=True)
    torch.manual_seed(4)
    _, _, probs = fa2.flash_attn_func(*qkv.unbind(2), p, return_attn_probs=True)
    assert torch.equal(packed_probs, probs)
    assert fa2.flash_attn_qkvpacked_func(qkv, 0.0, return_attn_probs=True)[2].numel() == 0


def test_2x_block_size_table():
    """_get_block_size_n (flash-attn's tests import it from flash_attn.flash_attn_interface): its table on sm_90."""
    got = [fa2._get_block_size_n("cpu", d, drop, causal) for d in (32, 64, 96, 128, 160, 256)
           for drop in (False, True) for causal in (False, True)]
    assert got == [128] * 4 + [128, 128, 64, 64] + [64] * 4 + [64, 64, 32, 32] + [32] * 4 + [64] * 4
