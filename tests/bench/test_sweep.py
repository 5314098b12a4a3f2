"""`python -m tileflash sweep`: its variant grammar and families (the timing itself needs a GPU)."""
import dataclasses

import pytest

from tileflash import config
from tileflash.bench import sweep
from tileflash.plan import DecodeConfig, WsBwdConfig


def test_vary_is_a_cartesian_product_split_into_config_fields_and_call_arguments():
    variants = sweep.parse_vary(["block_n=32,64", "tma=0,1", "num_splits=0,8"], DecodeConfig)
    assert len(variants) == 8
    assert variants[0] == ({"block_n": 32, "tma": False}, {"num_splits": 0})
    assert variants[-1] == ({"block_n": 64, "tma": True}, {"num_splits": 8})


def test_vary_values_parse_as_numbers_bools_or_strings():
    [(cfg, call)] = sweep.parse_vary(["dq_by_rows=true", "block_m=128", "fmt=fp8"], WsBwdConfig)
    assert cfg == {"dq_by_rows": True, "block_m": 128} and call == {"fmt": "fp8"}
    with pytest.raises(SystemExit):
        sweep.parse_vary(["block_m"], WsBwdConfig)


def test_a_config_kind_in_vary_forces_that_planner_not_the_call(monkeypatch):
    """--vary combine_pdl=0,1 beside decode tiles: the decode planner's stages replaced, combine_pdl forced through
    config.override, and neither reaches the call."""
    seen = []

    def make(shape, call):
        cfg = config.chosen("decode", DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=2))
        seen.append((cfg.num_stages, config.chosen("combine_pdl", "planner's"), call))
        return (lambda: sweep.torch.zeros(1)), (lambda ms: (ms, "ms"))

    family = dataclasses.replace(sweep.FAMILIES["decode"], make=make, rotate=False)
    monkeypatch.setattr(sweep, "bench_ms", lambda fn: 1.0)
    for cfg, call in sweep.parse_vary(["num_stages=3", "combine_pdl=0,1", "num_splits=4"], DecodeConfig):
        sweep.run_variant(family, (1,), cfg, call)
    assert seen == [(3, 0, {"num_splits": 4}), (3, 1, {"num_splits": 4})]
    assert config.chosen("combine_pdl", "planner's") == "planner's"  # the block ended


@pytest.mark.parametrize("name", sorted(sweep.FAMILIES))
def test_every_family_overrides_a_known_kind_with_its_dataclass(name):
    family = sweep.FAMILIES[name]
    assert family.kind in config.KINDS and all(k in config.KINDS for k in family.also)
    assert family.config.__name__ in config.KINDS[family.kind]
    assert dataclasses.is_dataclass(family.config) and family.shapes
    assert name in sweep.FAMILY_HELP


def test_sweep_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(sweep.torch.cuda, "is_available", lambda: False)
    assert sweep.main(["decode"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_check_column_says_how_far_a_variant_is_from_the_default():
    assert sweep.check_cell({"ok": True, "diff": 0.001}) == "ok"
    assert sweep.check_cell({"ok": False, "diff": 0.0234}) == "diff 2.3%"
    assert sweep.check_cell({"ok": False, "error": "OutOfResources"}) == "OutOfResources"
