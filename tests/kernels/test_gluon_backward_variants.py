"""The sm_90 Gluon dK/dV kernel's variants that a config can ask for beyond the planner's picks (keys-major scores,
dQ split by rows, one or two fences), on the cases of tests/kernels/test_gluon_backward.py (its own file so each
GPU test file compiles and runs inside one device call)."""
import pytest
import torch

import tileflash
from helpers import DEVICE, check_grads
from test_gluon_backward import CASES, _leaves, _takes_ws, needs_sm90
from tileflash.plan import WsBwdConfig
from tileflash.reference import attention_ref


# The kernel's constexpr variants on the cases of each head dim, beside the planner's pick (plan.WsBwdConfig): one
# or two fences per step (the planner takes one at d128 causal and d64, two at d128 non-causal), dQ split by rows
# (d64's pick) or by columns (d128's).
TILE_CONFIGS = {
    128: [WsBwdConfig(64, 2, True, False), WsBwdConfig(64, 2, True, True)],
    64: [WsBwdConfig(128, 2, True, True), WsBwdConfig(128, 2, True, False, dq_by_rows=True),
         WsBwdConfig(128, 2, True, True, dq_by_rows=True)],
}


TILE_CASES = ([(case, cfg, False) for case in CASES if case[1] > 1 for cfg in TILE_CONFIGS[case[5]]]
              + [(case, TILE_CONFIGS[case[5]][1], True) for case in (CASES[4], CASES[7])])  # without the dQ product


def _tile_id(x):
    if isinstance(x, WsBwdConfig):
        return "rows%d-fence%d" % (x.dq_by_rows, x.one_fence)
    return "-".join(map(str, x)) if isinstance(x, tuple) else ("deterministic" if x else "atomic_dq")


@needs_sm90
@pytest.mark.parametrize("case,cfg,deterministic", TILE_CASES, ids=_tile_id)
def test_ws_backward_tile_configs(case, cfg, deterministic, override):
    b, sq, sk, hq, hkv, d, causal = case
    override(bwd_ws=cfg)
    q, k, v = _leaves(b, sq, sk, hq, hkv, d, torch.bfloat16)
    assert _takes_ws(q, k, v, causal)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(b, sq, hq, d, generator=g).to(DEVICE)
    dlse = torch.randn(b, hq, sq, generator=g).to(DEVICE)
    check_grads(lambda q, k, v: tileflash.flash_attn_func(q, k, v, causal=causal, return_lse=True,
                                                          deterministic=deterministic),
                lambda q, k, v, upcast: attention_ref(q, k, v, causal=causal, upcast=upcast), (q, k, v), dout, dlse)
