"""tileflash.config.override: the explicit replacement of the planners' choices that sweeps and tests use."""
import dataclasses

import pytest
import torch

import tileflash
from helpers import attention_inputs, check_2x
from tileflash import config
from tileflash.plan import DecodeConfig, FwdConfig, decode_schedule
from tileflash.reference import attention_ref


def _schedule():
    q = torch.zeros(1, 1, 8, 64, dtype=torch.float16)
    cache = torch.zeros(1, 4096, 2, 64, dtype=torch.float16)
    return decode_schedule(q, cache, cache, None, None, 0, False, lse_in_workspace=True)


def test_override_replaces_and_restores_the_planners_choice():
    default = _schedule()
    forced = DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)
    with config.override(decode=forced):
        assert _schedule().cfg == forced
        with config.override(decode=lambda cfg: dataclasses.replace(cfg, num_stages=3)):  # nests, edits the choice
            assert _schedule().cfg == dataclasses.replace(default.cfg, num_stages=3)
        assert _schedule().cfg == forced
    assert _schedule() == default


def test_override_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="unknown kinds"):
        with config.override(decode_tiles=None):
            pass


def test_override_drops_cached_plans():
    """A call planned before the block must not keep its plan inside it (and the reverse): the forced tile shows
    in the results (a poisoned output and the reference catch a tile that was never launched)."""
    q, k, v = attention_inputs(1, 40, 40, 2, 2, 64, torch.float16, seed=1)
    ref, _ = attention_ref(q, k, v, causal=True)
    low, _ = attention_ref(q, k, v, causal=True, upcast=False)
    check_2x(tileflash.flash_attn_func(q, k, v, causal=True), ref, low)
    seen = []

    def spy(cfg):
        seen.append(cfg)
        return FwdConfig(16, 16, 4, 1, tma=cfg.tma)

    with config.override(fwd=spy, fwd_ws=None):
        check_2x(tileflash.flash_attn_func(q, k, v, causal=True), ref, low)
    assert seen, "the cached plan was reused inside the override block"
    check_2x(tileflash.flash_attn_func(q, k, v, causal=True), ref, low)
    assert len(seen) == 1


def test_every_kind_names_a_planner():
    """Each kind is read by the planner it names (grep-level check that no kind is dead)."""
    import inspect

    from tileflash.launch import backward as launch_backward, lowp
    from tileflash.ops import prefill
    from tileflash.plan import backward, decode, prefill as plan_prefill

    sources = "".join(inspect.getsource(m) for m in (launch_backward, lowp, prefill, backward, decode, plan_prefill))
    for kind in config.KINDS:
        assert f'chosen("{kind}"' in sources, kind
