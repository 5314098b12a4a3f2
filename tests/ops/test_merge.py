"""merge_attn_states against the float32 reference, including empty (-inf) parts."""
import pytest
import torch

import tileflash
from helpers import DEVICE
from tileflash.reference import attention_ref, merge_ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_merge_matches_reference(dtype):
    g = torch.Generator().manual_seed(4)
    oa = torch.randn(2, 5, 3, 40, generator=g).to(DEVICE, dtype)
    ob = torch.randn(2, 5, 3, 40, generator=g).to(DEVICE, dtype)
    la = (torch.randn(2, 3, 5, generator=g) * 4).to(DEVICE)
    lb = (torch.randn(2, 3, 5, generator=g) * 4).to(DEVICE)
    la[0, 1, 2] = float("-inf")  # part a empty on this row: result is part b
    la[1, 2, :] = float("-inf")
    lb[1, 2, :] = float("-inf")  # both parts empty: out 0, lse -inf
    out, lse = tileflash.merge_attn_states(oa, la, ob, lb)
    ref, ref_lse = merge_ref(oa, la, ob, lb)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert not torch.isnan(out).any()
    assert (out.float() - ref.float()).abs().max().item() <= tol
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.allclose(lse[~torch.isinf(lse)], ref_lse[~torch.isinf(ref_lse)], atol=1e-5)
    assert torch.all(out[1, :, 2] == 0)
    assert torch.allclose(out[0, 2, 1].float(), ob[0, 2, 1].float(), atol=tol)


def test_merging_two_halves_of_the_keys_equals_attention_over_all():
    """Cascade attention: attention over keys [0, 40) merged with keys [40, 70) is attention over [0, 70)."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 9, 4, 64, generator=g).to(DEVICE, torch.float16)
    k = torch.randn(1, 70, 4, 64, generator=g).to(DEVICE, torch.float16)
    v = torch.randn(1, 70, 4, 64, generator=g).to(DEVICE, torch.float16)
    oa, la = tileflash.flash_attn_func(q, k[:, :40], v[:, :40], return_lse=True)
    ob, lb = tileflash.flash_attn_func(q, k[:, 40:], v[:, 40:], return_lse=True)
    out, lse = tileflash.merge_attn_states(oa, la, ob, lb)
    ref, ref_lse = attention_ref(q, k, v)
    assert (out.float() - ref.float()).abs().max().item() <= 4e-3
    assert (lse - ref_lse).abs().max().item() <= 1e-3


def test_varlen_layout():
    g = torch.Generator().manual_seed(1)
    oa, ob = (torch.randn(11, 2, 16, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    la, lb = (torch.randn(2, 11, generator=g).to(DEVICE) for _ in range(2))
    out, lse = tileflash.merge_attn_states(oa, la, ob, lb)
    ref, ref_lse = merge_ref(oa[None], la[None], ob[None], lb[None])
    assert (out.float() - ref[0].float()).abs().max().item() <= 2e-3
    assert torch.allclose(lse, ref_lse[0], atol=1e-5)


def test_a_part_that_saw_no_key_contributes_nothing():
    """flash-attn 2.x marks a row that saw no key with lse = +inf (tileflash and FA3: -inf): both mean "no part",
    and such a part's out (here NaN: never written) is ignored."""
    g = torch.Generator().manual_seed(8)
    oa, ob = (torch.randn(1, 3, 2, 16, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    la, lb = (torch.randn(1, 2, 3, generator=g).to(DEVICE) for _ in range(2))
    la[0, 0, 0] = float("inf")
    oa[0, 0, 0] = float("nan")
    lb[0, 1, 2] = float("-inf")
    ob[0, 2, 1] = float("nan")
    out, lse = tileflash.merge_attn_states(oa, la, ob, lb)
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, 0, 0], ob[0, 0, 0]) and lse[0, 0, 0] == lb[0, 0, 0]
    assert torch.equal(out[0, 2, 1], oa[0, 2, 1]) and lse[0, 1, 2] == la[0, 1, 2]
    ref, ref_lse = merge_ref(oa, la, ob, lb)
    assert (out.float() - ref.float()).abs().max() <= 2e-3 and torch.allclose(lse, ref_lse, atol=1e-5)
